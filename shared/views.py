"""The public shapes of what the API answers, as schema types: a request record (GET /v1/requests/{id},
sync-wait, callbacks), an accepted submit, an error. The views are built from these types and the OpenAPI
document's response schemas are generated from them, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from shared.messages import REPLAYABLE, Callback, CallbackState
from shared.records import StoredRecord
from shared.states import FinishReason, Priority, Status, Task


class ErrorDetail(msgspec.Struct, frozen=True):
    code: str
    message: str
    field: str | UnsetType = UNSET  # the body field a 422 concerns ("params.max_new_tokens")
    lane: str | UnsetType = UNSET  # the lane a 429 concerns


class ErrorBody(msgspec.Struct, frozen=True):
    """Every error: `{"error": {"code", "message", ...}}`."""

    error: ErrorDetail


class DeliveryView(msgspec.Struct, frozen=True):
    event: str
    status: str
    attempts: int
    last_status_code: int | None
    last_error: str | None
    next_attempt_at: float | None
    delivered_at: float | None
    webhook_id: str


class CallbackView(msgspec.Struct, frozen=True):
    url: str
    events: list[str]
    status: str  # "waiting" until a delivery is queued, then the delivery's status
    event: str | UnsetType = UNSET
    attempts: int | UnsetType = UNSET
    last_status_code: int | UnsetType | None = UNSET
    last_error: str | UnsetType | None = UNSET
    next_attempt_at: float | UnsetType | None = UNSET
    delivered_at: float | UnsetType | None = UNSET
    webhook_id: str | UnsetType = UNSET
    # each event's delivery, when the request has more than one; the fields above are the one `summary` picks
    deliveries: list[DeliveryView] | UnsetType = UNSET


class ResultError(msgspec.Struct, frozen=True):
    code: str
    message: str


class RequestView(msgspec.Struct, frozen=True):
    """A request: its state and, once terminal, its result. Times are epoch seconds."""

    id: str
    status: Status
    model: str | UnsetType = UNSET
    task: Task | UnsetType = UNSET
    lane: str | UnsetType = UNSET
    priority: Priority | UnsetType = UNSET
    created_at: float | UnsetType | None = UNSET
    deadline: float | UnsetType | None = UNSET
    started_at: float | None = None
    finished_at: float | None = None
    output: dict[str, Any] | None = None
    finish_reason: FinishReason | None = None
    error: ResultError | None = None
    timings: dict[str, float] = {}
    attempts: int = 0
    callback: CallbackView | UnsetType = UNSET
    links: dict[str, str] = {}


class Accepted(msgspec.Struct, frozen=True):
    """A submit accepted (202): queued, or running when a `?wait=` ran out while it computes."""

    id: str
    status: Literal["queued", "running"]
    model: str
    lane: str
    eta_ms: int | None  # null when no worker reported load recently (see `admission`)
    queue_position: int
    deadline: float
    links: dict[str, str]
    admission: str | UnsetType = UNSET


def links(request_id: str) -> dict[str, str]:
    return {"self": f"/v1/requests/{request_id}"}


def _sec(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000


def _delivery(state: CallbackState) -> DeliveryView:
    return DeliveryView(event=state.event, status=state.status, attempts=state.attempts,
                        last_status_code=state.last_status_code, last_error=state.last_error or None,
                        next_attempt_at=_sec(state.next_attempt_ms), delivered_at=_sec(state.delivered_ms),
                        webhook_id=state.delivery_id)


# which delivery a callback's own fields show: one that did not arrive (failed, dead, disabled) before one on its way,
# that before one delivered; among equals the `completed` webhook's (the one with the result)
_SHOWN_FIRST = {"failed": 2, "dead": 2, "disabled": 2, "pending": 1}


def summary(deliveries: Sequence[CallbackState]) -> CallbackState:
    """The delivery a callback's status is told by: `delivered` only when every event's delivery was (it showed the
    latest delivery: a `started` one retried and delivered after a `completed` one that failed read `delivered`)."""
    return max(deliveries, key=lambda d: (_SHOWN_FIRST.get(d.status, 0), d.event == "completed"))


def _callback(cb: Callback, state: CallbackState | None, deliveries: Sequence[CallbackState] = ()) -> CallbackView:
    if deliveries:
        state = summary(deliveries)
    if state is None:  # nothing to deliver yet (or the delivery is queued)
        return CallbackView(url=cb.url, events=list(cb.events), status="waiting")
    d = _delivery(state)
    return CallbackView(
        url=cb.url, events=list(cb.events), status=d.status, event=d.event, attempts=d.attempts,
        last_status_code=d.last_status_code, last_error=d.last_error, next_attempt_at=d.next_attempt_at,
        delivered_at=d.delivered_at, webhook_id=d.webhook_id,
        deliveries=[_delivery(x) for x in deliveries] if len(deliveries) > 1 else UNSET)


def callback_view(cb: Callback, state: CallbackState | None,
                  deliveries: Sequence[CallbackState] = ()) -> dict[str, Any]:
    return msgspec.to_builtins(_callback(cb, state, deliveries))


def request_view(rec: StoredRecord) -> RequestView:
    meta, result = rec.meta, rec.result
    # when its worker marked it running (the record's, which its `started` webhook told): the same time in every
    # view and webhook of the request (the result's own, a few ms later at its prefill, only where the record lacks it)
    started = rec.started_ms or (result.started_ms if result else None)
    callback: CallbackView | UnsetType = UNSET
    out_links = links(rec.id)
    if meta is not None and meta.callback is not None:
        callback = _callback(meta.callback, rec.callback, rec.deliveries)
        if any(d.status in REPLAYABLE for d in rec.deliveries):
            out_links["replay_callback"] = f"/v1/requests/{rec.id}/callback:replay"
    return RequestView(
        id=rec.id, status=rec.state,
        model=meta.model if meta else UNSET, task=meta.task if meta else UNSET,
        lane=meta.lane if meta else UNSET, priority=meta.priority if meta else UNSET,
        created_at=_sec(meta.created_ms) if meta else UNSET, deadline=_sec(meta.deadline_ms) if meta else UNSET,
        started_at=_sec(started), finished_at=_sec(result.finished_ms) if result else None,
        output=result.output if result else None, finish_reason=result.finish_reason if result else None,
        error=ResultError(result.error.code, result.error.message) if result and result.error else None,
        timings=result.timings if result else {}, attempts=rec.attempts, callback=callback, links=out_links,
    )


def record_view(rec: StoredRecord) -> dict[str, Any]:
    """The JSON-ready view of a record (enums as their values, absent fields left out)."""
    return msgspec.to_builtins(request_view(rec))
