"""gc_pause in a fresh interpreter (the collector's state is the process's): promote_survivors
moves young objects to the oldest generation and leaves nothing frozen, until a heap is frozen
(freeze_heap); from then on the survivors join the frozen heap instead of thawing it (a static
reload promoted its parse's survivors, and unfroze the agent's whole state every time)."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = """
import gc, json
from usproxy.util import gc_pause
out = {}
young = [[i] for i in range(1000)]
gc_pause.promote_survivors()
out["before_freeze"] = gc.get_freeze_count()
gc_pause.freeze_heap()
frozen = gc.get_freeze_count()
later = [[i] for i in range(1000)]
gc_pause.promote_survivors()
out["kept"] = gc.get_freeze_count() >= frozen
out["joined"] = gc.get_freeze_count() - frozen
print(json.dumps(out))
"""


def test_promote_survivors_never_thaws_a_frozen_heap() -> None:
    run = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["before_freeze"] == 0  # nothing frozen yet: promoted, not frozen
    assert out["kept"] is True  # the frozen heap stays frozen
    assert out["joined"] >= 1000  # the later survivors joined it
