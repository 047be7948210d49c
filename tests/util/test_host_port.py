"""util.host_port: one reading of HOST:PORT for the addresses `run` binds and the one `status`,
`flows` and `explain --live` dial."""

from __future__ import annotations

import pytest

from usproxy.util import host_port


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:10249", ("127.0.0.1", 10249)),
    ("localhost:1", ("localhost", 1)),
    ("[::1]:0", ("::1", 0)),
    ("node-1.example.org:65535", ("node-1.example.org", 65535)),
    ("1.example:80", ("1.example", 80)),  # digits and dots with a letter: a name
])
def test_a_host_and_port_are_split(text: str, expected: tuple[str, int]) -> None:
    assert host_port.split(text) == expected


@pytest.mark.parametrize("text", ["127.0.0.1:notaport", "127.0.0.1:99999", "nocolon", "a b:80", "[zz]:80",
                                  "127.0.0.1:", ":80", "[::1:80", "host:-1", "127.0.0.1:²", "127.0.0.1:٣",
                                  "300.1.1.1:99", "10.0.0:80"])
def test_anything_else_is_refused_saying_what_was_expected(text: str) -> None:
    with pytest.raises(ValueError) as err:
        host_port.split(text)
    assert str(err.value) == f"{host_port.EXPECTED}, got {text!r}"


def test_a_bind_address_without_a_host_is_every_ipv4_address() -> None:
    assert host_port.bind_address(":10256") == ("0.0.0.0", 10256)
    assert host_port.bind_address("[::]:10256") == ("::", 10256)
    with pytest.raises(ValueError):
        host_port.bind_address("a b:10256")
