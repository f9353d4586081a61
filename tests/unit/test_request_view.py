"""A request's view (`shared.views`), as GET answers it and as its webhooks carry it: what its `callback` says of
itself when it has a delivery per event (`summary`: `delivered` only when every one was, so the obvious check,
`callback.status == "delivered"`, never reads a failed `completed` webhook as delivered), and one `started_at`."""

from __future__ import annotations

import itertools

import pytest

from shared.messages import Callback, CallbackState
from shared.views import callback_view, summary

STATUSES = ("pending", "delivered", "failed", "dead", "disabled")
NOT_ARRIVED = {"failed", "dead", "disabled"}


def state(event: str, status: str) -> CallbackState:
    return CallbackState(f"d-{event}", event, "https://hooks.example/x", status, attempts=1)


@pytest.mark.parametrize(("started", "completed"), list(itertools.product(STATUSES, STATUSES)))
def test_the_callback_is_delivered_only_when_every_delivery_is(started: str, completed: str) -> None:
    shown = summary([state("started", started), state("completed", completed)])
    pair = {started, completed}
    assert (shown.status == "delivered") == (pair == {"delivered"})
    if pair & NOT_ARRIVED:  # a webhook that did not arrive is told first
        assert shown.status in NOT_ARRIVED
    elif "pending" in pair:  # then one on its way
        assert shown.status == "pending"
    if started == completed or (completed in NOT_ARRIVED) or (completed == "pending" and started == "delivered"):
        assert shown.event == "completed"


def test_the_view_shows_the_summary_and_every_delivery() -> None:
    """The case an outside probe met: `started` retried and delivered after `completed` failed with a 400."""
    cb = Callback("https://hooks.example/x", ("started", "completed"))
    started, completed = state("started", "delivered"), state("completed", "failed")
    view = callback_view(cb, started, [started, completed])  # `started` the latest delivery written
    assert view["status"] == "failed" and view["event"] == "completed"
    assert [(d["event"], d["status"]) for d in view["deliveries"]] == [("started", "delivered"),
                                                                       ("completed", "failed")]
    assert callback_view(cb, completed, [completed])["status"] == "failed"  # one event: that delivery
    assert callback_view(cb, None)["status"] == "waiting"  # none queued yet


def test_started_at_is_the_same_in_every_view_and_webhook_of_a_request() -> None:
    """`started_at` is when its worker marked it running (the record's, which the `started` webhook tells, sent while
    it runs): the finished request's view and its `completed` webhook said the result's own start instead, its
    prefill's, a few ms later (an outside probe: 207.514 in the `started` webhook, 207.519 after)."""
    from shared.messages import RequestResult
    from shared.records import StoredRecord
    from shared.states import FinishReason, Status
    from shared.views import record_view
    from tests.fakes import make_request

    meta = make_request("req_started").meta()
    running = StoredRecord("req_started", Status.RUNNING, meta, None, started_ms=1_000_514)
    result = RequestResult(id="req_started", status=Status.SUCCEEDED, output={"text": "x"},
                           finish_reason=FinishReason.LENGTH, started_ms=1_000_519, finished_ms=1_000_600)
    finished = StoredRecord("req_started", Status.SUCCEEDED, meta, result, started_ms=1_000_514)
    assert record_view(running)["started_at"] == record_view(finished)["started_at"] == 1_000.514
    lacking = StoredRecord("req_started", Status.SUCCEEDED, meta, result, started_ms=None)  # a record without it
    assert record_view(lacking)["started_at"] == 1_000.519
