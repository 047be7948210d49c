"""One small exception family per boundary.

ConfigError: bad input (manifests, flags, configuration files); its message names the object
(kind namespace/name), the field path and what is wrong. SourceError: a source cannot deliver.
OffloadError: a kernel datapath refused a transaction; carries errno when the kernel gave one.
CannotRun: this node or process does not allow what the command must do (a port in use, no
privilege); its message says what and what to do about it. The CLI turns ConfigError into exit 2
and the others into exit 1, each as one line.
"""

from __future__ import annotations


class UsproxyError(Exception):
    """Base of every error usproxy raises on purpose."""


class ConfigError(UsproxyError):
    """Bad input. `str(err)` is "<Kind> <namespace>/<name>: <field.path>: <what is wrong>"."""

    def __init__(self, message: str, *, obj: str = "", field: str = "") -> None:
        self.obj = obj
        self.field = field
        parts = [p for p in (obj, field) if p]
        super().__init__(": ".join([*parts, message]))


class SourceError(UsproxyError):
    """A source (file, API server) could not be read."""


class OffloadError(UsproxyError):
    """A kernel datapath transaction failed; `errno` is the kernel's, or 0 when unknown.
    `message` is the text without the errno."""

    def __init__(self, message: str, errno: int = 0) -> None:
        self.message = message
        self.errno = errno
        super().__init__(message if not errno else f"{message} (errno {errno})")


class AlreadyRunning(UsproxyError):
    """Another agent holds this network namespace (two agents would fight over its listeners
    and kernel tables)."""


class CannotRun(UsproxyError):
    """The node or the process's privileges do not allow what the command must do: one line
    saying what failed and what to do (exit 1)."""
