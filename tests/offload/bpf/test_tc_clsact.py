"""The tc programs on the rung below tcx: a clsact qdisc's cls_bpf filters (usproxy/offload/bpf/
cls_bpf.py, loader.py), in the node netns of a BPF test.

Forced here with tc_attach="clsact" (this machine has tcx); on a kernel without tcx (the lab's
6.1 guest) the datapath takes this rung by itself. What `tc` (iproute2) lists is the judge, not
usproxy's own reading:
- our filters are added at both hooks with the pinned program, swapped in place on a restart
  (one filter each, its program new), and removed with the qdisc we added when tc is no longer
  asked for;
- a qdisc and filters of another program on the interface stay, through attach, swap and
  `loader.remove`; a filter of another program at our priority and handle is never replaced (the
  attach fails with EBUSY);
- switching rungs (tcx -> clsact -> tcx) adds the new before removing the old, ending with only
  the rung asked for.
"""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.netns import Topology, inside, nsexec
from tests.offload.bpf.conftest import Env
from usproxy.offload.bpf import cls_bpf, loader
from usproxy.offload.bpf import libbpf as bpf

pytestmark = pytest.mark.netns
# another program's filter: classic BPF through cls_bpf (this kernel has no other classifier
# module), unnamed, returning 0 (no match)
FOREIGN = ("bpf", "bytecode", "1,6 0 0 0,")


def tc_filters(ns: str, dev: str, hook: str) -> list[dict[str, Any]]:
    """`tc -j filter show` at one hook: the filters with options (not the priorities' headers)."""
    out = nsexec(ns, "tc", "-j", "filter", "show", "dev", dev, hook).stdout
    return [f for f in json.loads(out or "[]") if "options" in f]


def ours(ns: str, dev: str) -> dict[str, list[int]]:
    """Program ids of our filters (priority, name) per hook."""
    return {hook: [f["options"]["prog"]["id"] for f in tc_filters(ns, dev, hook)
                   if f["pref"] == cls_bpf.PRIORITY and f["options"].get("bpf_name") == prog]
            for hook, prog in (("ingress", "usp_tc_ingress"), ("egress", "usp_tc_egress"))}


def qdiscs(ns: str, dev: str) -> list[str]:
    return [q["kind"] for q in json.loads(nsexec(ns, "tc", "-j", "qdisc", "show", "dev", dev).stdout)]


def veth(topology: Topology, name: str) -> int:
    nsexec(topology.node, "ip", "link", "add", name, "type", "veth", "peer", "name", name + "p")
    with inside(topology.node):
        return socket.if_nametoindex(name)


def open_in(ns: str, lb: loader.SockLB) -> None:
    with inside(ns):
        lb.open()
    lb.close()


def test_filters_are_added_swapped_in_place_and_removed_with_our_qdisc(bpf_env: Env, topology: Topology) -> None:
    ns, pins = topology.node, loader.PinLayout(bpf_env.pin_root)
    ifindex = veth(topology, "cls0")
    open_in(ns, loader.SockLB(pins, bpf_env.cgroup, (ifindex,), tc_attach="clsact"))
    first = ours(ns, "cls0")
    assert len(first["ingress"]) == 1 and len(first["egress"]) == 1, first
    assert "clsact" in qdiscs(ns, "cls0")
    pinned = loader.attached_links(pins)[f"usp_tc_ingress@{ifindex}"]
    assert pinned["link_type"] == "cls_bpf" and int(pinned["prog_id"]) == first["ingress"][0]
    if cls_bpf.tcx_available() is None:
        with inside(ns):
            assert bpf.prog_query(ifindex, bpf.BPF_TCX_INGRESS) == []  # not tcx

    open_in(ns, loader.SockLB(pins, bpf_env.cgroup, (ifindex,), tc_attach="clsact"))  # an agent restart
    swapped = ours(ns, "cls0")
    assert len(swapped["ingress"]) == 1 and swapped["ingress"] != first["ingress"], swapped
    assert int(loader.attached_links(pins)[f"usp_tc_ingress@{ifindex}"]["prog_id"]) == swapped["ingress"][0]

    open_in(ns, loader.SockLB(pins, bpf_env.cgroup))  # tc no longer asked for
    assert ours(ns, "cls0") == {"ingress": [], "egress": []}
    assert "clsact" not in qdiscs(ns, "cls0")  # we added it, nothing else is on it
    assert not list(pins.tc.iterdir())


def test_another_programs_qdisc_and_filters_stay(bpf_env: Env, topology: Topology) -> None:
    ns, pins = topology.node, loader.PinLayout(bpf_env.pin_root)
    ifindex = veth(topology, "cls1")
    nsexec(ns, "tc", "qdisc", "add", "dev", "cls1", "clsact")
    for hook in ("ingress", "egress"):
        nsexec(ns, "tc", "filter", "add", "dev", "cls1", hook, "prio", "50000", *FOREIGN)
    open_in(ns, loader.SockLB(pins, bpf_env.cgroup, (ifindex,), tc_attach="clsact"))
    assert all(len(ids) == 1 for ids in ours(ns, "cls1").values())
    with inside(ns):
        loader.remove(pins)  # `usproxy run --cleanup` in the agent's netns
    assert ours(ns, "cls1") == {"ingress": [], "egress": []}
    assert "clsact" in qdiscs(ns, "cls1")  # not ours: it stays
    for hook in ("ingress", "egress"):
        assert [(f["pref"], "bytecode" in f["options"]) for f in tc_filters(ns, "cls1", hook)] == [(50000, True)]


def test_a_filter_of_another_program_at_our_place_is_never_replaced(bpf_env: Env, topology: Topology) -> None:
    ns, pins = topology.node, loader.PinLayout(bpf_env.pin_root)
    ifindex = veth(topology, "cls2")
    nsexec(ns, "tc", "qdisc", "add", "dev", "cls2", "clsact")
    nsexec(ns, "tc", "filter", "add", "dev", "cls2", "ingress", "prio", str(cls_bpf.PRIORITY), "handle", "1", *FOREIGN)
    with pytest.raises(bpf.BpfError) as err:
        open_in(ns, loader.SockLB(pins, bpf_env.cgroup, (ifindex,), tc_attach="clsact"))
    assert err.value.errno == errno.EBUSY and "another program's" in str(err.value)
    assert [(f["pref"], "bytecode" in f["options"]) for f in tc_filters(ns, "cls2", "ingress")] == [(cls_bpf.PRIORITY, True)]


@pytest.mark.skipif(cls_bpf.tcx_available() is not None, reason="this kernel has no tcx")
def test_switching_rungs_adds_the_new_before_the_old_goes(bpf_env: Env, topology: Topology) -> None:
    ns, pins = topology.node, loader.PinLayout(bpf_env.pin_root)
    ifindex = veth(topology, "cls3")

    def tcx() -> list[int]:
        with inside(ns):
            return bpf.prog_query(ifindex, bpf.BPF_TCX_INGRESS)
    open_in(ns, loader.SockLB(pins, bpf_env.cgroup, (ifindex,), tc_attach="tcx"))
    assert len(tcx()) == 1 and ours(ns, "cls3")["ingress"] == []
    open_in(ns, loader.SockLB(pins, bpf_env.cgroup, (ifindex,), tc_attach="clsact"))
    assert tcx() == [] and len(ours(ns, "cls3")["ingress"]) == 1
    assert not (pins.links / f"usp_tc_ingress@{ifindex}").exists()
    open_in(ns, loader.SockLB(pins, bpf_env.cgroup, (ifindex,), tc_attach="tcx"))
    assert len(tcx()) == 1 and ours(ns, "cls3") == {"ingress": [], "egress": []}
    assert "clsact" not in qdiscs(ns, "cls3") and not list(pins.tc.iterdir())


def test_the_rung_is_probed_not_taken_from_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """cls_bpf.rung asks the kernel (BPF_PROG_QUERY of tcx on lo): EINVAL, as Linux before 6.6
    answers, means clsact; --enable-tcx=false means clsact wherever."""
    assert cls_bpf.rung(enable_tcx=False)[0] == "clsact"
    real = cls_bpf.tcx_available()
    assert cls_bpf.rung()[0] == ("tcx" if real is None else "clsact")

    def einval(*_: object) -> list[int]:
        raise bpf.BpfError("bpf_prog_query: Invalid argument", errno.EINVAL)
    monkeypatch.setattr(bpf, "prog_query", einval)
    how, why = cls_bpf.rung()
    assert how == "clsact" and "Invalid argument" in why and "6.6" in why


def test_a_probe_load_costs_no_map_memory(tmp_path: Path) -> None:
    """The verifier-only loads (the tc and XDP probes, `usproxy check`) create every sized map
    with one entry: the kernel charges almost nothing for them."""
    from usproxy.offload.bpf.build import object_path

    obj = bpf.BpfObject(str(object_path()))
    try:
        loader.shrink_for_probe(obj)
        obj.set_autoload(loader.XDP_PROGRAM, False)  # as the tc probe loads it
        obj.load()
        charged = sum(int(bpf.fdinfo(obj.map_fd(n)).get("memlock", "0")) for n in obj.map_names())
    finally:
        obj.close()
    assert charged < 2 * 2**20, charged
