"""idsrv (docs/field-cases.md#conventions): TCP writes "<name>\\n" then echoes; UDP answers
"<name>|<payload>".

Run inside a pod netns: `idsrv.py NAME PORT [PORT...]`, one TCP and one UDP socket per port, on
every local address. Prints "ready" once bound. On SIGTERM prints a JSON line of counts per
(local address, port, protocol) and exits.
"""

from __future__ import annotations

import json
import selectors
import signal
import socket
import struct
import sys


IP_PKTINFO = 8  # linux/in.h; the socket module lacks the name


def main() -> None:
    name = sys.argv[1].encode()
    sel = selectors.DefaultSelector()
    counts: dict[str, int] = {}
    for port in map(int, sys.argv[2:]):
        t = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)  # dual stack: IPv4 and IPv6
        t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        t.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        t.bind(("::", port))
        t.listen(1024)
        t.setblocking(False)
        sel.register(t, selectors.EVENT_READ, ("accept", port))
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.setsockopt(socket.SOL_IP, IP_PKTINFO, 1)
        u.bind(("0.0.0.0", port))
        u.setblocking(False)
        sel.register(u, selectors.EVENT_READ, ("udp", port))

    def stop(*_: object) -> None:
        print(json.dumps(counts), flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            kind, port = key.data
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if kind == "accept":
                try:
                    conn, _peer = sock.accept()
                except BlockingIOError:
                    continue
                local = conn.getsockname()[0].removeprefix("::ffff:")
                counts[f"{local}:{port}/TCP"] = counts.get(f"{local}:{port}/TCP", 0) + 1
                conn.setblocking(False)
                try:
                    conn.send(name + b"\n")
                except OSError:
                    conn.close()
                    continue
                sel.register(conn, selectors.EVENT_READ, ("conn", port))
            elif kind == "conn":
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(sock)
                    sock.close()
                    continue
                try:
                    sock.send(data)
                except OSError:
                    pass
            else:
                try:
                    data, anc, _flags, peer = sock.recvmsg(65536, 256)
                except BlockingIOError:
                    continue
                dst = anc[0][2][8:12] if anc else b"\0\0\0\0"
                local = socket.inet_ntoa(dst)
                counts[f"{local}:{port}/UDP"] = counts.get(f"{local}:{port}/UDP", 0) + 1
                # reply from the address the datagram was sent to (the server has many)
                info = struct.pack("I4s4s", 0, dst, b"\0\0\0\0")
                try:
                    sock.sendmsg([name + b"|" + data], [(socket.SOL_IP, IP_PKTINFO, info)], 0, peer)
                except OSError:
                    pass


if __name__ == "__main__":
    main()
