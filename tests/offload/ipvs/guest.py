"""Where the IPVS datapath's kernel tests can run: a kernel with ip_vs and the ipset tool (the VM
lab's ipvs guest: `bash scripts/vm.sh ipvs --run 'python -m pytest -q tests/offload/ipvs'`). This
project's machines have no IPVS: there they skip, saying so."""

from __future__ import annotations

import os
import subprocess

import pytest


def ipvs_here() -> bool:
    """ip_vs loaded, or loadable, and the ipset tool there."""
    try:
        loaded = os.path.exists("/proc/net/ip_vs") or subprocess.run(["modprobe", "-q", "ip_vs"]).returncode == 0
        return loaded and subprocess.run(["ipset", "--version"], capture_output=True).returncode == 0
    except OSError:
        return False


NEEDS_IPVS = pytest.mark.skipif(not ipvs_here(), reason="no IPVS in this kernel: run it in the VM lab "
                                "(bash scripts/vm.sh ipvs --run 'python -m pytest -q tests/offload/ipvs')")


def bridge_netfilter() -> None:
    """br_netfilter, as on this project's machines and as kube-proxy's IPVS mode asks for on a
    bridge CNI: without it a pod answers a client on the same bridge straight over the bridge,
    and IPVS never sees the answer to reverse its NAT (the VM lab's kernel has it as a module)."""
    if not os.path.exists("/proc/sys/net/bridge/bridge-nf-call-iptables"):
        subprocess.run(["modprobe", "br_netfilter"], check=False)
