"""nfacct counters: the named packet counters kube-proxy's iptables rules count with.

kube-proxy (pkg/proxy/util/nfacct) creates two extended accounting objects at start and, when the
kernel has them, adds `-m nfacct --nfacct-name NAME` to two rules: localhost NodePort packets
accepted, and INVALID packets dropped in KUBE-FORWARD. A rule naming a counter that does not
exist is refused by iptables-restore, so the counters are made first, in the network namespace
of the rules (they are per namespace), and a kernel without nfnetlink_acct gets the rules without
the match (rules.Options.nfacct False), as kube-proxy's.

One netlink message per counter (NFNL_SUBSYS_ACCT, NFNL_MSG_ACCT_NEW, attribute NFACCT_NAME);
EBUSY means it exists already. The caller runs this in the namespace's worker thread.
"""

from __future__ import annotations

import errno
import socket
import struct

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ACCT = 7
NFNL_MSG_ACCT_NEW = 0
NFACCT_NAME = 1
NLM_F_REQUEST, NLM_F_ACK, NLM_F_CREATE = 0x1, 0x4, 0x400
NLMSG_ERROR = 2
COUNTERS = ("localhost_nps_accepted_pkts", "ct_state_invalid_dropped_pkts")  # rules.py's names


def ensure(names: tuple[str, ...] = COUNTERS) -> str | None:
    """Create the counters that do not exist yet. None when all exist; else why not."""
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as s:
            s.bind((0, 0))
            for seq, name in enumerate(names, start=1):
                code = _new(s, name, seq)
                if code not in (0, errno.EBUSY):
                    return f"nfacct {name}: {errno.errorcode.get(code, code)}"
    except OSError as err:
        return f"nfacct: {err}"
    return None


def _new(s: socket.socket, name: str, seq: int) -> int:
    """Send NFNL_MSG_ACCT_NEW for `name`; the errno of the kernel's answer (0: created)."""
    text = name.encode() + b"\0"
    attr = struct.pack("=HH", 4 + len(text), NFACCT_NAME) + text
    attr += b"\0" * (-len(attr) % 4)
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, 0) + attr  # nfgenmsg: family, version, res_id
    header = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_ACCT << 8) | NFNL_MSG_ACCT_NEW,
                         NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE, seq, 0)
    s.send(header + body)
    reply = s.recv(4096)
    if len(reply) < 20 or struct.unpack("=H", reply[4:6])[0] != NLMSG_ERROR:
        return errno.EPROTO
    code: int = struct.unpack("=i", reply[16:20])[0]
    return -code
