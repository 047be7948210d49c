"""The socket LB with real traffic: clients in a test cgroup reach endpoints in pod netns.

Covers: TCP connect() to a ClusterIP reaches the endpoints directly (nothing in netns node is
involved), getpeername shows the ClusterIP, DNS-style UDP replies come from the ClusterIP (connected
and unconnected sockets), a ServicePort without endpoints refuses at once and recovers on 0->N
(C01), an endpoint change takes effect for the next connect(), and IPv6 (connect6 and
v4-mapped addresses on IPv6 sockets, C23).
"""

from __future__ import annotations

import pytest

from tests.offload.bpf.builders import ep, spn, state
from tests.netns import nsexec
from tests.offload.bpf.conftest import Env, nodeless

pytestmark = pytest.mark.netns

WEB = spn("web", "http")
DNS = spn("dns", "dns", "UDP", ns="kube-system")


async def test_tcp_connect_goes_straight_to_endpoints(bpf_env: Env) -> None:
    bpf_env.server("be-a", "10.244.1.5", 8080)
    bpf_env.server("be-b", "10.244.2.5", 8080)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    await bpf_env.dp.apply({WEB: state(WEB, "10.96.10.10", 80, [ep("10.244.1.5"), ep("10.244.2.5")])})

    out = bpf_env.run(cli, "tcp", "10.96.10.10", 80, 200)

    assert out["errors"] == {}
    assert set(out["names"]) == {"be-a", "be-b"} and sum(out["names"].values()) == 200
    assert out["peers"] == {"10.96.10.10:80": 200}  # getpeername shows the ClusterIP
    nodeless(bpf_env.topo)  # no relay, no listener: the kernel steered every connect
    assert "selected=" in bpf_env.dp.dump(counters=True)
    assert bpf_env.dp.flows_view() == []  # closed sockets took their rows with them


async def test_udp_replies_come_from_the_cluster_ip(bpf_env: Env) -> None:
    bpf_env.server("be-dns", "10.244.1.53", 53)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    await bpf_env.dp.apply({DNS: state(DNS, "10.96.0.10", 53, [ep("10.244.1.53", 53)])})

    unconnected = bpf_env.run(cli, "udp", "10.96.0.10", 53, 50)
    connected = bpf_env.run(cli, "udpconn", "10.96.0.10", 53, 50)

    for out in (unconnected, connected):
        assert out["errors"] == {}
        assert out["names"] == {"be-dns": 50}
        assert out["sources"] == {"10.96.0.10:53": 50}


async def test_no_endpoints_refuses_at_once_and_recovers(bpf_env: Env) -> None:
    bpf_env.server("be-a", "10.244.1.5", 8080)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    await bpf_env.dp.apply({WEB: state(WEB, "10.96.10.10", 80, []), DNS: state(DNS, "10.96.0.10", 53, [])})

    assert bpf_env.run(cli, "tcp", "10.96.10.10", 80, 20)["errors"] == {"ECONNREFUSED": 20}
    assert bpf_env.run(cli, "udpsend", "10.96.0.10", 53, 20)["errors"] == {"ECONNREFUSED": 20}
    assert bpf_env.run(cli, "udpconn", "10.96.0.10", 53, 5)["errors"] == {"ECONNREFUSED": 5}

    await bpf_env.dp.apply({WEB: state(WEB, "10.96.10.10", 80, [ep("10.244.1.5")])})
    assert bpf_env.run(cli, "tcp", "10.96.10.10", 80, 20)["names"] == {"be-a": 20}

    await bpf_env.dp.apply({WEB: state(WEB, "10.96.10.10", 80, [])})
    assert bpf_env.run(cli, "tcp", "10.96.10.10", 80, 20)["errors"] == {"ECONNREFUSED": 20}


async def test_endpoint_change_applies_to_the_next_connect(bpf_env: Env) -> None:
    bpf_env.server("be-a", "10.244.1.5", 8080)
    bpf_env.server("be-b", "10.244.2.5", 8080)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    await bpf_env.dp.apply({WEB: state(WEB, "10.96.10.10", 80, [ep("10.244.1.5")])})
    assert bpf_env.run(cli, "tcp", "10.96.10.10", 80, 10)["names"] == {"be-a": 10}

    await bpf_env.dp.apply({WEB: state(WEB, "10.96.10.10", 80, [ep("10.244.2.5")])})
    assert bpf_env.run(cli, "tcp", "10.96.10.10", 80, 10)["names"] == {"be-b": 10}

    await bpf_env.dp.apply({WEB: None})
    # no Service any more: the connect goes to the ClusterIP itself, which nothing serves here
    out = bpf_env.run(cli, "tcp", "10.96.10.10", 80, 1)
    assert out["names"] == {} and sum(out["errors"].values()) == 1


async def test_ipv6_and_v4_mapped(bpf_env: Env) -> None:
    be = bpf_env.server("be-a", "10.244.1.5", 8080)
    cli = bpf_env.client_ns("cli", "10.244.9.10")
    for ns, addr in ((be, "2001:db8:244:1::5/48"), (cli, "2001:db8:244:9::10/48")):
        nsexec(ns, "ip", "-6", "addr", "add", addr, "dev", "eth0", "nodad")
    v6 = spn("v6")
    await bpf_env.dp.apply({
        v6: state(v6, "2001:db8:96::a", 80, [ep("2001:db8:244:1::5")]),
        WEB: state(WEB, "10.96.10.10", 80, [ep("10.244.1.5")]),
    })

    out = bpf_env.run(cli, "tcp", "2001:db8:96::a", 80, 20)
    assert out["names"] == {"be-a": 20} and out["peers"] == {"[2001:db8:96::a]:80": 20}
    mapped = bpf_env.run(cli, "tcp", "::ffff:10.96.10.10", 80, 20)  # an IPv6 socket, connect6
    assert mapped["names"] == {"be-a": 20} and mapped["peers"] == {"[::ffff:10.96.10.10]:80": 20}
