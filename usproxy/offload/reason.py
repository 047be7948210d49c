"""Reason: where the offload layer has put a ServicePort and why, as a value.

The OffloadManager decides on these values and compares them; they become text only at the
edges: the /services reason (`Reason.text`), log lines (`Fault.text`) and the labels of
usproxy_offload_demotions (`Fault.datapath`, `Cause.label`). Nothing parses the text back.

A ServicePort is in exactly one Phase. A demoted one carries one Fault per kernel datapath that
could not take it (two when neither BPF nor nftables can serve it), each naming that datapath,
the cause and, for a refused transaction, the kernel's errno.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from usproxy.model.service import DATAPATH_ANNOTATION

NO_DATAPATH = "none"  # the datapath label when no kernel datapath is configured at all


class Phase(enum.Enum):
    """A ServicePort's place in the offload life cycle; the value is the word `dump()` shows."""

    _value_: str

    ESTABLISHING = "establishing"  # served by the relay until its endpoints are stable for the window
    ESTABLISHED = "established"  # installed in one or more kernel datapaths
    DEMOTED = "demoted"  # served by the relay: no kernel datapath can, or one refused it
    PINNED = "pinned"  # served by the relay because its annotation says so
    REMOVED = "removed"  # gone from the source; being removed from the kernels


class Cause(enum.Enum):
    """Why a kernel datapath does not hold a demoted ServicePort."""

    _value_: str

    ABSENT = "absent"  # no kernel datapath (of the annotated kind) is configured
    UNAVAILABLE = "unavailable"  # the datapath's probe failed on this node
    UNSUPPORTED = "unsupported"  # the datapath cannot serve this ServicePort (e.g. SCTP)
    REFUSED = "refused"  # the kernel refused the transaction that installed or changed it

    @property
    def label(self) -> str:
        """The `reason` label of usproxy_offload_demotions (values kept from earlier releases)."""
        return {Cause.ABSENT: "unavailable", Cause.REFUSED: "apply_failed"}.get(self, self.value)


@dataclass(frozen=True, slots=True)
class Fault:
    """One kernel datapath's part in a demotion.

    `datapath` is the kernel datapath's name ("nftables", "bpf"), or NO_DATAPATH when none is
    configured; `detail` is in that datapath's (or the kernel's) words; `errno` is the kernel's
    error number of a refused transaction, 0 when it gave none.
    """

    datapath: str
    cause: Cause
    detail: str = ""
    errno: int = 0

    def text(self) -> str:
        """As /services and the log show it, e.g. "nftables: refused ... (errno 22)"."""
        if self.cause is Cause.ABSENT:
            return "no kernel datapath configured" if self.datapath == NO_DATAPATH else f"{self.datapath} not configured"
        if self.cause is Cause.UNAVAILABLE:
            return f"{self.datapath} unavailable: {self.detail}"
        return f"{self.datapath}: {self.detail}" + (f" (errno {self.errno})" if self.errno else "")


@dataclass(frozen=True, slots=True)
class Reason:
    """A ServicePort's phase and, when demoted, the faults that keep it in the relay."""

    phase: Phase
    faults: tuple[Fault, ...] = ()

    def text(self, *, waited: float = 0.0, window: float = 0.0) -> str:
        """The /services reason of a ServicePort the relay serves. `waited` is how long its
        endpoints have been stable and `window` is --offload-after, both in seconds (used while
        ESTABLISHING). The manager words ESTABLISHED itself: that text names the kernels."""
        if self.phase is Phase.ESTABLISHING:
            return f"establishing: {waited:.1f}s of {window:.1f}s"
        if self.phase is Phase.DEMOTED:
            return "demoted: " + "; ".join(f.text() for f in self.faults)
        if self.phase is Phase.PINNED:
            return f"pinned by annotation {DATAPATH_ANNOTATION}: userspace"
        return str(self.phase.value)  # "established", "removed"


ESTABLISHING = Reason(Phase.ESTABLISHING)
ESTABLISHED = Reason(Phase.ESTABLISHED)
PINNED = Reason(Phase.PINNED)
REMOVED = Reason(Phase.REMOVED)
