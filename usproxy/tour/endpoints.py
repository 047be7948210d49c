"""The tour's endpoints: TCP servers that answer each connection with their own address, and
count the connections they accepted.

    python -m usproxy.tour.endpoints ADDRESS:PORT ...

Runs in the pods' network namespace. Each ADDRESS:PORT is one endpoint (one listening socket).
A connection is accepted, sent "ADDRESS\\n" and closed at once: the endpoint closes first, so
TIME_WAIT stays here and the client's ports are free again at once (docs/platform.md, TIME_WAIT
and connection-rate measurements); the client sends nothing, so the close is a FIN, never a
reset. Prints "ready" once every socket listens. Commands on stdin, one per line:
`counts` prints {"ADDRESS:PORT": accepted, ...} as one JSON line; end of input ends the process.

The counts are the endpoints' own: the tour's tests hold the tour's per-endpoint figures (what
the client read in each answer) to them. One thread, epoll, stdlib only: cheap next to the
datapaths it serves.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys

BACKLOG = 4096


def serve(specs: list[str]) -> int:
    ep = select.epoll()
    listeners: dict[int, tuple[socket.socket, str, bytes]] = {}
    for spec in specs:
        ip, port = spec.rsplit(":", 1)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((ip, int(port)))
        s.listen(BACKLOG)
        s.setblocking(False)
        listeners[s.fileno()] = (s, spec, f"{ip}\n".encode())
        ep.register(s.fileno(), select.EPOLLIN)
    counts = {spec: 0 for _, spec, _ in listeners.values()}
    stdin = sys.stdin.fileno()
    ep.register(stdin, select.EPOLLIN)
    pending = b""
    print("ready", flush=True)
    while True:
        for fd, _ in ep.poll():
            if fd == stdin:
                data = os.read(stdin, 4096)
                if not data:
                    return 0
                pending += data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if line.strip() == b"counts":
                        print(json.dumps(counts), flush=True)
                continue
            s, spec, answer = listeners[fd]
            while True:
                try:
                    conn, _ = s.accept()
                except BlockingIOError:
                    break
                except OSError:  # e.g. ECONNABORTED: the client gave up before the accept
                    continue
                counts[spec] += 1
                try:
                    conn.send(answer)
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:]))
