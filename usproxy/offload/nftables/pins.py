"""Pins: the client addresses in an affinity set, read from `nft list set` and written again.

When a ServicePort's ClientIP timeout changes, its existing pins are re-added under the new timeout
(field case C15: a new timeout is in force at once, for existing pins too). Pure (no I/O).
"""

from __future__ import annotations

import re
from typing import NamedTuple


class Pin(NamedTuple):
    """One client address in an endpoint's affinity set: its timeout and what is left of it (s)."""

    client: str
    timeout: float
    expires: float


_DURATION = re.compile(r"(\d+)(ms|d|h|m|s)")
_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_PIN = re.compile(r"([0-9a-fA-F:.]+) timeout (\S+?) expires (\S+?)(?=[,\s}]|$)")


def _duration(text: str) -> float:
    return sum(int(n) * _SECONDS[u] for n, u in _DURATION.findall(text))


def parse_pins(listing: str) -> list[Pin]:
    """The elements of `nft list set` text output ("10.0.0.1 timeout 5s expires 4s992ms")."""
    return [Pin(m.group(1), _duration(m.group(2)), _duration(m.group(3))) for m in _PIN.finditer(listing)]


def retimed(pin: Pin, old: int, new: int) -> str:
    """The element written again under the `new` timeout (seconds), keeping the time since the
    client's last connection. That time is read against the `old` rule timeout (the rule's
    `update` refreshes a pin to it, whatever timeout the element was first written with), and
    the result is capped at `new`; a pin already past `new` expires at once (1 ms: a delete
    would fail the transaction if the pin expired meanwhile). Written with `add`, which updates
    an existing element's timeout and expiry (Linux 6.10+; older kernels keep the old timer)."""
    elapsed = max(0.0, old - pin.expires)
    left = min(float(new), new - elapsed)
    return f"{pin.client} timeout {new}s expires {max(1, int(left * 1000))}ms"
