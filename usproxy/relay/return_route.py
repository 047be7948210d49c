"""ReturnRoute: the answers to a connection that came from the network with one of the node's own
addresses as its source are routed back out, not delivered to the node (issue 27 item 3).

The case: a load balancer hairpins the node's own connection, so a packet arrives from the network
with a LoadBalancer IP as its source, addressed to that same LB IP (kube-proxy's "same node to LB,
SNATted to LB (implicitly allowed)"). kube-proxy's iptables and nftables modes hold no LB IP as a
local address, so their answer (the endpoint's, de-NATed back to the LB IP) follows the routing
table out to the load balancer. usproxy holds every ClusterIP, externalIP and LB IP as a local
address on `usproxy0` (the relay listens there), so three things stood in the way, each shown
necessary by tests/offload/test_lb_ip_source.py:
- the kernel drops a packet whose source is a local address as a martian, before any hook, unless
  `accept_local`: ACCEPT_LOCAL (`net.ipv4.conf.all.accept_local`) is set to 1, and NFT_TABLE drops
  instead those whose source is one of the node's own addresses on its other interfaces (set
  `node-addresses`, rewritten when they change), so only usproxy0's Service addresses pass;
- the answer's destination is the LB IP, and table `local` (rule 0, consulted first) says it is
  this node's: the endpoint's answer (nftables datapath), or the relay's SYN-ACK, was delivered to
  the node itself. Connections that arrived from another interface than `lo` with a local
  source (`fib saddr type local`) get the conntrack mark RETURN_MARK in table `ip usproxy-return`
  (NFT_TABLE), and every packet of their reply direction gets it as packet mark: in prerouting
  (the endpoint's answer, before its routing decision) and in a route hook on output (the relay's
  own answers, which the kernel routes again when the mark changes);
- policy rules: `fwmark RETURN_MARK lookup main` (MARK_PRIORITY) ahead of `local`, which moves
  from priority 0 to LOCAL_PRIORITY (as Cilium moves it to 100): marked answers skip `local` and
  take main's route out. The node's own connections to its LB IPs cross `lo`, are not marked, and
  stay local, as do its answers to anything else.

Invariants: the rules usproxy adds carry RULE_PROTOCOL, so `remove_rules` takes back exactly its
own (and puts `local` back at priority 0 first: never a moment without a `local` rule); the new
`local` rule is added before the old one is deleted, so `reconcile_rules` never leaves one
either. Both are idempotent; `apply_table` rewrites NFT_TABLE atomically (`nft -f`, in place), so an agent
restart keeps the conntrack marks and with them the hairpinned connections, and it sets
accept_local only once the table (with its drop of the node's own addresses) is in place. Like `usproxy0`, everything stays when
the agent stops; `usproxy run --cleanup` removes the table and the rules, and sets accept_local
back to 0 when it removed the table (without the table's drop, the node's own addresses would
come in from the network as sources); so does an agent with `--hairpin-mark 0`, or beside a
datapath that keeps the table out. IPv4 only: IPv6 has no martian check of local sources, but its
`local` rule would need the same move; not done. A node without nftables (the relay alone) gets the
rules but neither the table nor accept_local, so nothing changes there. A strict `rp_filter` (1) on the interface the
load balancer's packets arrive on still drops them (their source's route is on `usproxy0`); loose
(2) and off (0) serve them (tried in the test's topology).
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from usproxy.model.types import IPAddress
from usproxy.relay.port_capture import run

log = logging.getLogger(__name__)

# RETURN_MARK is --hairpin-mark (off unless given; DEFAULT_MARK suggested): outside the bits kube-proxy (0x4000,
# 0x8000), Calico (0xffff0000), Cilium (0x0f00 and the upper 16), Istio (0x539), Weave (0x20000,
# 0x40000) and the AWS VPC CNI (0x80) use; usproxy's nftables datapath uses none
DEFAULT_MARK = 0x1000
NFT_TABLE = "usproxy-return"
MARK_PRIORITY, LOCAL_PRIORITY = 99, 100
RULE_PROTOCOL = 67  # FRA_PROTOCOL of usproxy's rules (unassigned; the kernel's own are 2)
TABLE_LOCAL, TABLE_MAIN = 255, 254
ACCEPT_LOCAL = Path("/proc/sys/net/ipv4/conf/all/accept_local")


def ruleset(mark_bit: int, node_addresses: Iterable[IPAddress], links: Iterable[str] = ()) -> str:
    """Table NFT_TABLE as nft input, one transaction: declared (a no-op when it exists), emptied
    and filled, so a rewrite keeps the table, and its place among the node's tables, as it was.
    `node_addresses`: the node's own IPv4 addresses on its other interfaces, which stay martians
    (dropped) when they come from the network as sources, as without accept_local; only usproxy0's
    (Service addresses) pass. Only packets to this node are marked or dropped in prerouting: a
    bridge with br_netfilter shows the node's prerouting every frame it bridges, and a frame
    between two other hosts (a DSR answer from an endpoint's node, whose source is this node's
    NodePort address) is none of this table's business. Forwarded packets with one of those
    sources were martians too and stay dropped, except those that leave by the link they came
    in by (`links`: the node's interfaces holding those addresses), which is what a bridged frame
    looks like in the forward hook."""
    mark = f"{mark_bit:#x}"
    elements = ", ".join(sorted(str(a) for a in node_addresses if a.version == 4))
    pairs = ", ".join(f'"{name}" . "{name}"' for name in sorted(set(links)))
    pre = "type filter hook prerouting priority mangle; policy accept;"
    out = "type route hook output priority mangle; policy accept;"
    fwd = "type filter hook forward priority mangle; policy accept;"
    return f"""table ip {NFT_TABLE} {{
  set node-addresses {{ type ipv4_addr; }}
  set same-link {{ typeof meta iifname . meta oifname; }}
  chain prerouting {{ {pre} }}
  chain forward {{ {fwd} }}
  chain output {{ {out} }}
}}
flush table ip {NFT_TABLE}
flush set ip {NFT_TABLE} node-addresses
flush set ip {NFT_TABLE} same-link
table ip {NFT_TABLE} {{
  set node-addresses {{
    type ipv4_addr;{f" elements = {{ {elements} }};" if elements else ""}
  }}
  set same-link {{
    typeof meta iifname . meta oifname;{f" elements = {{ {pairs} }};" if pairs else ""}
  }}
  chain prerouting {{
    {pre}
    iifname != "lo" ct state new fib daddr type local fib saddr type local ip saddr @node-addresses drop
    iifname != "lo" ct state new fib daddr type local fib saddr type local ct mark set ct mark | {mark}
    ct direction reply ct mark & {mark} == {mark} meta mark set meta mark | {mark}
  }}
  chain forward {{
    {fwd}
    iifname != "lo" ct state new ip saddr @node-addresses meta iifname . meta oifname != @same-link drop
  }}
  chain output {{
    {out}
    ct direction reply ct mark & {mark} == {mark} meta mark set meta mark | {mark}
  }}
}}
"""


def reconcile_rules(ipr: Any, mark: int) -> list[str]:
    """Make the IPv4 rules hold `fwmark RETURN_MARK lookup main` ahead of `local` (pyroute2
    IPRoute `ipr`, blocking; RETURN_MARK is `mark`); returns what changed. A mark rule of
    usproxy's with another mark (an earlier --hairpin-mark) goes. Raises pyroute2's NetlinkError."""
    done = []
    rules = _rules(ipr)
    if not any(_is_local(r) and _prio(r) == LOCAL_PRIORITY for r in rules):
        _quiet(lambda: ipr.rule("add", family=socket.AF_INET, priority=LOCAL_PRIORITY, table=TABLE_LOCAL,
                                protocol=RULE_PROTOCOL))
        done.append(f"+rule {LOCAL_PRIORITY} lookup local")
    if not any(_is_mark(r, mark) for r in rules):
        _quiet(lambda: ipr.rule("add", family=socket.AF_INET, priority=MARK_PRIORITY, table=TABLE_MAIN,
                                fwmark=mark, fwmask=mark, protocol=RULE_PROTOCOL))
        done.append(f"+rule {MARK_PRIORITY} fwmark {mark:#x} lookup main")
    for r in rules:
        if r.get_attr("FRA_PROTOCOL") == RULE_PROTOCOL and r.get_attr("FRA_FWMARK") not in (None, mark):
            old = r.get_attr("FRA_FWMARK")
            _quiet(lambda: ipr.rule("del", family=socket.AF_INET, priority=_prio(r), table=_table(r),
                                    fwmark=old, fwmask=old, protocol=RULE_PROTOCOL))
            done.append(f"-rule {_prio(r)} fwmark {old:#x}")
    for r in rules:  # only now: a `local` rule stays at every moment
        if _is_local(r) and _prio(r) < MARK_PRIORITY:
            _quiet(lambda: ipr.rule("del", family=socket.AF_INET, priority=_prio(r), table=TABLE_LOCAL))
            done.append(f"-rule {_prio(r)} lookup local")
    return done


def remove_rules(ipr: Any) -> list[str]:
    """Take back usproxy's rules, `local` at priority 0 first when usproxy moved it (a `local`
    rule another agent moved, e.g. Cilium's at 100, stays where it is); returns what changed."""
    done = []
    rules = _rules(ipr)
    mine = [r for r in rules if r.get_attr("FRA_PROTOCOL") == RULE_PROTOCOL]
    if any(_is_local(r) for r in mine) and not any(_is_local(r) and _prio(r) == 0 for r in rules):
        _quiet(lambda: ipr.rule("add", family=socket.AF_INET, priority=0, table=TABLE_LOCAL))
        done.append("+rule 0 lookup local")
    for r in mine:
        _quiet(lambda: ipr.rule("del", family=socket.AF_INET, priority=_prio(r), table=_table(r),
                                protocol=RULE_PROTOCOL))
        done.append(f"-rule {_prio(r)}")
    return done


def _rules(ipr: Any) -> list[Any]:
    return list(ipr.get_rules(family=socket.AF_INET))


def _prio(rule: Any) -> int:
    return int(rule.get_attr("FRA_PRIORITY") or 0)


def _table(rule: Any) -> int:
    return int(rule.get_attr("FRA_TABLE") or rule["table"])


def _is_local(rule: Any) -> bool:
    """A plain `lookup local` rule (no selector)."""
    return _table(rule) == TABLE_LOCAL and rule["action"] == 1 and not rule.get_attr("FRA_FWMARK") \
        and not rule["src_len"] and not rule["dst_len"] and not rule.get_attr("FRA_IIFNAME")


def _is_mark(rule: Any, mark: int) -> bool:
    return _table(rule) == TABLE_MAIN and rule.get_attr("FRA_FWMARK") == mark \
        and _prio(rule) < LOCAL_PRIORITY


def _quiet(call: Any) -> None:
    """Run one netlink change; one that finds its work done (a race with another agent) is no error."""
    try:
        call()
    except Exception as err:
        if getattr(err, "code", None) not in (errno.EEXIST, errno.ENOENT, errno.ESRCH):
            raise


async def apply_table(mark: int, node_addresses: Iterable[IPAddress], links: Iterable[str] = ()) -> str:
    """Write NFT_TABLE (atomically, see `ruleset`) and accept_local; "" when done, else why not."""
    code, err = await run(["nft", "-f", "-"], ruleset(mark, node_addresses, links))
    if code:
        return f"table ip {NFT_TABLE}: {err or f'nft exited {code}'}"
    try:  # only now: the table drops the node's own addresses as sources, as the martian check did
        if ACCEPT_LOCAL.read_text().strip() != "1":
            ACCEPT_LOCAL.write_text("1\n")
            log.info("net.ipv4.conf.all.accept_local=1: Service addresses as sources from the network are no martians")
    except OSError as exc:
        return f"accept_local: {exc.strerror or exc}"
    return ""


async def remove_table() -> str:
    """Delete NFT_TABLE and, when there was one, set accept_local back to 0: without the table's
    drop of the node's own addresses, accept_local would let them in from the network; "" when
    done (or there was none), else why not."""
    listed, _ = await run(["nft", "list", "table", "ip", NFT_TABLE], "")
    if listed:  # none (or no nft): accept_local is not ours to change
        return ""
    code, err = await run(["nft", "-f", "-"], f"table ip {NFT_TABLE} {{}}\ndelete table ip {NFT_TABLE}\n")
    if code:
        return f"table ip {NFT_TABLE}: {err or f'nft exited {code}'}"
    try:
        ACCEPT_LOCAL.write_text("0\n")
    except OSError as exc:
        return f"accept_local: {exc.strerror or exc}"
    return ""


async def remove(worker: Any) -> tuple[str, list[str]]:
    """Take back everything: the table (remove_table) and the policy rules (remove_rules, through
    `worker`, a NetlinkWorker); (why not, "" when done; the rule changes made)."""
    why = await remove_table()
    try:
        done = await worker.call(remove_rules)
    except Exception as err:
        return why or str(err), []
    return why, list(done)
