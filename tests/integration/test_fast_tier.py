"""`make test-fast`, run as a developer runs it: the pure and in-memory tiers pass in under 30 s and
import no torch (tests/unit/conftest.py fails the session under BATCHGATE_FAST_TIER=1 if they do)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 30.0


def test_make_test_fast_passes_in_under_30_s_without_torch():
    make = shutil.which("make")
    assert make, "`make` is needed to run the test-fast target"
    venv, bin_dir = Path(sys.prefix), Path(sys.executable).parent
    # this interpreter's environment, already installed: `-o` keeps make from rebuilding it
    cmd = [make, "-s", "-o", str(venv / ".installed"), "test-fast", f"VENV={venv}", f"BIN={bin_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    start = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - start
    text = out.stdout + out.stderr
    assert "imported torch" not in text, text[-3000:]
    assert out.returncode == 0, text[-3000:]
    assert " passed" in text, text[-3000:]
    assert wall < BUDGET_S, f"make test-fast took {wall:.1f} s (budget {BUDGET_S:.0f} s)"
