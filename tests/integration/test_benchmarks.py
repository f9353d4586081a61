"""The benchmark scripts run and write the JSON keys the checks read (figures are not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow]


def test_engine_benchmark_smoke(tmp_path, model_cache):
    out = tmp_path / "engine.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_engine.py", "--requests", "4", "--reps", "1", "--model-cache",
         str(model_cache), "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["methods"]) == {"batch1", "static", "hf_continuous", "batchgate"}
    for row in report["methods"].values():
        assert row["tokens_per_s"] > 0 and row["wall_s"] > 0
    for key in ("ratio_vs_static", "ratio_vs_batch1", "ratio_vs_hf_continuous"):
        assert report[key] > 0
    assert report["outputs_match_reference"] is True
    assert "ratio_vs_hf_continuous" in proc.stdout  # the human table
