"""The ipsets of the IPVS datapath, written with `ipset restore` and read with `ipset save`.

kube-proxy's 17 sets (rules.SETS) per family, and one of usproxy's own per family, USPROXY-IPVS
(USPROXY-6-IPVS): a hash:ip,port with the comment extension holding one entry per virtual server
the datapath installed, commented with its ServicePortName. IPVS services carry no name, so this
set is how a restarted agent knows which virtual servers are its own and whose (an IPVS service
not in it is another program's and is never touched), and it lives in the kernel with them.
Entries are added before their virtual server is created and deleted after it is gone.

`ipset restore` takes one batch per sync (kube-proxy runs one `ipset add` per entry; the sets end
the same). Every line is made with -exist semantics (`ipset -exist restore`): a create of an
existing set with the same type, an add of a present entry and a del of an absent one are no-ops.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from usproxy.model.types import Family
from usproxy.offload.ipvs.rules import SETS

NAMES_SET = "USPROXY-IPVS"  # usproxy's own: every virtual server it installed, named
NAMES_COMMENT = re.compile(r'^(\S+) comment "(.*)"$')


def names_set(family: Family) -> str:
    return NAMES_SET if family == 4 else "USPROXY-6-IPVS"


def owned(family: Family) -> tuple[str, ...]:
    """Every set the datapath owns in `family`, kube-proxy's in its order, then usproxy's."""
    return (*(s.named(family) for s in SETS), names_set(family))


def create_lines(family: Family) -> list[str]:
    """`create` of every set (a no-op under -exist where it is there already)."""
    inet = "inet" if family == 4 else "inet6"
    return [*(f"create {s.named(family)} {s.type} {s.header(family)}" for s in SETS),
            f"create {names_set(family)} hash:ip,port family {inet} hashsize 1024 maxelem 65536 comment"]


def entry_lines(verb: str, family: Family, entries: Mapping[str, Iterable[str]]) -> list[str]:
    """`add`/`del` lines; `entries` by the set's name in `family` (NAMES_SET for usproxy's)."""
    out = []
    for name, members in entries.items():
        real = names_set(family) if name == NAMES_SET else name
        out += [f"{verb} {real} {m}" for m in members]
    return out


def named_entry(key: str, spn: str) -> str:
    """An entry of usproxy's set: "ip,proto:port" and the ServicePortName in its comment."""
    return f'{key} comment "{spn}"'


@dataclass
class SavedSet:
    type: str
    header: str
    members: set[str] = field(default_factory=set)


def parse_save(text: str) -> dict[str, SavedSet]:
    """`ipset save` -> {name: SavedSet}; members as written after the set name."""
    out: dict[str, SavedSet] = {}
    for line in text.splitlines():
        words = line.split(" ", 3)
        if words[0] == "create" and len(words) >= 3:
            out[words[1]] = SavedSet(words[2], words[3] if len(words) > 3 else "")
        elif words[0] == "add" and len(words) >= 3 and words[1] in out:
            out[words[1]].members.add(line.split(" ", 2)[2])
    return out


def names(saved: Mapping[str, SavedSet], family: Family) -> dict[str, str]:
    """usproxy's set: {"ip,proto:port": ServicePortName text}."""
    out = {}
    for m in saved.get(names_set(family), SavedSet("", "")).members:
        found = NAMES_COMMENT.match(m)
        if found:
            out[found.group(1)] = found.group(2)
    return out


def normal(header: str) -> str:
    """A create line's options without what depends on the ipset version and the kernel
    (bucketsize, initval), as `ipset save` prints them."""
    return re.sub(r" (bucketsize \d+|initval 0x[0-9a-f]+)", "", header).strip()
