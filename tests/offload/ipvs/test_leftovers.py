"""Switching between kube-proxy's iptables and IPVS modes (FakeIpvsTools: both datapaths' rules in
one in-memory iptables): the chains both modes name (KUBE-SERVICES, KUBE-POSTROUTING,
KUBE-MARK-MASQ, KUBE-FORWARD, KUBE-PROXY-FIREWALL) are rewritten by the mode that runs, so the
other mode's leftover removal, which runs after that, keeps them and their jumps and removes only
its own chains: usproxy/offload/iptables/shared.py. Without it, removing the iptables leftovers
deleted the IPVS datapath's KUBE-SERVICES (and the reverse)."""

from __future__ import annotations

from usproxy.model.node import NodeFacts
from usproxy.offload.iptables.datapath import IptablesDatapath
from usproxy.offload.iptables.saved import parse
from usproxy.offload.ipvs import leftovers
from usproxy.offload.ipvs.fake import FakeIpvsKernel, FakeIpvsTools
from usproxy.offload.ipvs.rules import JUMPS

from tests.offload.helpers import ep, spn, state
from tests.offload.ipvs.helpers import NoConntrack, datapath

WEB = spn("web", "http")


def iptables_dp(tools: FakeIpvsTools) -> IptablesDatapath:
    return IptablesDatapath(tools, NoConntrack(), node=NodeFacts("node"), backend="nft")


def nat(tools: FakeIpvsTools) -> dict[str, list[str]]:
    saved = parse(tools.save("nft", 4))["nat"]
    return {c: [r.text() for r in saved.in_chain(c)] for c in saved.user_chains()}


async def test_iptables_leftovers_go_and_ipvs_keeps_what_both_name() -> None:
    tools, kernel = FakeIpvsTools(), FakeIpvsKernel()
    ipt = iptables_dp(tools)
    await ipt.apply({WEB: state(WEB, "10.96.0.1", 80, [ep("10.244.1.1")])})  # an earlier --offload iptables
    assert any(c.startswith("KUBE-SVC-") for c in nat(tools))
    ipvs = datapath(kernel, tools)
    await ipvs.apply({WEB: state(WEB, "10.96.0.1", 80, [ep("10.244.1.1")])})  # this run, --offload ipvs
    services = nat(tools)["KUBE-SERVICES"]
    await iptables_dp(tools).cleanup()  # the earlier run's leftovers, after this run's first sync
    after = nat(tools)
    assert not any(c.startswith(("KUBE-SVC-", "KUBE-SEP-", "KUBE-NODEPORTS")) for c in after)
    assert after["KUBE-SERVICES"] == services  # IPVS's own, untouched
    assert {"KUBE-POSTROUTING", "KUBE-MARK-MASQ", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER"} <= set(after)
    builtin = {r.text() for t in parse(tools.save("nft", 4)).values() for r in t.rules if not r.chain.startswith("KUBE-")}
    assert {j.text() for j in JUMPS} <= builtin  # IPVS's entry jumps stay


async def test_ipvs_leftovers_go_and_iptables_keeps_what_both_name() -> None:
    tools, kernel = FakeIpvsTools(), FakeIpvsKernel()
    await datapath(kernel, tools).apply({WEB: state(WEB, "10.96.0.1", 80, [ep("10.244.1.1")])})
    ipt = iptables_dp(tools)
    await ipt.read_back()
    await ipt.apply({WEB: state(WEB, "10.96.0.1", 80, [ep("10.244.1.1")])})
    services = nat(tools)["KUBE-SERVICES"]
    await leftovers.remove(kernel, tools)  # type: ignore[arg-type]  # the fake stands in for IpvsKernel
    after = nat(tools)
    assert after["KUBE-SERVICES"] == services and any(c.startswith("KUBE-SVC-") for c in after)
    assert "KUBE-NODE-PORT" not in after and "KUBE-LOAD-BALANCER" not in after
    filt = parse(tools.save("nft", 4))["filter"]
    assert "KUBE-IPVS-FILTER" not in filt.user_chains() and "KUBE-FORWARD" in filt.user_chains()
    assert kernel.services == {} and kernel.sets == {} and kernel.addresses is None
