"""ServiceCidrRoutes: unallocated addresses of the Service CIDRs dropped by the routing table.

kube-proxy's nftables mode drops a new connection to an address of a Service CIDR that no Service
holds ("Drop traffic to unallocated ClusterIPs"), so it is never routed on. Where the nftables
datapath does not run (`--offload none`, BPF alone, a node without nf_tables), the relay does the
same with routes: one blackhole route per Service CIDR in a routing table of usproxy's own
(TABLE), looked up by one policy rule per family (RULE_PRIORITY: after `local`, before `main`).
The allocated ClusterIPs stay local addresses on `usproxy0`: their routes in table `local`,
which the kernel consults first, win, so only addresses no Service holds reach the blackhole.
A packet forwarded there is dropped without an ICMP error, as kube-proxy's drop; a process on
the node gets EINVAL from connect() at once (kube-proxy's drop leaves it to time out).

Invariants: TABLE holds exactly the blackhole routes of the CIDRs last applied, and a rule to it
exists for a family exactly while that family has one; anything else found in TABLE or pointing
at it (an earlier run's) is removed by `apply`. Like `usproxy0`, the routes stay when the agent
stops (a restart does not open a window in which the CIDR is routed on); `usproxy run --cleanup`
and an agent whose nftables datapath checks the CIDRs itself remove them (`apply(())`).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from collections.abc import Iterable
from typing import Any

from usproxy.model.types import IPNetwork

log = logging.getLogger(__name__)

TABLE = 30067  # usproxy's routing table ("us" in ASCII)
RULE_PRIORITY = 30067  # between the `local` rule (0) and `main` (32766)
RTN_BLACKHOLE = 6
FAMILIES = ((4, socket.AF_INET), (6, socket.AF_INET6))


def reconcile(ipr: Any, cidrs: Iterable[IPNetwork]) -> list[str]:
    """Make TABLE and its rules hold exactly `cidrs` (pyroute2 IPRoute `ipr`, blocking); returns
    what changed, as text for the log. Raises pyroute2's NetlinkError (errno in `code`)."""
    want = set(cidrs)
    done = []
    for version, family in FAMILIES:
        mine = {n for n in want if n.version == version}
        have = _routes(ipr, family)
        for net in sorted(have - mine, key=str):
            _quiet(lambda: ipr.route("del", dst=str(net), table=TABLE, type="blackhole", family=family))
            done.append(f"-blackhole {net}")
        for net in sorted(mine - have, key=str):
            _quiet(lambda: ipr.route("add", dst=str(net), table=TABLE, type="blackhole", family=family))
            done.append(f"+blackhole {net}")
        rules = _rules(ipr, family)
        if mine and not rules:
            _quiet(lambda: ipr.rule("add", table=TABLE, priority=RULE_PRIORITY, family=family))
            done.append(f"+rule IPv{version}")
        for prio in rules if not mine else rules[1:]:
            _quiet(lambda: ipr.rule("del", table=TABLE, priority=prio, family=family))
            done.append(f"-rule IPv{version}")
    return done


def _routes(ipr: Any, family: int) -> set[IPNetwork]:
    out: set[IPNetwork] = set()
    for msg in ipr.get_routes(family=family, table=TABLE):
        if _table(msg) != TABLE:
            continue
        dst = msg.get_attr("RTA_DST") or ("0.0.0.0" if family == socket.AF_INET else "::")
        net = ipaddress.ip_network(f"{dst}/{msg['dst_len']}")
        if msg["type"] == RTN_BLACKHOLE:
            out.add(net)
        else:  # not ours to keep in our table: removed
            _quiet(lambda: ipr.route("del", dst=str(net), table=TABLE, family=family))
    return out


def _rules(ipr: Any, family: int) -> list[int]:
    """Priorities of the rules that look up TABLE."""
    return sorted(int(r.get_attr("FRA_PRIORITY") or 0) for r in ipr.get_rules(family=family) if _table(r) == TABLE)


def _table(msg: Any) -> int:
    return int(msg.get_attr("RTA_TABLE") or msg.get_attr("FRA_TABLE") or msg["table"])


def _quiet(call: Any) -> None:
    """Run one netlink change; one that finds its work done (another agent's cleanup raced it)
    is no error."""
    try:
        call()
    except Exception as err:
        if getattr(err, "code", None) not in (errno.EEXIST, errno.ENOENT, errno.ESRCH):
            raise
