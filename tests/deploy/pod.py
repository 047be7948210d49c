"""The DaemonSet's container as a container runtime would start it on one node, as a spec for
sandbox.py: the image's entrypoint with the manifest's args, its env (fieldRefs and $(VAR)
references resolved as the kubelet does), its capabilities, allowPrivilegeEscalation and
readOnlyRootFilesystem, the runtime's own mounts (/proc with /proc/sys read-only, a read-only
/sys, a minimal /dev, the service-account directory) and every volumeMount of the manifest.

Volumes are resolved by kind: a configMap becomes a directory of its data, an emptyDir a tmpfs,
and each hostPath a stand-in the test owns (`host_paths`), so nothing of the machine's own
state is touched: the host's /sys/fs/bpf is a fresh bpffs instance, its cgroup root a throwaway
child cgroup. A hostPath without a stand-in is an error, so a new one in the manifest is seen.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

SANDBOX = str(Path(__file__).with_name("sandbox.py"))
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")


def container(ds: dict[str, Any]) -> dict[str, Any]:
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return dict(c)


def resolve_env(c: dict[str, Any], image_env: dict[str, str], node_name: str,
                overrides: dict[str, str]) -> dict[str, str]:
    """The process environment: the image's, then the container's (fieldRef spec.nodeName is the
    node's name), then `overrides` (values the manifest says to set for a cluster)."""
    env = {**image_env, "HOME": "/root", "HOSTNAME": node_name}
    for e in c.get("env", []):
        if "valueFrom" in e:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName", e
            env[e["name"]] = node_name
        else:
            env[e["name"]] = e["value"]
    env.update(overrides)
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it in args (unknown references stay as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def volume_mounts(ds: dict[str, Any], config_dirs: dict[str, Path],
                  host_paths: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The manifest's volumeMounts as sandbox mounts, parents before children."""
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    out = []
    for m in container(ds)["volumeMounts"]:
        v = volumes[m["name"]]
        ro = bool(m.get("readOnly"))
        if "configMap" in v:
            out.append({"target": m["mountPath"], "type": "bind", "source": str(config_dirs[v["configMap"]["name"]]),
                        "readonly": ro})
        elif "emptyDir" in v:
            out.append({"target": m["mountPath"], "type": "tmpfs", "readonly": ro})
        elif "hostPath" in v:
            out.append({"target": m["mountPath"], **host_paths[v["hostPath"]["path"]], "readonly": ro})
        else:
            raise AssertionError(f"volume kind not handled: {v}")
    return sorted(out, key=lambda m: m["target"].rstrip("/").count("/"))


def runtime_mounts(service_account: Path) -> list[dict[str, Any]]:
    dev = [{"target": f"/dev/{n}", "type": "bind", "source": f"/dev/{n}"} for n in DEV_NODES]
    # as runc does for a container that is not privileged: /proc/sys and friends read-only
    proc_ro = [{"target": f"/proc/{p}", "type": "readonly"} for p in ("bus", "fs", "irq", "sys", "sysrq-trigger")]
    return [{"target": "/proc", "type": "proc"}, *proc_ro, {"target": "/sys", "type": "sysfs", "readonly": True},
            {"target": "/dev", "type": "tmpfs"}, *dev,
            {"target": SERVICE_ACCOUNT, "type": "bind", "source": str(service_account), "readonly": True}]


def sandbox_spec(ds: dict[str, Any], *, rootfs: Path, netns: str, image_config: dict[str, Any], node_name: str,
                 env_overrides: dict[str, str], service_account: Path, config_dirs: dict[str, Path],
                 host_paths: dict[str, dict[str, Any]]) -> dict[str, Any]:
    c = container(ds)
    sc = c["securityContext"]
    image_env = dict(e.split("=", 1) for e in image_config.get("Env", []))
    env = resolve_env(c, image_env, node_name, env_overrides)
    # a container's command is the image's Entrypoint unless `command` is set; `args` replace Cmd
    argv = [*(c.get("command") or image_config["Entrypoint"]), *[expand(a, env) for a in c.get("args", [])]]
    assert sc.get("runAsUser", 0) == 0 and sc["capabilities"]["drop"] == ["ALL"]
    return {"rootfs": str(rootfs), "netns": f"/run/netns/{netns}",
            "mounts": [*runtime_mounts(service_account), *volume_mounts(ds, config_dirs, host_paths)],
            "read_only_root": bool(sc.get("readOnlyRootFilesystem")),
            "capabilities": list(sc["capabilities"]["add"]),
            "no_new_privs": sc.get("allowPrivilegeEscalation") is False,
            "env": env, "argv": argv}


def sandbox_argv(spec_path: Path) -> list[str]:
    """The command that runs a spec written to `spec_path` (its pid is the entrypoint's)."""
    return ["unshare", "--mount", "--propagation", "private", sys.executable, SANDBOX, str(spec_path)]
