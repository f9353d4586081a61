"""Print every fault scenario's ledger figures at the end of the run (and write them as JSON)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.faults.harness import FIGURES


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    if not FIGURES:
        return
    tr = terminalreporter
    tr.section("fault-injection ledger")
    cols = ["scenario", "accepted", "terminal", "lost", "visible_duplicates", "re_executed", "recovery_s"]
    tr.write_line(" | ".join(f"{c:>18}" if i else f"{c:<46}" for i, c in enumerate(cols)))
    for row in FIGURES:
        tr.write_line(" | ".join(f"{row.get(c, ''):>18}" if i else f"{row.get(c, ''):<46}" for i, c in enumerate(cols)))
        extra = {k: v for k, v in row.items() if k not in cols}
        if extra:
            tr.write_line(f"    {extra}")
    out = os.environ.get("BATCHGATE_FAULTS_REPORT")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(FIGURES, indent=2))
