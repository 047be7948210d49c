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
  again all the martian check dropped but the hairpin itself, an LB IP as the source to that same
  LB IP (set `hairpins`, rewritten after a sync that changed the LB IPs; see `ruleset`, and
  tests/offload/test_lb_ip_source_attacks.py for each attack it stops);
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
accept_local only once the table (with its drops) is in place. Like `usproxy0`, everything stays when
the agent stops; `usproxy run --cleanup` removes the table and the rules, and sets accept_local
back to 0 when it removed the table (without the table's drops, local addresses would come in
from the network as sources); so does an agent with `--hairpin-mark 0`, or beside a
datapath that keeps the table out. IPv4 only: IPv6 has no martian check of local sources, but its
`local` rule would need the same move; not done. A node without nftables (the relay alone) gets the
rules but neither the table nor accept_local, so nothing changes there. A strict `rp_filter` (1) on the interface the
load balancer's packets arrive on still drops them (their source's route is on `usproxy0`); loose
(2) and off (0) serve them (tried in the test's topology). The kernel datapaths count the
hairpin as an outside client, as kube-proxy (its LB IPs are no local addresses): nftables by
`meta iiftype != loopback fib saddr type local` in prerouting, iptables by the conntrack mark.
A forwarded packet with a local source from a link that is not Ethernet (a tunnel) is dropped:
`ether daddr` cannot tell it bridged.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from usproxy.model.types import IPAddress
from usproxy.util.command import run

log = logging.getLogger(__name__)

# RETURN_MARK is --hairpin-mark, DEFAULT_MARK unless given: outside the bits kube-proxy (0x4000,
# 0x8000), Calico (0xffff0000), Cilium (0x0f00 and the upper 16), Istio (0x539), Weave (0x20000,
# 0x40000) and the AWS VPC CNI (0x80) use; usproxy's nftables datapath uses none
DEFAULT_MARK = 0x1000
NFT_TABLE = "usproxy-return"
MARK_PRIORITY, LOCAL_PRIORITY = 99, 100
RULE_PROTOCOL = 67  # FRA_PROTOCOL of usproxy's rules (unassigned; the kernel's own are 2)
TABLE_LOCAL, TABLE_MAIN = 255, 254
ACCEPT_LOCAL = Path("/proc/sys/net/ipv4/conf/all/accept_local")


Hairpin = tuple[IPAddress, str, int]  # an LB IP frontend: (address, protocol, port)


def ruleset(mark_bit: int, hairpins: Iterable[Hairpin] = (), links: Iterable[str] = (),
            link_macs: Iterable[str] = ()) -> str:
    """Table NFT_TABLE as nft input, one transaction: declared (a no-op when it exists), emptied
    and filled, so a rewrite keeps the table, and its place among the node's tables, as it was.

    accept_local lets every local source in from the network (and, with rp_filter 0, skips the
    kernel's check of broadcast sources); the table drops again all that the martian check
    dropped but the one real hairpin, in every conntrack state:
    - to the node (a unicast, broadcast or multicast destination; prerouting): a local source
      passes only as an LB IP to that same LB IP's ServicePort (set `hairpins`: `hairpins`'
      address . address . protocol . port), and then only in a connection the network opened
      (marked) or opens now: not into a flow of the node's own, which has the same addresses
      when a node process talks to its LB IP. A broadcast or anycast source is dropped. Only
      packets to the node: a bridge with br_netfilter shows the node's prerouting every frame it
      bridges, and a frame between two other hosts (a DSR answer from an endpoint's node, whose
      source is this node's NodePort address) is none of this table's business;
    - through the node (forward): a local, broadcast or anycast source is dropped but in the
      hairpins themselves (DNATed to their endpoint before the masquerade: the conntrack mark)
      and in frames the node only bridges. Those come in and leave by the same link (set
      `same-link`: `links`, the node's interfaces holding its addresses; br_netfilter names the
      bridge for both) and are addressed to another host's MAC; a packet the node routes is
      addressed to the MAC of the link it came in by (set `link-macs`: `link_macs`), also when
      it leaves by that link. A packet without a conntrack entry is dropped too;
    - the node's own packets (output): a connection the node opens in the original direction of
      an entry the network marked (a spoofed packet took its addresses and ports first) loses
      the mark, so the node's answers are not sent out to the load balancer.
    Connections that pass are marked (ct mark `mark_bit`) and their answers too (packet mark: in
    prerouting the endpoint's, in a route hook on output the relay's own). An earlier agent's
    set `node-addresses` goes."""
    mark, unmark = f"{mark_bit:#x}", f"{0xFFFFFFFF & ~mark_bit:#x}"
    pairs = ", ".join(f"{a} . {a} . {proto.lower()} . {port}"
                      for a, proto, port in sorted(hairpins, key=str) if a.version == 4)
    links_ = ", ".join(f'"{name}" . "{name}"' for name in sorted(set(links)))
    macs = ", ".join(sorted(set(link_macs)))
    pre = "type filter hook prerouting priority mangle; policy accept;"
    out = "type route hook output priority mangle; policy accept;"
    fwd = "type filter hook forward priority mangle; policy accept;"
    key = "ip saddr . ip daddr . meta l4proto . th dport"
    local_source = 'iifname != "lo" fib saddr type local'
    to_node = "fib daddr type { local, broadcast, multicast }"
    odd_source = 'iifname != "lo" ip saddr != 0.0.0.0 fib saddr type { local, broadcast, anycast }'
    hairpin = f"ct mark & {mark} == {mark}"
    return f"""table ip {NFT_TABLE} {{
  set hairpins {{ typeof {key}; }}
  set same-link {{ typeof meta iifname . meta oifname; }}
  set link-macs {{ type ether_addr; }}
  set node-addresses {{ type ipv4_addr; }}
  chain prerouting {{ {pre} }}
  chain forward {{ {fwd} }}
  chain output {{ {out} }}
}}
flush table ip {NFT_TABLE}
delete set ip {NFT_TABLE} hairpins
delete set ip {NFT_TABLE} same-link
delete set ip {NFT_TABLE} link-macs
delete set ip {NFT_TABLE} node-addresses
table ip {NFT_TABLE} {{
  set hairpins {{
    typeof {key};{_elements(pairs)}
  }}
  set same-link {{
    typeof meta iifname . meta oifname;{_elements(links_)}
  }}
  set link-macs {{
    type ether_addr;{_elements(macs)}
  }}
  chain prerouting {{
    {pre}
    ct direction reply {hairpin} meta mark set meta mark | {mark}
    iifname != "lo" ip saddr != 0.0.0.0 fib saddr type {{ broadcast, anycast }} {to_node} drop
    {local_source} {to_node} {key} != @hairpins drop
    {local_source} ct state new fib daddr type local ct mark set ct mark | {mark}
    {local_source} fib daddr type local {hairpin} accept
    {local_source} fib daddr type local drop
  }}
  chain forward {{
    {fwd}
    {odd_source} {hairpin} accept
    {odd_source} meta iifname . meta oifname @same-link ether daddr != @link-macs accept
    {odd_source} drop
  }}
  chain output {{
    {out}
    ct direction reply {hairpin} meta mark set meta mark | {mark}
    ct direction original {hairpin} ct mark set ct mark & {unmark}
  }}
}}
"""


def _elements(joined: str) -> str:
    return f" elements = {{ {joined} }};" if joined else ""


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


def has_rules(ipr: Any) -> bool:
    """Whether usproxy's policy rules (RULE_PROTOCOL) are there."""
    return any(r.get_attr("FRA_PROTOCOL") == RULE_PROTOCOL for r in _rules(ipr))


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


def link_macs(ipr: Any, names: Iterable[str]) -> set[str]:
    """The MAC addresses of the links named `names` (pyroute2 IPRoute `ipr`, blocking)."""
    wanted = set(names)
    return {str(link.get_attr("IFLA_ADDRESS")) for link in ipr.get_links()
            if link.get_attr("IFLA_IFNAME") in wanted and link.get_attr("IFLA_ADDRESS")}


async def apply_table(mark: int, hairpins: Iterable[Hairpin], links: Iterable[str] = (),
                      macs: Iterable[str] = ()) -> str:
    """Write NFT_TABLE (atomically, see `ruleset`) and accept_local; "" when done, else why not."""
    code, err = await run(["nft", "-f", "-"], ruleset(mark, hairpins, links, macs))
    if code:
        return f"table ip {NFT_TABLE}: {err or f'nft exited {code}'}"
    try:  # only now: the table drops what the martian check dropped
        if ACCEPT_LOCAL.read_text().strip() != "1":
            ACCEPT_LOCAL.write_text("1\n")
            log.info("net.ipv4.conf.all.accept_local=1: LB IPs as sources from the network are no martians")
    except OSError as exc:
        return f"accept_local: {exc.strerror or exc}"
    return ""


async def table_exists() -> bool:
    """Whether NFT_TABLE is there: `nft -t list table ip NFT_TABLE` (terse: its sets' elements
    are not read), whose cost does not grow with other tables. `nft list tables ip` reads every
    table's sets into nft's cache: beside the nftables datapath's maps of 10,000 Services, one
    static change window in four (each WATCH_PERIOD) took ~0.25 s more of the agent's CPU, its
    reaped children's included (bench/startup.py; none with the check off, 40 changes)."""
    code, _ = await run(["nft", "-t", "list", "table", "ip", NFT_TABLE])
    return code == 0


async def remove_table(ours: bool = False) -> str:
    """Set accept_local back to 0, then delete NFT_TABLE, when there is one or `ours` (usproxy's
    policy rules are there: the table went missing behind its back): accept_local without the
    table's drops lets local sources in from the network; first, so that never happens in
    between. "" when done (or neither was there), else why not."""
    exists = await table_exists()
    if not (exists or ours):  # accept_local is not ours to change
        return ""
    try:
        ACCEPT_LOCAL.write_text("0\n")
    except OSError as exc:
        return f"accept_local: {exc.strerror or exc}"
    if not exists:
        return ""
    code, err = await run(["nft", "-f", "-"], f"table ip {NFT_TABLE} {{}}\ndelete table ip {NFT_TABLE}\n")
    if code:
        return f"table ip {NFT_TABLE}: {err or f'nft exited {code}'}"
    return ""


async def remove(worker: Any) -> tuple[str, list[str]]:
    """Take back everything: the table (remove_table) and the policy rules (remove_rules, through
    `worker`, a NetlinkWorker); (why not, "" when done; the rule changes made)."""
    try:
        ours = await worker.call(has_rules)
    except Exception as err:
        return str(err), []
    why = await remove_table(ours)
    try:
        done = await worker.call(remove_rules)
    except Exception as err:
        return why or str(err), []
    return why, list(done)


class ReturnRoute:
    """One agent's hairpin answers: the policy rules and table NFT_TABLE kept up to date with
    what the table holds (the LB IP frontends, the node's links and their MACs). `mark`:
    --hairpin-mark (None: leave whatever an earlier agent set up; 0: take it back; else: its
    bit). `worker`: a NetlinkWorker of its own (the relay's is busy adding addresses). After
    each sync `update`; `watch` looks every WATCH_PERIOD seconds whether the table is still
    there (a firewall reload flushes it, and accept_local without it lets every local source
    in) and whether a link's MAC moved (a bridge's follows its ports). Failures are logged and
    tried again: every other client is served all the same."""

    WATCH_PERIOD = 5.0

    def __init__(self, mark: int | None, worker: Any) -> None:
        self.mark, self.worker = mark, worker
        self._rules = False  # the policy rules are in place
        self._want: tuple[frozenset[Hairpin], frozenset[str]] | None = None
        self._written: tuple[frozenset[Hairpin], frozenset[str], frozenset[str]] | None = None

    def close(self) -> None:
        """Stop its netlink thread (the agent's exit; the table and rules stay)."""
        self.worker.close()

    async def start(self) -> None:
        """--hairpin-mark 0: take back what an earlier agent set up (with a mark, `update` after
        the first sync sets it up)."""
        if self.mark == 0:
            await self._remove()

    async def update(self, hairpins: Iterable[Hairpin], links: Iterable[str], refresh: bool = False) -> None:
        """After a sync: write the rules (until once done) and the table when what it holds
        changed or the last write failed; `refresh` (a full sync) reads the links' MACs again
        and rewrites a table that went missing."""
        if not self.mark:
            return
        self._want = (frozenset(h for h in hairpins if h[0].version == 4), frozenset(links))
        if not (self._rules and self._written and self._want == self._written[:2]) or refresh:
            await self._apply(check=refresh)

    async def watch(self) -> None:
        """Until cancelled: every WATCH_PERIOD, `_apply` with the table's presence checked."""
        while True:
            await asyncio.sleep(self.WATCH_PERIOD)
            if self.mark and self._want is not None:
                await self._apply(check=True)

    async def _apply(self, check: bool) -> None:
        assert self.mark and self._want is not None
        ips, names = self._want
        try:
            if not self._rules:
                await self._add_rules(self.mark)
            macs = frozenset(await self.worker.call(lambda ipr: link_macs(ipr, names)))
        except Exception as err:
            log.error("policy rules for answers to LB hairpins: %s", err)
            return
        if (ips, names, macs) != self._written:
            await self._write(ips, names, macs)
        elif check and not await table_exists():
            log.warning("table ip %s went missing (a firewall reload?): written again", NFT_TABLE)
            await self._write(ips, names, macs)

    async def _add_rules(self, mark: int) -> None:
        done = await self.worker.call(lambda ipr: reconcile_rules(ipr, mark))
        self._rules = True
        if done:
            log.info("answers to LB hairpins are routed out: %s", " ".join(done))

    async def _write(self, ips: frozenset[Hairpin], names: frozenset[str], macs: frozenset[str]) -> None:
        assert self.mark
        if why := await apply_table(self.mark, ips, names, macs):
            log.error("answers to LB hairpins stay on the node: %s", why)
            self._written = None
            return
        self._written = (ips, names, macs)

    async def _remove(self) -> None:
        """--hairpin-mark 0: what an earlier agent set up goes (accept_local back to 0)."""
        why, done = await remove(self.worker)
        if why:
            log.error("hairpin answers: removing an earlier agent's table and rules: %s", why)
        elif done:
            log.info("hairpin answers are off (--hairpin-mark 0, or a datapath beside which they stay off): %s",
                     " ".join(done))
