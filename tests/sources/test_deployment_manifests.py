"""examples/kubernetes: the manifests parse and agree with the agent.

Agreement checked: the DaemonSet's args parse with usproxy's own CLI and, together with the
ConfigMap's KubeProxyConfiguration, give the ports the probes use; probe paths are routes of the
admin server; RBAC grants exactly list/watch on the resources the source reads (derived from its
API paths); names and namespaces line up; the mounts are where the BPF datapath and the
--bpf-cgroup flag look; the image is the one the Dockerfile documents, at the package version.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.deploy.manifests import docs
from usproxy.admin.server import health_routes
from usproxy.util.host_port import bind_address
from usproxy.util.locks import LOCK_DIR
from usproxy.app.cli import build_parser, config_from_args
from usproxy.model.node import resolve_node
from usproxy.offload.bpf.loader import BPFFS
from usproxy.sources.api_list_watch import ENDPOINT_SLICES, NODES, SERVICE_CIDRS, SERVICES

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "kubernetes"


@pytest.fixture(scope="module")
def objs() -> dict[tuple[str, str], dict[str, Any]]:
    return docs()


@pytest.fixture(scope="module")
def ds(objs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return objs[("DaemonSet", "usproxy")]


def container(ds: dict[str, Any]) -> dict[str, Any]:
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return dict(c)


def mounts(ds: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """mountPath -> (volumeMount, volume)."""
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    return {m["mountPath"]: (m, vols[m["name"]]) for m in container(ds)["volumeMounts"]}


def test_every_object_is_there(objs: dict[tuple[str, str], dict[str, Any]]) -> None:
    assert set(objs) == {("ServiceAccount", "usproxy"), ("ClusterRole", "usproxy"),
                         ("ClusterRoleBinding", "usproxy"), ("ConfigMap", "usproxy"), ("DaemonSet", "usproxy")}
    namespaced = [o for o in objs.values() if o["kind"] in ("ServiceAccount", "ConfigMap", "DaemonSet")]
    assert {o["metadata"]["namespace"] for o in namespaced} == {"kube-system"}


def test_args_parse_and_agree_with_probes(ds: dict[str, Any], objs: dict[tuple[str, str], dict[str, Any]],
                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = container(ds)
    conf_flag = next(a for a in c["args"] if a.startswith("--config="))
    conf_path = Path(conf_flag.split("=", 1)[1])
    mount, volume = mounts(ds)[str(conf_path.parent)]
    cm = objs[("ConfigMap", volume["configMap"]["name"])]
    local = tmp_path / conf_path.name
    local.write_text(cm["data"][conf_path.name])
    args = [a.replace(conf_flag, f"--config={local}").replace("$(NODE_NAME)", "node-x") for a in c["args"]]
    monkeypatch.delenv("NODE_NAME", raising=False)
    cfg = config_from_args(build_parser().parse_args(args))
    assert args[0] == "run" and cfg.kubeconfig is None  # in-cluster
    assert resolve_node(cfg, kubernetes=True, environ={}).name == "node-x"
    healthz_port = bind_address(cfg.healthz_bind_address)[1]
    assert bind_address(cfg.healthz_bind_address)[0] == "0.0.0.0"  # the kubelet probes the node IP
    assert cfg.metrics_bind_address == "127.0.0.1:10249"
    assert healthz_port == 10256
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"healthz": healthz_port}
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": healthz_port}
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": healthz_port}
    app = web.Application()
    health_routes(app, view=None)  # type: ignore[arg-type]
    routes = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    assert {"/livez", "/healthz"} <= routes


def test_node_name_and_api_server_come_from_the_environment(ds: dict[str, Any]) -> None:
    env = {e["name"]: e for e in container(ds)["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "--hostname-override=$(NODE_NAME)" in container(ds)["args"]
    # the agent picks the in-cluster configuration when this is set (agent._in_cluster)
    assert env["KUBERNETES_SERVICE_HOST"]["value"] and env["KUBERNETES_SERVICE_PORT"]["value"].isdigit()


def test_host_network_and_least_privilege(ds: dict[str, Any]) -> None:
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and spec["serviceAccountName"] == "usproxy"
    sc = container(ds)["securityContext"]
    assert not sc.get("privileged", False) and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sorted(sc["capabilities"]["add"]) == ["BPF", "NET_ADMIN", "NET_BIND_SERVICE"]
    assert sc["readOnlyRootFilesystem"] is True


def test_mounts_bpf_and_cgroup_where_the_agent_looks(ds: dict[str, Any]) -> None:
    m = mounts(ds)
    bpf_mount, bpf_vol = m[str(BPFFS)]
    assert bpf_vol["hostPath"]["path"] == "/sys/fs/bpf" and bpf_mount["mountPropagation"] == "HostToContainer"
    cgroup_flag = next(a for a in container(ds)["args"] if a.startswith("--bpf-cgroup="))
    _, cg_vol = m[cgroup_flag.split("=", 1)[1]]
    assert cg_vol["hostPath"]["path"] == "/sys/fs/cgroup"
    assert not any(v.get("hostPath", {}).get("path") in ("/", "/proc", "/dev", "/var/run/docker.sock")
                   for _, v in m.values())
    # the root is read-only: the agent's lock directory is the host's, so agents on the node's
    # network (an old Pod, a systemd one) see each other's locks
    lock_mount, lock_vol = m[str(LOCK_DIR)]
    assert lock_vol["hostPath"]["path"] == str(LOCK_DIR) and not lock_mount.get("readOnly")


def _rule_target(path: str) -> tuple[str, str]:
    """API path → (apiGroup, resource): /api/v1/x → ("", x); /apis/g/v/x → (g, x)."""
    parts = path.strip("/").split("/")
    return ("", parts[2]) if parts[0] == "api" else (parts[1], parts[3])


def test_cluster_role_grants_exactly_what_the_source_reads(objs: dict[tuple[str, str], dict[str, Any]]) -> None:
    role = objs[("ClusterRole", "usproxy")]
    granted = {(g, r): sorted(rule["verbs"]) for rule in role["rules"]
               for g in rule["apiGroups"] for r in rule["resources"]}
    needed = {_rule_target(p): ["list", "watch"] for p in (SERVICES, ENDPOINT_SLICES, NODES, SERVICE_CIDRS)}
    assert granted == needed
    assert all(not rule.get("resourceNames") and "*" not in rule["verbs"] for rule in role["rules"])


def test_names_resolve_without_the_cluster_dns_this_agent_serves(ds: dict[str, Any]) -> None:
    """ClusterFirstWithHostNet would ask the cluster DNS ClusterIP, which answers only once this
    agent serves it (the API server's name among the lookups); Default asks the node's resolver.
    (ClusterFirst on the host network means the same as Default, but says otherwise.)"""
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "Default"


def test_binding_ties_the_service_account_to_the_role(objs: dict[tuple[str, str], dict[str, Any]]) -> None:
    binding = objs[("ClusterRoleBinding", "usproxy")]
    sa = objs[("ServiceAccount", "usproxy")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "usproxy"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]


def test_dockerfile_builds_the_image_the_daemonset_runs(ds: dict[str, Any]) -> None:
    dockerfile = (EXAMPLES / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    image = container(ds)["image"]
    assert image == f"usproxy:{project['version']}"
    assert f"-t {image} ." in dockerfile
    assert "usproxy" in project["scripts"] and 'ENTRYPOINT ["usproxy"]' in dockerfile
    for line in dockerfile.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), line
    # the BPF object comes inside the wheel the image installs (setup.py compiles it when the wheel
    # is built); tests/deploy/test_image.py finds it in the built image
    assert "pip wheel" in dockerfile and "pip install --no-cache-dir /wheels/usproxy-" in dockerfile
    assert "build.build_prebuilt(" in (ROOT / "setup.py").read_text()
