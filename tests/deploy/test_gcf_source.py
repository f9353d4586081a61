"""The source directory `gcloud functions deploy` takes (scripts/build_gcf_source.sh): Cloud Functions loads
`main.py` at its root, which must name the entry point, with the dependencies in `requirements.txt`."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_built_source_has_main_py_naming_the_entry_point_and_its_requirements(tmp_path: Path) -> None:
    out = tmp_path / "gcf"
    subprocess.run(["bash", str(REPO / "scripts/build_gcf_source.sh"), str(out)], check=True, capture_output=True)
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert (out / "requirements.txt").read_text().split("\n")[:-1] == deps
    assert not any("torch" in d for d in deps)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(BATCHGATE_REDIS_URL="redis://127.0.0.1:1/0", BATCHGATE_KEY_PREFIX="bgtest-gcf")
    code = "import main, gateway; print(main.batchgate.__name__, gateway.__file__)"
    probe = subprocess.run([sys.executable, "-c", code], cwd=out, env=env, capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    name, where = probe.stdout.split()
    assert name == "batchgate" and Path(where).is_relative_to(out)  # the copy in the source, not the checkout
