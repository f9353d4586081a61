"""`make test-fast`, run as a developer runs it: the pure and in-memory tiers pass in under 30 s and
import no torch (tests/torch_guard.py fails the run under BATCHGATE_FAST_TIER=1 if they do)."""

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


@pytest.mark.alone  # timed: `make test` runs it by itself, before the passes that run side by side
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


@pytest.mark.parametrize("workers", [["-n", "2"], ["-p", "no:xdist"]])
@pytest.mark.parametrize("folder", ["unit", "contract"])
def test_the_guard_fails_a_run_that_imports_torch_with_and_without_xdist(tmp_path: Path, workers: list[str],
                                                                         folder: str):
    """The guard itself (`tests/torch_guard.py`): a stand-in `torch` module imported by one test, in either folder of
    the tier, fails the run, under pytest-xdist (whose workers' session status never reaches the controller) as
    without it, and names the test."""
    (tmp_path / "stand_in").mkdir()
    (tmp_path / "stand_in" / "torch.py").write_text("")
    for name in ("unit", "contract"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"test_clean_{name}.py").write_text("def test_clean():\n    pass\n")
    (tmp_path / folder / "test_b.py").write_text("def test_imports_it():\n    import torch  # noqa: F401\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(BATCHGATE_FAST_TIER="1", PYTHONPATH=os.pathsep.join([str(tmp_path / "stand_in"), str(ROOT)]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.torch_guard",
                          *workers, "unit", "contract"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    assert f"the fast tier imported torch (first seen running {folder}/test_b.py::test_imports_it)" in text, \
        text[-3000:]


def test_the_test_tree_takes_in_every_hook_of_the_guard():
    """The guard above is tested as a plugin; tests/conftest.py is what wires it into every run."""
    import tests.conftest as wiring
    import tests.torch_guard as guard

    hooks = [name for name in vars(guard) if name.startswith("pytest_")]
    assert hooks and all(getattr(wiring, name, None) is getattr(guard, name) for name in hooks), hooks
