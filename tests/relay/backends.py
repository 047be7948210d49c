"""Backend programs for relay tests, run inside pod netns: `python3 backends.py MODE ...`.

idsrv NAME ADDR PORT [--udp] [--log FILE]: on TCP writes "NAME\\n" then echoes; on UDP answers
  b"NAME|" + payload. With --log, appends one line per TCP connection or UDP datagram:
  "<monotonic time> <proto> <peer ip>:<port> <bytes>".
echo ADDR PORT [--udp]: pure echo (TCP: until EOF, then close; UDP: datagram for datagram).
Stdlib only: it must run with any python3.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Callable
from typing import Any


def _log(path: str | None, proto: str, peer: tuple[str, int], n: int) -> None:
    if path:
        with open(path, "a") as f:
            f.write(f"{time.monotonic():.6f} {proto} {peer[0]}:{peer[1]} {n}\n")


def _family(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def serve_tcp(addr: str, port: int, handler: Callable[[socket.socket, Any], None]) -> None:
    srv = socket.socket(_family(addr), socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(1024)
    while True:
        conn, peer = srv.accept()
        threading.Thread(target=handler, args=(conn, peer), daemon=True).start()


def serve_udp(addr: str, port: int, reply: Callable[[bytes, Any], bytes | None]) -> None:
    s = socket.socket(_family(addr), socket.SOCK_DGRAM)
    s.bind((addr, port))
    while True:
        data, peer = s.recvfrom(65535)
        out = reply(data, peer)
        if out is not None:
            s.sendto(out, peer)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["idsrv", "echo"])
    p.add_argument("args", nargs="+")
    p.add_argument("--udp", action="store_true")
    p.add_argument("--log")
    a = p.parse_args()
    if a.mode == "idsrv":
        name, addr, port = a.args[0], a.args[1], int(a.args[2])
    else:
        name, addr, port = "", a.args[0], int(a.args[1])

    def tcp(conn: socket.socket, peer: tuple[str, int]) -> None:
        _log(a.log, "tcp", peer, 0)
        try:
            if name:
                conn.sendall(name.encode() + b"\n")
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                conn.sendall(data)
        except OSError:
            pass
        finally:
            conn.close()

    def udp(data: bytes, peer: tuple[str, int]) -> bytes:
        _log(a.log, "udp", peer, len(data))
        return (name.encode() + b"|" + data) if name else data

    print("ready", flush=True)
    if a.udp:
        serve_udp(addr, port, udp)
    else:
        serve_tcp(addr, port, tcp)


if __name__ == "__main__":
    main()
