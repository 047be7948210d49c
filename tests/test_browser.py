"""tests/browser.py itself: a Browser started by a fresh process answers. There the first pipe is
fds 3 and 4, the very numbers chromium reads and writes, and a shell redirect `3<&3 ... 3<&-`
closed the command pipe it had just handed over: chromium never got a command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns import Topology

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[1]
FRESH = """
import sys
from tests.browser import Browser
b = Browser(sys.argv[1])
try:
    print(b.eval("6 * 7"), flush=True)
finally:
    b.close()
"""


def test_a_browser_started_by_a_fresh_process_answers(topology: Topology) -> None:
    run = subprocess.run([sys.executable, "-c", FRESH, topology.node], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "42", run.stderr[-2000:]
