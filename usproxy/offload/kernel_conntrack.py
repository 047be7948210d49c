"""KernelConntrack: the kernel conntrack entries of offloaded ServicePorts.

Three jobs, as kube-proxy's pkg/proxy/conntrack: reconcile every UDP entry of the UDP Services'
frontends against their serving endpoints (`reconcile_udp`, kube-proxy's CleanStaleEntries, at
start and after syncs: an endpoint removed while the agent was down leaves entries no sync
reports, issue 29 item 7); delete UDP entries whose reply comes from an endpoint that went away
(`delete_udp(reply_src=...)`, field case C03); delete UDP entries to a frontend that had no
endpoints (`delete_udp(orig_dst=...)`, else a sender's earlier "refused" entry outlives the 0 -> N
change; the IPVS datapath lists them first, `list_udp`, and deletes them right after its virtual
server's write, `delete_listed`). It also lists the DNATed entries of offloaded frontends for /flows.

The first two list the whole UDP table once and delete in batches, in a child process
(usproxy/offload/ctnetlink.py: off the event loop and off the agent's GIL; with 150,000 entries
pyroute2's one-request-per-delete took minutes of the agent's CPU, issue 29 item 8). The child is
forked from a worker thread of its own, so it starts in `netns` and a long cleanup never holds
the thread that lists /flows. The third (a few addresses, inside a transaction's apply) and
/flows stay on pyroute2: for up to FILTERED_MAX IPv4 addresses the kernel filters the dump (one
CTA_FILTER dump per address, Linux >= 5.8); more addresses, and IPv6 (whose reply-tuple filter
matched no entry on Linux 6.18 through pyroute2), take one dump of all UDP entries. pyroute2's
synchronous API cannot run inside a running event loop, so its calls run in one worker thread
(NetnsWorker), which first enters `netns` when one is given.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from usproxy.offload.netns_worker import NetnsWorker
from usproxy.core.stale_udp import StaleUdp
from usproxy.model.endpoint import Endpoint
from usproxy.model.types import ServicePortName, format_hostport
from usproxy.util.rows import FlowRow

log = logging.getLogger(__name__)

IPS_DST_NAT = 0x20
PROTO_NUM = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP, "SCTP": 132}
PROTO_NAME = {v: k for k, v in PROTO_NUM.items()}

FAMILIES = (socket.AF_INET, socket.AF_INET6)
FrontendKey = tuple[str, str, int]  # (address or "*" for NodePorts, PROTO, port)
FILTERED_MAX = 32  # addresses up to which the kernel filters each dump
RECONCILE_TIMEOUT = 600.0  # seconds a cleanup child may run (150,000 entries: a few seconds)
RECONCILE_NICE = 10  # the child yields the CPU to the relay and the agent
CLEANUP_PASSES = 4  # children at once (usproxy.offload.stale_cleanup.MAX_PASSES)


class KernelConntrack:
    """Deletes and lists kernel conntrack entries, in `netns` when given."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self._worker = NetnsWorker("conntrack", netns)
        # threads that wait for cleanup children, one per pass StaleCleanup runs at once
        self._cleaner = NetnsWorker("conntrack-cleanup", netns, threads=CLEANUP_PASSES)

    async def reconcile_udp(self, rule: StaleUdp) -> dict[str, Any]:
        """Delete every UDP entry `rule` calls stale (one listing per family, batched deletes,
        in a child process). Returns the child's summary (entries listed, stale, deleted, the
        kernel's refusals by errno, seconds). Raises OSError when the child fails."""
        if not rule:
            return {"listed": 0, "stale": 0, "deleted": 0, "errors": {}, "seconds": 0.0}
        return await self._cleaner.run(_run_cleanup, rule.to_json())

    async def delete_udp(self, *, reply_src: Iterable[tuple[str, int]] = (),
                         orig_dst: Iterable[tuple[str, int]] = ()) -> int:
        """Delete DNATed UDP entries whose reply source is one of `reply_src` (as reconcile_udp),
        and UDP entries whose original destination is one of `orig_dst` (address, port).
        Returns how many were deleted."""
        rs, od = set(reply_src), set(orig_dst)
        deleted = 0
        if rs:
            deleted += int((await self.reconcile_udp(StaleUdp.replying_from(rs)))["deleted"])
        if od:
            deleted += await self._worker.run(self._delete_udp, set(), od)
        return deleted

    async def list_udp(self, orig_dst: Iterable[tuple[str, int]]) -> ListedUdp:
        """The UDP entries whose original destination is one of `orig_dst`, listed now on sockets
        kept open, for `delete_listed` to delete after a change without opening or dumping
        anything (the IPVS datapath's offload of relayed UDP sessions: offload/ipvs/datapath.py)."""
        return await self._worker.run(_list_udp, set(orig_dst))

    async def delete_listed(self, listed: ListedUdp) -> int:
        """Delete the entries `listed` holds, one request each, and close its sockets. Returns how
        many were deleted (an entry gone meanwhile is not counted)."""
        return await self._worker.run(listed.delete)

    def _delete_udp(self, reply_src: set[tuple[str, int]], orig_dst: set[tuple[str, int]]) -> int:
        from pyroute2 import Conntrack

        deleted = 0
        for family in FAMILIES:  # pyroute2 dumps one family per socket (AF_INET by default)
            ct = Conntrack(nfgen_family=family)
            try:
                deleted += _delete_each(ct, _matching(ct, family, reply_src, orig_dst))
            finally:
                ct.close()
        return deleted

    async def delete_udp_turned_answers(self, pairs: Iterable[tuple[tuple[str, int], str]]) -> int:
        """Delete UDP entries whose original source is an endpoint (address, port) and whose reply
        destination is the Service address paired with it: what the kernel makes of an endpoint's
        answer that IPVS turned into the Service address's while a conntrack entry without NAT
        (a relayed session's) held that tuple (offload/ipvs/datapath.py). Returns how many."""
        wanted = {(ep, vip) for ep, vip in pairs}
        return await self._worker.run(self._delete_turned, wanted) if wanted else 0

    def _delete_turned(self, wanted: set[tuple[tuple[str, int], str]]) -> int:
        from pyroute2 import Conntrack
        from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

        deleted = 0
        for family in FAMILIES:
            v6 = family == socket.AF_INET6
            mine = {(ep, vip) for ep, vip in wanted if (":" in vip) == v6}
            if not mine:
                continue
            ct = Conntrack(nfgen_family=family)
            try:
                # listed in full before any delete: pyroute2's sync calls close the thread's event
                # loop when they end, so an entry("del") inside a dump's iteration broke the dump
                # after its first delete ("Event loop is closed"), leaving the other entries
                found = [e.tuple_orig for a, p in {ep for ep, _ in mine}
                         for e in ct.dump_entries(tuple_orig=NFCTAttrTuple(family=family, proto=socket.IPPROTO_UDP,
                                                                           saddr=a, sport=p))
                         if ((a, p), str(e.tuple_reply.daddr)) in mine]
                deleted += _delete_each(ct, found)
            finally:
                ct.close()
        return deleted

    def flows(self, frontends: Mapping[FrontendKey, str], datapath: str, timeout: float = 5.0) -> list[FlowRow]:
        """DNATed entries to `frontends` (key -> ServicePortName text), as /flows rows."""
        if not frontends:
            return []
        try:
            return self._worker.call(self._flows, dict(frontends), datapath, timeout=timeout)
        except Exception as err:
            log.warning("listing kernel conntrack: %s", err)
            return []

    def _flows(self, frontends: dict[FrontendKey, str], datapath: str) -> list[FlowRow]:
        from pyroute2 import Conntrack
        from pyroute2.conntrack import ConntrackEntry

        rows = []
        for family in FAMILIES:
            ct = Conntrack(nfgen_family=family)
            try:
                for msg in ct.dump():  # raw messages: ConntrackEntry drops the CTA_COUNTERS_* attributes
                    get = msg.get_attr
                    e = ConntrackEntry(msg["nfgen_family"], get("CTA_TUPLE_ORIG"), get("CTA_TUPLE_REPLY"),
                                       get("CTA_STATUS"), get("CTA_TIMEOUT"), get("CTA_PROTOINFO"), get("CTA_MARK"),
                                       get("CTA_ID"), get("CTA_USE"), get("CTA_ZONE"))
                    row = _row(e, frontends, datapath)
                    if row is not None:
                        row["packets_in"], row["bytes_in"] = _counters(get("CTA_COUNTERS_ORIG"))
                        row["packets_out"], row["bytes_out"] = _counters(get("CTA_COUNTERS_REPLY"))
                        rows.append(row)
            finally:
                ct.close()
        return rows

    def enable_accounting(self) -> bool:
        """Turn on per-entry packet and byte counters (net.netfilter.nf_conntrack_acct, per
        network namespace; as kube-proxy writes its own conntrack sysctls at start). Entries
        created before keep none. Returns whether accounting is on."""
        return self._worker.call(_set_acct)

    def close(self) -> None:
        self._worker.close()
        self._cleaner.close()


class ListedUdp:
    """UDP entries listed ahead of a change, each with the conntrack socket (one per family) it
    was listed on: deleting them costs one request per entry. Made, used and closed in the
    conntrack worker's thread."""

    def __init__(self) -> None:
        self.listed: list[tuple[Any, list[Any]]] = []  # (pyroute2 Conntrack, original tuples)

    def __len__(self) -> int:
        return sum(len(tuples) for _, tuples in self.listed)

    def delete(self) -> int:
        try:
            return sum(_delete_each(ct, tuples) for ct, tuples in self.listed)
        finally:
            self.close()

    def close(self) -> None:
        for ct, _ in self.listed:
            ct.close()
        self.listed = []


def _delete_each(ct: Any, tuples: list[Any]) -> int:
    """Delete each entry by its original tuple on the pyroute2 socket `ct`; how many went (one
    gone meanwhile is fine, and not counted)."""
    deleted = 0
    for o in tuples:
        try:
            ct.entry("del", tuple_orig=o)
            deleted += 1
        except Exception as err:
            log.debug("conntrack delete %s: %s", o, err)
    return deleted


def _list_udp(orig_dst: set[tuple[str, int]]) -> ListedUdp:
    from pyroute2 import Conntrack

    out = ListedUdp()
    try:
        for family in FAMILIES:
            if not any((":" in a) == (family == socket.AF_INET6) for a, _ in orig_dst):
                continue
            ct = Conntrack(nfgen_family=family)
            out.listed.append((ct, []))
            out.listed[-1][1].extend(_matching(ct, family, set(), orig_dst))
    except BaseException:
        out.close()
        raise
    return out


async def reconcile_logged(ct: KernelConntrack, rule: StaleUdp) -> None:
    """A kernel datapath's reconcile_udp (kube-proxy's CleanStaleEntries after its syncs; called
    beside the syncs by the offload manager's StaleCleanup): delete, then say what went."""
    summary = await ct.reconcile_udp(rule)
    log.log(logging.INFO if summary["deleted"] else logging.DEBUG,
            "conntrack: %s stale UDP entries of %s deleted in %.2fs%s", summary["deleted"], summary["listed"],
            summary["seconds"], f" (refused: {summary['errors']})" if summary["errors"] else "")


async def delete_removed_udp_endpoints(ct: KernelConntrack,
                                       removed: Mapping[ServicePortName, frozenset[Endpoint]]) -> int:
    """A kernel datapath's clear_stale: the UDP entries whose answers come from an endpoint
    removed from a UDP ServicePort (`removed`: ServicePortName -> Endpoints)."""
    targets = {(str(ep.ip), ep.port) for spn, eps in removed.items() if spn.protocol == "UDP" for ep in eps}
    if not targets:
        return 0
    n = await ct.delete_udp(reply_src=targets)
    log.debug("deleted %d kernel conntrack entries of removed UDP endpoints", n)
    return n


def _run_cleanup(rule_json: str) -> dict[str, Any]:
    """The cleanup child (python -m usproxy.offload.ctnetlink), started from the calling thread,
    so in its network namespace; blocks that thread (not the GIL) until the child is done."""
    cmd = [sys.executable, "-m", "usproxy.offload.ctnetlink", "--nice", str(RECONCILE_NICE)]
    done = subprocess.run(cmd, input=rule_json, capture_output=True, text=True, timeout=RECONCILE_TIMEOUT)
    try:
        out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise OSError(f"conntrack cleanup exited {done.returncode}: {done.stderr.strip()[-300:]}") from None
    if done.returncode != 0 or "error" in out:
        raise OSError(f"conntrack cleanup: {out.get('error', done.returncode)}")
    return out


def _matching(ct: Any, family: int, reply_src: set[tuple[str, int]], orig_dst: set[tuple[str, int]]) -> list[Any]:
    """Original tuples of the UDP entries in `family` whose reply source is in `reply_src` or
    whose original destination is in `orig_dst`, read before any is deleted."""
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    v6 = family == socket.AF_INET6
    rs = {(a, p) for a, p in reply_src if (":" in a) == v6}
    od = {(a, p) for a, p in orig_dst if (":" in a) == v6}
    udp = socket.IPPROTO_UDP
    if not v6 and len(rs) + len(od) <= FILTERED_MAX:  # IPv6 reply-tuple filters matched nothing here
        found = {}
        for a, p in rs:
            for e in ct.dump_entries(tuple_reply=NFCTAttrTuple(family=family, proto=udp, saddr=a, sport=p)):
                found[_key(e.tuple_orig)] = e.tuple_orig
        for a, p in od:
            for e in ct.dump_entries(tuple_orig=NFCTAttrTuple(family=family, proto=udp, daddr=a, dport=p)):
                found[_key(e.tuple_orig)] = e.tuple_orig
        return list(found.values())
    return [e.tuple_orig for e in ct.dump_entries(tuple_orig=NFCTAttrTuple(family=family, proto=udp))
            if (str(e.tuple_reply.saddr), e.tuple_reply.sport) in rs or (str(e.tuple_orig.daddr), e.tuple_orig.dport) in od]


def _key(t: Any) -> tuple[str, int, str, int]:
    return (str(t.saddr), t.sport, str(t.daddr), t.dport)


ACCT = "/proc/sys/net/netfilter/nf_conntrack_acct"


def _set_acct() -> bool:
    try:
        with open(ACCT, "r+") as f:
            if f.read().strip() != "1":
                f.seek(0)
                f.write("1\n")
                log.info("enabled kernel conntrack accounting (%s) for byte counts in /flows", ACCT)
        return True
    except OSError as err:
        log.warning("kernel conntrack accounting unavailable (%s): kernel flows show no byte counts", err)
        return False


def _counters(nla: Any) -> tuple[int, int]:
    """(packets, bytes) of a CTA_COUNTERS_* attribute; (0, 0) when absent (accounting off)."""
    if nla is None:
        return 0, 0
    return int(nla.get_attr("CTA_COUNTERS_PACKETS") or 0), int(nla.get_attr("CTA_COUNTERS_BYTES") or 0)


def _row(e: Any, frontends: dict[FrontendKey, str], datapath: str) -> FlowRow | None:
    if not (e.status or 0) & IPS_DST_NAT:
        return None
    o, r = e.tuple_orig, e.tuple_reply
    proto = PROTO_NAME.get(o.proto)
    if proto is None:
        return None
    service = frontends.get((str(o.daddr), proto, o.dport)) or frontends.get(("*", proto, o.dport))
    if service is None:
        return None
    state = e.protoinfo.state_name() if e.protoinfo is not None else ("ASSURED" if e.status & 0x4 else "UNREPLIED")
    return {
        "id": f"ct-{e.id}", "protocol": proto, "state": state, "age": None, "idle": None, "timeout": e.timeout,
        "original": {"src": format_hostport(str(o.saddr), o.sport), "dst": format_hostport(str(o.daddr), o.dport)},
        "reply": {"src": format_hostport(str(r.saddr), r.sport), "dst": format_hostport(str(r.daddr), r.dport)},
        "packets_in": 0, "bytes_in": 0, "packets_out": 0, "bytes_out": 0,
        "datapath": datapath, "service": service, "endpoint": format_hostport(str(r.saddr), r.sport),
    }
