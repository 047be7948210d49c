"""Maglev lookup tables (Eisenbud et al., NSDI 2016), as Cilium's pkg/maglev builds them.

Each endpoint gets a permutation of the M table positions from two hashes of its name (offset and
skip); endpoints take turns claiming their next free position until the table is full. Every
endpoint owns about M/N positions, and removing one endpoint moves only positions it owned (plus a
few), so sockets hashed to the others keep their endpoint. The table is deterministic in the set of
endpoint names (order does not matter), so a restarted agent computes the same table it left in the
kernel and rewrites nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def _hash(prefix: bytes, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(prefix + name.encode(), digest_size=8).digest(), "little")


def permutation_params(name: str, m: int) -> tuple[int, int]:
    """(offset, skip) of one endpoint; skip is in 1..m-1, so with m prime it visits every slot."""
    return _hash(b"offset:", name) % m, _hash(b"skip:", name) % (m - 1) + 1


def table(names: Sequence[str], m: int) -> list[int]:
    """A table of m entries, each the index (into sorted(names)) of the endpoint owning it.

    Empty when there are no names. `m` must be prime and larger than len(names).
    """
    ordered = sorted(set(names))
    if not ordered:
        return []
    params = [permutation_params(n, m) for n in ordered]
    nxt = [0] * len(ordered)
    out = [-1] * m
    filled = 0
    while True:
        for i, (offset, skip) in enumerate(params):
            pos = (offset + nxt[i] * skip) % m
            while out[pos] >= 0:
                nxt[i] += 1
                pos = (offset + nxt[i] * skip) % m
            out[pos] = i
            nxt[i] += 1
            filled += 1
            if filled == m:
                return out
