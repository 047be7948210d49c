"""messages.py packs IPVS's new virtual and real servers with struct; pyroute2's message classes
are the reference encoder: for every kind of virtual server the datapath writes (IPv4 and IPv6,
TCP and UDP, each scheduler, with and without persistence) and real servers of weight 0 and 1,
the bytes are the same as pyroute2's for the same request. Pure encoding; no root, no IPVS."""

from __future__ import annotations

import ipaddress

import pytest
from pyroute2.netlink.generic.ipvs import GENL_VERSION, IPVS_CMD_NEW_DEST, IPVS_CMD_NEW_SERVICE, ipvsmsg

from usproxy.offload.ipvs import messages
from usproxy.offload.ipvs.kernel import PROTOCOLS, Dest, Service, _dest_msg, _key_msg, _service_msg

FAMILY = 0x23  # the IPVS family's id: the kernel's choice at boot; any number encodes the same way
SERVICES = [Service("TCP", ipaddress.ip_address("10.96.0.1"), 80, "rr"),
            Service("UDP", ipaddress.ip_address("10.96.0.10"), 53, "wrr", 1, 10800),
            Service("TCP", ipaddress.ip_address("192.0.2.10"), 30080, "mh"),
            Service("TCP", ipaddress.ip_address("fd00:10:96::1"), 443, "lc"),
            Service("UDP", ipaddress.ip_address("fd00:10:96::a"), 5353, "wlc", 1, 30)]
DESTS = [Dest(ipaddress.ip_address("10.244.1.5"), 8080), Dest(ipaddress.ip_address("10.244.2.7"), 53, weight=0),
         Dest(ipaddress.ip_address("fd00:10:244::5"), 8443, weight=3)]


def pyroute2_bytes(cmd: int, seq: int, attrs: list[tuple[str, object]]) -> bytes:
    msg = ipvsmsg()
    msg["cmd"], msg["version"], msg["attrs"] = cmd, GENL_VERSION, attrs
    msg["header"].update({"type": FAMILY, "flags": messages.CREATE, "sequence_number": seq})
    msg.encode()
    return bytes(msg.data)


def key(s: Service) -> messages.Key:
    return (PROTOCOLS[s.proto], s.address, s.port)


@pytest.mark.parametrize("svc", SERVICES, ids=lambda s: f"{s.proto}-{s.address}-{s.scheduler}")
def test_a_new_virtual_server_is_pyroute2s_bytes(svc: Service) -> None:
    ours = messages.new_service(FAMILY, 41, messages.service_attrs(key(svc), svc.scheduler, svc.flags, svc.timeout))
    assert ours == pyroute2_bytes(IPVS_CMD_NEW_SERVICE, 41, [("IPVS_CMD_ATTR_SERVICE", _service_msg(svc).dump_nla())])


@pytest.mark.parametrize("dest", DESTS, ids=lambda d: f"{d.address}-w{d.weight}")
@pytest.mark.parametrize("svc", SERVICES[:2] + SERVICES[3:4], ids=lambda s: f"{s.proto}-{s.address}")
def test_a_new_real_server_is_pyroute2s_bytes(svc: Service, dest: Dest) -> None:
    ours = messages.new_dest(FAMILY, 7, messages.service_key_attrs(key(svc)),
                             messages.dest_attrs(dest.address, dest.port, dest.weight, dest.fwd))
    assert ours == pyroute2_bytes(IPVS_CMD_NEW_DEST, 7, [("IPVS_CMD_ATTR_SERVICE", _key_msg(svc.key).dump_key()),
                                                          ("IPVS_CMD_ATTR_DEST", _dest_msg(dest).dump_nla())])
