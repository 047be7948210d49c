"""BlockYaml: a fast reader for the block-style YAML that kubectl and YAML emitters print.

PyYAML's C loader still builds a Python node (and two position marks) per scalar, resolves each
tag in Python and constructs the objects in Python: 10,000 Services as kubectl prints them (6 MB,
350,000 lines) took 11 s and 500 MiB at peak. This reader takes the layout such files have line
by line, with no node tree: block mappings and sequences by indentation, one-line scalars (plain,
single- or double-quoted without escapes), `{}` and `[]`, and literal block scalars (`|`, `|-`:
kubectl's last-applied-configuration annotation).

Invariant: for any text it returns a value, that value equals what PyYAML's safe loader returns
for the same text; everything else raises Unsupported, and the caller hands that text to PyYAML
(which also produces the error and its line and column for text that is not YAML). Plain scalars
are resolved by PyYAML's own resolver and SafeConstructor (YAML 1.1: `yes` is True, `0755` is
octal), memoised per text. Unsupported: tabs, carriage returns, comments after content, anchors,
aliases, tags, merge keys, flow collections other than `{}` and `[]`, quoted keys, escapes,
multi-line flow scalars, folded block scalars, directives and document markers, `- -` nesting.
"""

from __future__ import annotations

import bisect
import re
from typing import Any

import yaml

_STR = "tag:yaml.org,2002:str"
_CONSTRUCTED = frozenset({"tag:yaml.org,2002:null", "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int",
                          "tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp"})
# a plain scalar cannot start with these (YAML's c-indicator), nor with "-", "?", ":" followed by a space
_INDICATORS = frozenset("#,[]{}&*!|>'\"%@`")
# the first characters PyYAML's implicit resolvers look at (a plain scalar starting otherwise is a
# string), and a dotted quad, which no YAML 1.1 pattern (int, float, timestamp) matches
_RESOLVED_FIRST = frozenset(k for k in yaml.resolver.Resolver.yaml_implicit_resolvers if k)
_FIRST_DECIDES = None not in yaml.resolver.Resolver.yaml_implicit_resolvers  # no resolver for any first character
_DOTTED_QUAD = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+")
_MEMO_MAX = 20_000  # resolved scalars kept (a short string and its value each), then forgotten


class Unsupported(Exception):
    """The text uses YAML this reader does not take; PyYAML must read it."""


class _Scalars:
    """Plain scalar text -> value, as PyYAML's resolver and SafeConstructor make it."""

    def __init__(self) -> None:
        self.resolve: Any = yaml.resolver.Resolver().resolve  # untyped in PyYAML's stubs
        self.constructor = yaml.constructor.SafeConstructor()
        self.memo: dict[str, Any] = {}

    def plain(self, text: str) -> Any:
        memo = self.memo
        if text in memo:
            return memo[text]
        if _FIRST_DECIDES and (text[0] not in _RESOLVED_FIRST or _DOTTED_QUAD.fullmatch(text)):
            tag = _STR  # no implicit resolver starts with that character; an IPv4 address is text
        else:
            tag = self.resolve(yaml.ScalarNode, text, (True, False))
        if tag == _STR:
            value: Any = text
        elif tag in _CONSTRUCTED:
            value = self.constructor.yaml_constructors[tag](self.constructor, yaml.ScalarNode(tag, text))
        else:  # merge "<<", value "=", or a tag PyYAML has no safe constructor for
            raise Unsupported(f"plain scalar {text!r} resolves to {tag}")
        if len(memo) >= _MEMO_MAX:
            memo.clear()
        memo[text] = value
        return value


_SCALARS = _Scalars()

# One line, read once: (col, dash, inner, key, value, kind). col: the column of its first character;
# dash: it starts with "- ", and its content starts at column `inner` (col otherwise); key: NO_KEY
# when the line holds no "key:"; kind: "" an inline value in `value`, "open" nothing after the
# colon (a nested block or null), "|" or "|-" a literal block scalar follows.
Line = tuple[int, bool, int, Any, Any, str]
NO_KEY: Any = object()  # the key of a line that holds none ("- scalar"); a null key is None
_NO_LINE = (-1, False, -1, NO_KEY, None, "")
_NON_PRINTABLE = re.compile("[^\x0a\x20-\x7e\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _quoted(text: str) -> str | None:
    """The value of a one-line quoted scalar without escapes, None when `text` is not one."""
    q = text[0]
    if len(text) < 2 or text[-1] != q:
        return None
    inner = text[1:-1]
    if q == '"':
        return None if ('"' in inner or "\\" in inner) else inner
    if "'" in inner.replace("''", ""):
        return None
    return inner.replace("''", "'")


def _scalar(text: str) -> Any:
    """An inline value (after "key: " or "- "), already stripped of surrounding spaces."""
    first = text[0]
    if first in "\"'":
        value = _quoted(text)
        if value is None:
            raise Unsupported("quoted scalar with escapes, a comment, or on several lines")
        return value
    if text == "{}":
        return {}
    if text == "[]":
        return []
    if first in _INDICATORS or (first in "-?:" and (len(text) == 1 or text[1] == " ")):
        raise Unsupported(f"value starting with {first!r}")
    if ": " in text or text.endswith(":") or " #" in text:
        raise Unsupported("colon or comment inside a plain scalar")
    return _SCALARS.plain(text)


def _key(text: str) -> Any:
    if not text:
        raise Unsupported("an empty key")
    first = text[0]
    if first in _INDICATORS or first in "-?:" or text.endswith(" ") or " #" in text:
        raise Unsupported(f"key {text!r}")
    return _SCALARS.plain(text)


def read_line(line: str) -> Line | None:
    """One line's shape, None for a blank or comment line. Raises Unsupported."""
    body = line.lstrip(" ")
    if not body or body[0] == "#":
        return None
    col = len(line) - len(body)
    if col == 0 and body.startswith(("---", "...")):
        raise Unsupported("document marker")
    dash = body[0] == "-" and (len(body) == 1 or body[1] == " ")
    inner = col
    if dash:
        content = body[1:].lstrip(" ")
        if not content or content[0] == "#":
            raise Unsupported("sequence entry with its value on the next line")
        inner = len(line) - len(content)
        body = content
        if body[0] == "-" and (len(body) == 1 or body[1] == " "):
            raise Unsupported("nested sequence on one line")
    body = body.rstrip(" ")
    at = body.find(": ")
    if at < 0 and body.endswith(":"):
        at = len(body) - 1
    if at < 0:
        return col, dash, inner, NO_KEY, _scalar(body), ""
    key = _key(body[:at])
    rest = body[at + 1:].lstrip(" ")
    if not rest:
        return col, dash, inner, key, None, "open"
    if rest in ("|", "|-"):
        return col, dash, inner, key, None, rest
    return col, dash, inner, key, _scalar(rest), ""


_END: Line = (-1, False, -1, NO_KEY, None, "")  # after the last line
_BAD: Line = (-2, False, -2, NO_KEY, None, "")  # a line this reader does not take: ends every block
_ASCII_TEXT = bytes(range(0x20, 0x7f)) + b"\n"


def _shape(line: str) -> Line | None:
    """read_line, with a line it does not take marked _BAD: it may be the text of a block
    scalar, which is never shaped; any other use of it stops the reader."""
    try:
        return read_line(line)
    except Unsupported:
        return _BAD


def _printable(text: str) -> bool:
    """Whether PyYAML's reader takes every character and sees the same lines (no tab, CR, NEL,
    LS/PS or control character, no byte-order mark)."""
    if text.isascii():
        return not text.encode("ascii").translate(None, _ASCII_TEXT)
    return not text.startswith("\ufeff") and _NON_PRINTABLE.search(text) is None


class BlockYaml:
    """Reads one text (one YAML document without markers); `load()` returns its value. `memo`
    maps a line's text to its shape (the lines of a manifest repeat: share it across the texts
    of one file, then drop it)."""

    __slots__ = ("raw", "rows", "lines", "p")

    def __init__(self, text: str, memo: dict[str, Line | None] | None = None) -> None:
        if not _printable(text):
            raise Unsupported("a tab, carriage return, byte-order mark or non-printable character")
        memo = memo if memo is not None else {}
        self.raw = raw = text.split("\n")
        for line in set(raw).difference(memo):
            memo[line] = _shape(line)
        shapes = list(map(memo.__getitem__, raw))
        self.rows = [i for i, shape in enumerate(shapes) if shape is not None]  # raw index of each line
        self.lines: list[Line] = [shapes[i] for i in self.rows]  # type: ignore[misc]
        self.lines.append(_END)
        self.p = 0  # the current line

    def load(self) -> Any:
        line = self.lines[0]
        if line[0] < 0:
            if line is _BAD:
                raise Unsupported("a line this reader does not take")
            return None
        if line[1]:
            value: Any = self._sequence(line[0])
        elif line[3] is not NO_KEY:
            value = self._mapping(line[2])
        else:
            raise Unsupported("a document that is a single scalar")
        if self.lines[self.p] is not _END:
            raise Unsupported("lines left after the top-level node")
        return value

    def _sequence(self, col: int) -> list[Any]:
        out: list[Any] = []
        lines, p = self.lines, self.p
        line = lines[p]
        while line[0] == col and line[1]:
            if line[3] is NO_KEY:  # "- scalar"
                out.append(line[4])
                p += 1
                line = lines[p]
                if line[0] > col:
                    raise Unsupported("a multi-line plain scalar")
            else:
                self.p = p
                out.append(self._mapping(line[2]))
                p = self.p
                line = lines[p]
        if line[0] > col:
            raise Unsupported("a line indented under a sequence entry")
        self.p = p  # the end, or a key of the enclosing mapping at this column
        return out

    def _mapping(self, col: int) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        lines, p = self.lines, self.p
        line = lines[p]  # the first key's line (it may start with the dash of a sequence entry)
        while True:
            kind = line[5]
            if kind == "":
                out[line[3]] = line[4]
                p += 1
                line = lines[p]
                if line[0] > col:
                    raise Unsupported("a multi-line plain scalar")
            else:
                key = line[3]
                if kind == "open":
                    self.p = p + 1
                    out[key] = self._nested(col)
                else:  # its lines are raw text, never read as YAML lines
                    self.p = p
                    out[key] = self._literal(col, self.rows[p] + 1, kind == "|-")
                p = self.p
                line = lines[p]
            if line[0] != col:
                if line[0] > col:
                    raise Unsupported("unexpected indentation in a mapping")
                self.p = p  # the end, or the enclosing sequence's next entry
                return out
            if line[1] or line[3] is NO_KEY:
                raise Unsupported("a line in a mapping that is not a key")

    def _nested(self, col: int) -> Any:
        """The value of "key:" at `col`: a block below it, a sequence at the same column
        (kubectl's compact form), or null."""
        line = self.lines[self.p]
        if line[0] > col:
            if line[1]:
                return self._sequence(line[0])
            if line[3] is NO_KEY:
                raise Unsupported("a plain scalar on the line after its key")
            return self._mapping(line[0])
        if line[0] == col and line[1]:
            return self._sequence(col)
        return None

    def _literal(self, col: int, start: int, strip: bool) -> str:
        """A `|` (clip) or `|-` (strip) block scalar under a key at `col`: the raw lines from
        `start` more indented than the key, the first non-blank one setting the indentation."""
        raw = self.raw
        end = start
        indent = 0
        last = -1  # raw index of the last non-blank line of the block
        while end < len(raw):
            text = raw[end]
            body = text.lstrip(" ")
            if body:
                here = len(text) - len(body)
                if here <= col:
                    break
                if not indent:
                    indent = here
                elif here < indent:
                    raise Unsupported("a block scalar line less indented than its first")
                last = end
            elif len(text) > col:
                raise Unsupported("a block scalar with a line of only spaces")
            end += 1
        if last < 0:
            raise Unsupported("an empty block scalar")
        self.p = bisect.bisect_left(self.rows, end)
        text = "\n".join(t[indent:] for t in raw[start:last + 1])
        # clip keeps the last line's break, when it has one (the text may end without it)
        return text if strip or last == len(raw) - 1 else text + "\n"


def load(text: str, memo: dict[str, Line | None] | None = None) -> Any:
    """The value of one YAML document's text. Raises Unsupported (then read it with PyYAML)."""
    return BlockYaml(text, memo).load()
