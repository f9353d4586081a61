"""The public JSON shape of a request record (GET /v1/requests/{id}, sync-wait and callbacks)."""

from __future__ import annotations

from typing import Any

from shared.records import StoredRecord


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
    out["links"] = {"self": f"/v1/requests/{rec.id}"}
    return out
