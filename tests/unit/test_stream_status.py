"""Which status an event stream announces, and when (`shared.events._status_now`): pure, every case."""

from __future__ import annotations

import pytest

from shared.events import _status_now
from shared.records import StoredRecord
from shared.states import Status


def record(state: Status) -> StoredRecord:
    return StoredRecord(id="req_x", state=state, meta=None, result=None, started_ms=None)


@pytest.mark.parametrize(("sent", "tokens", "fresh", "expected"), [
    (None, False, Status.QUEUED, "queued"),  # the opening status
    (None, False, Status.RUNNING, "running"),
    (None, True, Status.QUEUED, "running"),  # tokens came before the record said so: it runs
    (None, True, None, "running"),
    (None, True, Status.SUCCEEDED, "running"),  # joined late: running, the deltas, then done
    ("queued", True, None, "running"),
    ("queued", False, Status.RUNNING, "running"),
    ("queued", False, Status.QUEUED, None),  # never twice
    ("running", True, Status.RUNNING, None),
    ("running", False, Status.QUEUED, None),  # never backwards (a hand-back)
    (None, False, None, None),  # nothing read: nothing to say
    (None, False, Status.SUCCEEDED, None),  # a terminal state is `done`'s to announce
    ("queued", False, Status.CANCELLED, None),
    ("succeeded", True, Status.SUCCEEDED, None),  # a finished request's replay (its status taken, not announced):
    ("cancelled", True, None, None),  # the deltas it replays are not "running" again
])
def test_the_status_moves_forward_once_before_the_deltas(sent, tokens, fresh, expected):
    assert _status_now(sent, tokens, None if fresh is None else record(fresh)) == expected
