"""Every pod's servers in one process (memory is scarce on the edge machine): for pod N, TCP and
UDP sockets made inside netns pod-N on its address. TCP answers each line with "<pod> <line>";
UDP answers each datagram with "<pod> <datagram>". So a client sees which pod served it, and a
long-lived flow sees if it ever moved.

usage: servers.py PODS TCP_PORTS UDP_PORTS READY_FILE   (ports comma-separated)
"""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node import netns, pod_ip  # noqa: E402


class Udp(asyncio.DatagramProtocol):
    def __init__(self, pod: str) -> None:
        self.pod = pod.encode()
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # a datagram transport (the selector loop's is no DatagramTransport subclass)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.transport.sendto(self.pod + b" " + data, addr)  # type: ignore[union-attr]


def tcp_handler(pod: str):  # type: ignore[no-untyped-def]
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                writer.write(f"{pod} ".encode() + line)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
    return handle


async def main(pods: int, tcp_ports: list[int], udp_ports: list[int], ready: Path) -> None:
    loop = asyncio.get_running_loop()
    servers = []
    for i in range(pods):
        pod, ip = f"pod-{i}", pod_ip(i)
        for port in tcp_ports:
            with netns(pod):
                s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((ip, port))
            servers.append(await asyncio.start_server(tcp_handler(pod), sock=s, backlog=512))
        for port in udp_ports:
            with netns(pod):
                u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.bind((ip, port))
            await loop.create_datagram_endpoint(lambda pod=pod: Udp(pod), sock=u)  # type: ignore[misc]
    ready.write_text("ready\n")
    await asyncio.Event().wait()


if __name__ == "__main__":
    ports = [[int(p) for p in arg.split(",") if p] for arg in sys.argv[2:4]]
    asyncio.run(main(int(sys.argv[1]), ports[0], ports[1], Path(sys.argv[4])))
