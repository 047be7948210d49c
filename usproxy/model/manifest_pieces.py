"""Manifest pieces: a manifest's text cut into its documents and the items of its Lists.

A file of 10,000 Services is one `kind: List` document (as `kubectl get -o yaml` prints it) or
thousands of `---` documents. Cut into pieces, it is parsed a piece at a time (no node tree of the
whole file is ever built) and, when it is rewritten, only the pieces whose text changed are parsed
again (ManifestParser in manifest.py keeps the last version's pieces).

Cutting reads lines only, never YAML: a document starts at a `---` line (a marker alone on its
line); in a document whose top-level mapping has an `items:` key at column 0, or which is itself a
sequence at column 0, an item starts at each `- ` at column 0 until the first other line at
column 0. What is left of a List document (`apiVersion`, `kind`, `metadata`) is its skeleton,
parsed on its own. A cut is a guess that parsing confirms: each item piece must parse to a
sequence of exactly one entry, the skeleton to a `*List` mapping without items, else the caller
parses the whole text as one (so a `- ` line inside a multi-line quoted string costs speed, never
correctness). Texts with directives (`%`) or document end markers (`...`), and JSON texts, are not
cut.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

# Each pattern matches the newline before a line (the text is searched with one newline put in
# front), so re finds its literal first character fast instead of trying every position.
_NOT_CUT = re.compile(r"\n(?:%|\.\.\.|---(?![ ]*(?:\n|\Z)))")  # directives, end markers, `--- value`
_MARKER = re.compile(r"\n---[ ]*(?=\n|\Z)")
_ITEMS = re.compile(r"\nitems:[ ]*(?=\n|\Z)")
_CONTENT = re.compile(r"\n[^\s#]")  # a line with content at column 0
_OTHER = re.compile(r"\n[^\s#-]")  # a line at column 0 that is not an item, a comment or blank
_ENTRY = re.compile(r"\n-(?= |\n|\Z)")


@dataclass(frozen=True, slots=True)
class DocumentCut:
    """One document: `index` as PyYAML numbers them; `span` where it is in the text; `skeleton`
    the text of a List without its items (None for a document that is a sequence, or that is not
    cut); `items` where each item (a `- ` entry at column 0) starts, and where the last one ends
    (None: the document is one piece). Spans, not texts: a piece already parsed is never copied."""

    index: int
    span: tuple[int, int]
    skeleton: str | None
    items: list[int] | None

    def item_spans(self) -> Iterator[tuple[int, int]]:
        assert self.items is not None
        return zip(self.items, self.items[1:])


class _Lines:
    """`text` with a newline in front, searched by line: a match at position p of the padded
    text is the line that starts at position p of `text`."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.padded = "\n" + text

    def find(self, pattern: re.Pattern[str], start: int, end: int) -> int:
        """The first line in [start, end) that `pattern` matches, or -1."""
        m = pattern.search(self.padded, start, end + 1)
        return m.start() if m is not None else -1

    def starts(self, pattern: re.Pattern[str], start: int, end: int) -> list[int]:
        return [m.start() for m in pattern.finditer(self.padded, start, end + 1)]

    def is_at(self, pattern: re.Pattern[str], pos: int) -> bool:
        return pattern.match(self.padded, pos) is not None


def cut(text: str) -> list[DocumentCut] | None:
    """The documents of `text` and the items of its Lists; None when the text is not cut."""
    if text.lstrip().startswith(("{", "[")):
        return None
    lines = _Lines(text)
    if lines.find(_NOT_CUT, 0, len(text)) >= 0:
        return None
    bounds = [0]
    for m in _MARKER.finditer(lines.padded):
        bounds += [m.start(), min(m.end(), len(text))]  # the next document starts after the newline
    bounds.append(len(text))
    out: list[DocumentCut] = []
    for n in range(0, len(bounds), 2):
        start, end = bounds[n], bounds[n + 1]
        if n == 0 and lines.find(_CONTENT, start, end) < 0:
            continue  # comments before the first `---` make no document
        out.append(_document(len(out), lines, start, end))
    return out


def _document(index: int, lines: _Lines, start: int, end: int) -> DocumentCut:
    text = lines.text
    doc = (start, end)
    first = lines.find(_CONTENT, start, end)
    if first >= 0 and lines.is_at(_ENTRY, first):  # the document is a sequence
        return DocumentCut(index, doc, None, _items(lines, first, end))
    at = lines.find(_ITEMS, start, end)
    if at < 0:
        return DocumentCut(index, doc, None, None)
    region = text.find("\n", at, end) + 1 or end  # the line after `items:`
    other = lines.find(_OTHER, region, end)
    region_end = other if other >= 0 else end
    first_item = lines.find(_CONTENT, region, region_end)
    if first_item < 0 or not lines.is_at(_ENTRY, first_item):
        return DocumentCut(index, doc, None, None)  # `items:` without a block sequence at column 0
    items = _items(lines, first_item, region_end, checked=True)
    if items is None:
        return DocumentCut(index, doc, None, None)
    return DocumentCut(index, doc, text[start:region] + text[region_end:end], items)


def _items(lines: _Lines, start: int, end: int, checked: bool = False) -> list[int] | None:
    """Where the entries from `start` (an entry) to `end` start, then `end`; None when a line at
    column 0 other than an entry or a comment lies between them (not a block sequence at column 0;
    `checked`: the caller ended the region at the first such line)."""
    if not checked and lines.find(_OTHER, start, end) >= 0:
        return None
    starts = lines.starts(_ENTRY, start, end)
    starts.append(end)
    return starts
