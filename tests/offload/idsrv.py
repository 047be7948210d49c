"""idsrv for the offload tests, run inside a pod netns: `python3 idsrv.py NAME PORT STATS [--mute]`.

TCP: writes b"NAME <peer ip>\\n" and echoes. UDP: answers b"NAME|<peer ip>|" + payload (not with
--mute). Counts connections and datagrams per local address (the endpoint the kernel chose, via
IP_PKTINFO) and per peer, and rewrites STATS (JSON, atomically) every 0.1 s while it changes.
Stdlib only, single-threaded select() loop.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import time

IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)


def main() -> None:
    name, port, stats_path = sys.argv[1].encode(), int(sys.argv[2]), sys.argv[3]
    mute = "--mute" in sys.argv
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", port))
    tcp.listen(4096)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.setsockopt(socket.SOL_IP, IP_PKTINFO, 1)
    udp.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 16 << 20)  # bursts of 30,000
    udp.bind(("0.0.0.0", port))
    stats: dict[str, dict[str, int]] = {"tcp": {}, "udp": {}, "peers": {}}
    conns: list[socket.socket] = []
    dirty, last = False, 0.0
    while True:
        ready = select.select([tcp, udp, *conns], [], [], 0.1)[0]
        for s in ready:
            if s is tcp:
                c, peer = tcp.accept()
                local = c.getsockname()[0]
                stats["tcp"][local] = stats["tcp"].get(local, 0) + 1
                stats["peers"][peer[0]] = stats["peers"].get(peer[0], 0) + 1
                c.sendall(name + b" " + peer[0].encode() + b"\n")
                conns.append(c)
            elif s is udp:
                data, anc, _, peer = udp.recvmsg(65535, 64)
                local = next((socket.inet_ntoa(d[4:8]) for lvl, t, d in anc if t == IP_PKTINFO), "?")
                stats["udp"][local] = stats["udp"].get(local, 0) + 1
                stats["peers"][peer[0]] = stats["peers"].get(peer[0], 0) + 1
                if not mute:
                    udp.sendto(name + b"|" + peer[0].encode() + b"|" + data, peer)
            else:
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                if data:
                    s.sendall(data)
                else:
                    conns.remove(s)
                    s.close()
            dirty = True
        if dirty and time.monotonic() - last > 0.1:
            tmp = stats_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(stats, f)
            os.replace(tmp, stats_path)
            dirty, last = False, time.monotonic()


if __name__ == "__main__":
    main()
