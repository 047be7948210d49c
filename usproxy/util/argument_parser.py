"""ArgumentParser: argparse's parser whose usage errors are one line on stderr with exit 2, as
every other failure of usproxy is: "<prog>: error: <what> (see <prog> --help)". argparse's own
prints the whole usage block first (32 lines for `usproxy run`). Subcommands' parsers are of the
same class (argparse makes them with the parent's class).

`agent_address` is the argument type of the address a command reaches the running agent at
(status, flows, explain --live: their --metrics-bind-address)."""

from __future__ import annotations

import argparse
import ipaddress
import re
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_HOST_NAME = re.compile(r"[A-Za-z0-9.-]+")  # a DNS name or an IPv4 literal


def agent_address(text: str) -> str:
    """HOST:PORT with HOST a name, an IPv4 address or [an IPv6 address] and PORT 0-65535; else
    argparse.ArgumentTypeError (a usage error naming the flag)."""
    host, sep, port = text.rpartition(":")
    try:
        if not sep or not port.isdigit() or int(port) > 65535:
            raise ValueError(port)
        if host.startswith("[") and host.endswith("]"):
            ipaddress.IPv6Address(host[1:-1])
        elif not _HOST_NAME.fullmatch(host):
            raise ValueError(host)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (a name, an IPv4 address or [an IPv6 address], "
                                         f"and a port), got {text!r}") from None
    return text
