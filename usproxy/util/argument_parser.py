"""ArgumentParser: argparse's parser whose usage errors are one line on stderr with exit 2, as
every other failure of usproxy is: "<prog>: error: <what> (see <prog> --help)". argparse's own
prints the whole usage block first (32 lines for `usproxy run`). Subcommands' parsers are of the
same class (argparse makes them with the parent's class)."""

from __future__ import annotations

import argparse
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
