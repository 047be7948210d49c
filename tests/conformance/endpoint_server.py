"""An endpoint for the conformance suite, run inside a pod netns: `endpoint_server.py IP PORT...`.

On each PORT it listens on IP for TCP and UDP. TCP: writes b"IP:PORT <peer ip>\\n" and closes.
UDP: answers b"IP:PORT|<peer ip>|" + payload. So a client learns which endpoint it reached (the
address the kernel or the relay delivered to) and the source address that endpoint saw (the
client's own, or the node's when masqueraded). Prints "ready" once bound. Stdlib only.
"""

from __future__ import annotations

import selectors
import socket
import sys


def main() -> None:
    ip, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
    sel = selectors.DefaultSelector()
    for port in ports:
        t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        t.bind((ip, port))
        t.listen(512)
        sel.register(t, selectors.EVENT_READ, ("tcp", f"{ip}:{port}"))
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind((ip, port))
        sel.register(u, selectors.EVENT_READ, ("udp", f"{ip}:{port}"))
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            kind, name = key.data
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                if kind == "tcp":
                    conn, peer = sock.accept()
                    with conn:
                        conn.sendall(f"{name} {peer[0]}\n".encode())
                else:
                    data, peer = sock.recvfrom(65535)
                    sock.sendto(f"{name}|{peer[0]}|".encode() + data, peer)
            except OSError:
                pass  # a client that went away: nothing to answer


if __name__ == "__main__":
    main()
