"""Test client run inside the test cgroup and a client netns; prints one JSON object.

  client.py tcp HOST PORT N          N sequential connections: first line (server name) of each
  client.py udp HOST PORT N          N fresh unconnected sockets: sendto, recvfrom (reply source)
  client.py udpconn HOST PORT N      N fresh connected sockets: connect, send, recv, getpeername
  client.py udpsend HOST PORT N      N fresh sockets, one sendto each, no reply awaited
  client.py hold HOST PORT UHOST UPORT   one long-lived TCP echo connection and one UDP socket;
                                     a round trip on each every 50 ms, "tick" lines on stdout,
                                     until stdin closes; then the summary
  client.py session HOST PORT        one connected UDP socket, a query every 50 ms, "tick" lines
                                     on stdout, until stdin closes; then the names that answered
"""

from __future__ import annotations

import errno
import json
import select
import socket
import sys
from collections import Counter


def _err(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, str(e))


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _hostport(addr: tuple[object, ...]) -> str:
    host = str(addr[0])
    return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"


def tcp(host: str, port: int, n: int) -> dict[str, object]:
    names: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    peers: Counter[str] = Counter()
    for _ in range(n):
        s = socket.socket(_family(host), socket.SOCK_STREAM)
        s.settimeout(3)
        try:
            s.connect((host, port))
            peers[_hostport(s.getpeername())] += 1
            names[s.makefile().readline().strip()] += 1
        except OSError as e:
            errors[_err(e)] += 1
        finally:
            s.close()
    return {"names": names, "errors": errors, "peers": peers}


def udp(host: str, port: int, n: int, connected: bool) -> dict[str, object]:
    names: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    sources: Counter[str] = Counter()
    for i in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(2)
        try:
            if connected:
                s.connect((host, port))
                sources["%s:%d" % s.getpeername()] += 1
                s.send(b"q%d" % i)
                data = s.recv(65536)
            else:
                s.sendto(b"q%d" % i, (host, port))
                data, src = s.recvfrom(65536)
                sources["%s:%d" % src] += 1
            names[data.split(b"|", 1)[0].decode()] += 1
        except OSError as e:
            errors[_err(e)] += 1
        finally:
            s.close()
    return {"names": names, "errors": errors, "sources": sources}


def udpsend(host: str, port: int, n: int) -> dict[str, object]:
    errors: Counter[str] = Counter()
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.sendto(b"x", (host, port))
        except OSError as e:
            errors[_err(e)] += 1
        finally:
            s.close()
    return {"errors": errors}


def hold(host: str, port: int, uhost: str, uport: int) -> dict[str, object]:
    t = socket.create_connection((host, port), timeout=3)
    first = t.makefile("rb").readline()  # the server's name; the makefile buffer is then unused
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(2)
    ok = fails = 0
    udp_names: Counter[str] = Counter()
    udp_sources: Counter[str] = Counter()
    while not select.select([sys.stdin], [], [], 0.05)[0]:
        try:
            t.sendall(b"ping\n")
            ok += t.recv(64) == b"ping\n"
            if uhost == "-":
                print("tick", flush=True)
                continue
            u.sendto(b"hold", (uhost, uport))
            data, src = u.recvfrom(65536)
            udp_names[data.split(b"|", 1)[0].decode()] += 1
            udp_sources["%s:%d" % src] += 1
        except OSError:
            fails += 1
        print("tick", flush=True)
    return {"tcp_name": first.decode().strip(), "tcp_ok": ok, "fails": fails,
            "udp_names": udp_names, "udp_sources": udp_sources}


def session(host: str, port: int) -> dict[str, object]:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.connect((host, port))
    u.settimeout(2)
    fails = 0
    names: Counter[str] = Counter()
    while not select.select([sys.stdin], [], [], 0.05)[0]:
        try:
            u.send(b"session")
            names[u.recv(65536).split(b"|", 1)[0].decode()] += 1
        except OSError:
            fails += 1
        print("tick", flush=True)
    return {"names": names, "fails": fails}


def main() -> None:
    mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "tcp":
        out = tcp(host, port, int(sys.argv[4]))
    elif mode in ("udp", "udpconn"):
        out = udp(host, port, int(sys.argv[4]), connected=mode == "udpconn")
    elif mode == "udpsend":
        out = udpsend(host, port, int(sys.argv[4]))
    elif mode == "session":
        out = session(host, port)
    else:
        out = hold(host, port, sys.argv[4], int(sys.argv[5]))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
