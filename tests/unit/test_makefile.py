"""`make up`'s first run shows pip's progress (it is minutes, mostly torch), `make test` keeps pip quiet,
and the default installs torch from pip's usual index (no index that a machine may not reach)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _plan(target: str, tmp_path: Path) -> list[str]:
    out = subprocess.run(["make", "-n", f"VENV={tmp_path / 'venv'}", target], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={"PATH": "/usr/bin:/bin"}).stdout
    return [line for line in out.splitlines() if "pip install" in line and "--upgrade pip" not in line]


def test_make_up_shows_pip_progress_and_make_test_is_quiet(tmp_path):
    up = _plan("up", tmp_path)
    assert len(up) == 2 and not any(" -q" in line for line in up), up
    assert not any("--index-url" in line for line in up), up  # the default index: pip's own
    test = _plan("test", tmp_path)
    assert len(test) == 2 and all(" -q" in line for line in test), test
