"""ArgumentParser: argparse's parser whose usage errors are one line on stderr with exit 2, as
every other failure of usproxy is: "<prog>: error: <what> (see <prog> --help)". argparse's own
prints the whole usage block first (32 lines for `usproxy run`). Subcommands' parsers are of the
same class (argparse makes them with the parent's class).

`agent_address` is the argument type of the address a command reaches the running agent at
(status, flows, explain --live: their --metrics-bind-address)."""

from __future__ import annotations

import argparse
from typing import NoReturn

from usproxy.util import host_port


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def agent_address(text: str) -> str:
    """HOST:PORT as util.host_port reads it, HOST not empty; else argparse.ArgumentTypeError (a usage
    error naming the flag)."""
    try:
        host_port.split(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text
