"""The public JSON shape of a request record (GET /v1/requests/{id}, sync-wait and callbacks)."""

from __future__ import annotations

from typing import Any

from shared.messages import Callback, CallbackState
from shared.records import StoredRecord


def callback_view(cb: Callback, state: CallbackState | None) -> dict[str, Any]:
    out: dict[str, Any] = {"url": cb.url, "events": list(cb.events)}
    if state is None:
        out["status"] = "waiting"  # nothing to deliver yet (or the delivery is queued)
        return out
    out.update({
        "event": state.event, "status": state.status, "attempts": state.attempts,
        "last_status_code": state.last_status_code, "last_error": state.last_error or None,
        "next_attempt_at": _sec(state.next_attempt_ms), "delivered_at": _sec(state.delivered_ms),
        "webhook_id": state.delivery_id,
    })
    return out


def _sec(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000


def record_view(rec: StoredRecord) -> dict[str, Any]:
    meta, result = rec.meta, rec.result
    out: dict[str, Any] = {"id": rec.id, "status": rec.state.value}
    if meta is not None:
        out.update({
            "model": meta.model,
            "task": meta.task.value,
            "lane": meta.lane,
            "priority": meta.priority.value,
            "created_at": _sec(meta.created_ms),
            "deadline": _sec(meta.deadline_ms),
        })
    started = result.started_ms if result and result.started_ms else rec.started_ms
    out["started_at"] = _sec(started)
    out["finished_at"] = _sec(result.finished_ms) if result else None
    out["output"] = result.output if result else None
    out["finish_reason"] = result.finish_reason.value if result and result.finish_reason else None
    out["error"] = ({"code": result.error.code, "message": result.error.message}
                    if result and result.error else None)
    out["timings"] = result.timings if result else {}
    out["attempts"] = rec.attempts
    if meta is not None and meta.callback is not None:
        out["callback"] = callback_view(meta.callback, rec.callback)
        if rec.callback is not None and rec.callback.status in ("dead", "failed"):
            out["links"] = {"self": f"/v1/requests/{rec.id}",
                            "replay_callback": f"/v1/requests/{rec.id}/callback:replay"}
            return out
    out["links"] = {"self": f"/v1/requests/{rec.id}"}
    return out
