"""Proof, inside the guest, that each feature the scenario takes away is really gone (and that
each one it needs is there), and `usproxy check --json` compared with what was found.

A feature counts as missing only when every test agrees: `modprobe` of its module fails, the
module is neither loaded (/proc/modules) nor built in (/sys/module), and the tool that needs it
fails (`nft list tables`, `iptables-legacy -t nat -S`). A scenario whose "missing" feature is
found present fails, so no scenario can pass on a kernel that still has it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from node import sh

# the module a family's others depend on, and a command that needs the family
FAMILY_TOOL = {
    "nf_tables": ("nft", "list", "tables"),
    "x_tables": ("iptables-legacy", "-t", "filter", "-S"),
    "ip_tables": ("iptables-legacy", "-t", "nat", "-S"),
    "ip6_tables": ("ip6tables-legacy", "-t", "nat", "-S"),
}


def loaded_modules() -> set[str]:
    return {line.split()[0] for line in Path("/proc/modules").read_text().splitlines()}


def module(name: str) -> dict[str, Any]:
    """Is kernel module `name` available? modprobe it and look."""
    probe = sh("modprobe", name, check=False)
    found: dict[str, Any] = {
        "feature": name, "modprobe_exit": probe.returncode, "modprobe_error": probe.stderr.strip()[-200:],
        "loaded": name in loaded_modules(), "sys_module": Path(f"/sys/module/{name}").exists(),
    }
    tool = FAMILY_TOOL.get(name)
    if tool is not None:
        run = sh(*tool, check=False)
        found["tool"] = " ".join(tool)
        found["tool_exit"] = run.returncode
        found["tool_error"] = run.stderr.strip()[-200:]
    found["present"] = probe.returncode == 0 and found["loaded"] or found["sys_module"] or found.get("tool_exit") == 0
    return found


def cgroup2() -> dict[str, Any]:
    """Is a cgroup v2 hierarchy mounted anywhere (what the BPF socket LB attaches to)?"""
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    v2 = [m[1] for m in mounts if m[2] == "cgroup2"]
    v1 = [m[1] for m in mounts if m[2] == "cgroup"]
    return {"feature": "cgroup2", "cgroup2_mounts": v2, "cgroup1_mounts": v1, "present": bool(v2)}


def ipvs() -> dict[str, Any]:
    """ip_vs loaded and usable: /proc/net/ip_vs, and ipvsadm adds, lists and deletes a virtual server."""
    found = module("ip_vs")
    found["proc_net_ip_vs"] = Path("/proc/net/ip_vs").exists()
    vs = ("-t", "10.96.254.254:80")
    add = sh("ipvsadm", "-A", *vs, "-s", "rr", check=False)
    listed = sh("ipvsadm", "-Ln", check=False)
    delete = sh("ipvsadm", "-D", *vs, check=False)
    found["ipvsadm"] = {"add_exit": add.returncode, "listed": "10.96.254.254:80" in listed.stdout,
                        "delete_exit": delete.returncode, "error": (add.stderr + delete.stderr).strip()[-200:]}
    found["ipvsadm_works"] = add.returncode == 0 and "10.96.254.254:80" in listed.stdout and delete.returncode == 0
    found["present"] = bool(found["present"] and found["proc_net_ip_vs"] and found["ipvsadm_works"])
    return found


def check_json() -> list[dict[str, Any]]:
    out = sh("usproxy", "check", "--json", check=False, timeout=300)
    try:
        return list(json.loads(out.stdout))
    except ValueError:
        return [{"name": "usproxy check", "available": False, "detail": f"exit {out.returncode}: {out.stderr[-300:]}"}]


def capability(caps: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The capability called `name` (or `name ...`, e.g. "iptables (legacy)")."""
    for c in caps:
        if c["name"] == name or str(c["name"]).startswith(name + " "):
            return c
    return None


def datapath_built(caps: list[dict[str, Any]], name: str) -> bool:
    """Does this usproxy have a `name` datapath (iptables, ipvs)? `usproxy run --offload` accepts it,
    or `usproxy check` lists it as a datapath (the informational "ipvs" line of an agent without the
    IPVS datapath says it does not use it)."""
    helptext = sh("usproxy", "run", "--help", check=False).stdout
    offload = helptext[helptext.find("--offload"):][:200]
    if name in offload.split("}")[0]:
        return True
    cap = capability(caps, name)
    return cap is not None and "does not use" not in str(cap["detail"])


def compare(caps: list[dict[str, Any]], facts: dict[str, bool]) -> list[str]:
    """Disagreements between `usproxy check` and the facts found (feature -> present)."""
    wrong = []
    nft = capability(caps, "nftables")
    if "nf_tables" in facts and nft is not None and bool(nft["available"]) != facts["nf_tables"]:
        wrong.append(f"check says nftables available={nft['available']}, nf_tables present={facts['nf_tables']}")
    bpf = capability(caps, "bpf cgroup hooks")
    if "cgroup2" in facts and bpf is not None:
        if not facts["cgroup2"] and (bpf["available"] or "cgroup v2" not in str(bpf["detail"])):
            wrong.append(f"cgroup v2 is not mounted but check says bpf cgroup hooks: {bpf}")
        if facts["cgroup2"] and not bpf["available"]:
            wrong.append(f"cgroup v2 is mounted but check says bpf cgroup hooks: {bpf}")
    ipt = capability(caps, "iptables")
    if "ip_tables" in facts and ipt is not None and bool(ipt["available"]) != facts["ip_tables"]:
        wrong.append(f"check says iptables available={ipt['available']}, ip_tables present={facts['ip_tables']}")
    vs = capability(caps, "ipvs")
    if "ip_vs" in facts and vs is not None and bool(vs["available"]) != facts["ip_vs"]:
        wrong.append(f"check says ipvs available={vs['available']}, ip_vs present={facts['ip_vs']}")
    return wrong
