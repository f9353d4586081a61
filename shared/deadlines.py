"""The one answer to "is this request past its deadline, or unable to meet it". Pure, seconds only.

Every part that decides it calls `cannot_finish`: the submit check (a deadline already past), the
gateway's admission (estimated queue wait and compute), the record store's expiry of a request with no
result (deadline plus grace), the worker's intake (already past), the scheduler (a queued request whose
estimated compute ends too late, a running row whose remaining tokens cannot fit, a batch about to
start), and the wording of an expired result.
"""

from __future__ import annotations


def cannot_finish(deadline: float, now: float, work_s: float = 0.0) -> bool:
    """True when `work_s` more seconds of work starting at `now` would end at or after `deadline`
    (with `work_s` 0: the deadline has passed). All values are seconds on the same clock."""
    return now + work_s >= deadline
