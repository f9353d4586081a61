"""The overload benchmark's judge of admission's mistakes (scripts/benchlib.misjudged): a judge that could not
count a mistake would let the benchmark report 0% for any estimate."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import benchlib as bl


def out(idx: int, *, http: int, status: str, at: float, latency_s: float = 1.0, prompt: int = 32, new: int = 64,
        timeout: float = 60.0, eta_s: float | None = None, cls: str = "long") -> bl.Outcome:
    job = bl.Job(idx, cls, [5] * prompt, new, timeout_s=timeout)
    return bl.Outcome(job, http=http, status=status, submitted=at, done=at + latency_s,
                      eta_ms=None if eta_s is None else eta_s * 1000)


def test_a_refusal_next_to_a_longer_request_that_finished_in_time_is_a_mistake():
    outs = [out(0, http=429, status="deadline_infeasible", at=10.0, prompt=32, new=64),
            out(1, http=202, status="succeeded", at=11.0, latency_s=30.0, prompt=40, new=64)]
    got = bl.misjudged(outs)
    assert got["refused_deadline"] == 1 and got["refused_feasible"] == 1
    assert got["refused_feasible_share"] == 0.5


def test_a_refusal_is_justified_when_no_comparable_neighbour_finished_in_time():
    outs = [out(0, http=429, status="deadline_infeasible", at=10.0, prompt=32, new=64),
            out(1, http=202, status="succeeded", at=11.0, latency_s=30.0, prompt=40, new=32),  # shorter output
            out(2, http=202, status="succeeded", at=11.0, latency_s=30.0, prompt=16, new=64),  # shorter prompt
            out(3, http=202, status="succeeded", at=20.0, latency_s=30.0, prompt=40, new=64),  # too far apart
            out(4, http=202, status="succeeded", at=9.0, latency_s=61.0, prompt=40, new=64)]  # past the timeout
    assert bl.misjudged(outs)["refused_feasible"] == 0


def test_backlog_refusals_are_not_deadline_misjudgements_and_accepted_expiries_are_counted():
    outs = [out(0, http=429, status="backlog_full", at=10.0),
            out(1, http=202, status="succeeded", at=10.0, latency_s=5.0, prompt=64, new=128),
            out(2, http=202, status="expired", at=10.5),
            out(3, http=200, status="expired", at=10.6),
            out(4, http=202, status="succeeded", at=10.7, latency_s=2.0, eta_s=1.0, cls="short"),
            out(5, http=202, status="succeeded", at=10.8, latency_s=4.0, eta_s=1.0, cls="short")]
    got = bl.misjudged(outs)
    assert got["refused_deadline"] == 0 and got["refused_feasible"] == 0
    assert got["accepted_then_expired"] == 2 and got["accepted_then_expired_share"] == 2 / 6
    assert got["finish_vs_eta"]["short"]["n"] == 2 and got["finish_vs_eta"]["short"]["p10"] == 2.0
    assert "long" not in got["finish_vs_eta"]  # no estimate to compare with
