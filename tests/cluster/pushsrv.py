"""A pod's TCP server for the attack tests: `python3 pushsrv.py NAME PORT`, run inside a pod netns.

Per connection it writes b"NAME <peer ip>\\n", then serves lines:
  "wait PATH"  waits (polling) until the file PATH exists, then pushes b"pushed\\n": a server push
               on a connection the client left idle meanwhile;
  "bulk N"     sends N bytes (a download), then b"done\\n";
  "bye"        closes the connection (the server's FIN first);
  anything else is echoed.
Stdlib only, a thread per connection.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time


def serve(name: bytes, conn: socket.socket, peer: str) -> None:
    with conn:
        conn.sendall(name + b" " + peer.encode() + b"\n")
        buf = b""
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.startswith(b"wait "):
                    path = line[5:].decode()
                    while not os.path.exists(path):
                        time.sleep(0.05)
                    conn.sendall(b"pushed\n")
                elif line == b"bye":
                    return  # the server closes first
                elif line.startswith(b"bulk "):
                    size = int(line[5:])
                    conn.sendall((bytes(range(256)) * (size // 256 + 1))[:size] + b"done\n")
                else:
                    conn.sendall(line + b"\n")


def main() -> None:
    name, port = sys.argv[1].encode(), int(sys.argv[2])
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(4096)
    while True:
        conn, peer = srv.accept()
        threading.Thread(target=serve, args=(name, conn, peer[0]), daemon=True).start()


if __name__ == "__main__":
    main()
