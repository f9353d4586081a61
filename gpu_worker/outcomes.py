"""What the compute side hands the I/O side: a request's terminal outcome, an ack, a hand-back, or a
streaming request's token delta.

The compute loops put lists of these on the worker's publisher queue; the publisher writes them to
Redis (record first, then XACK). Built here, in one place, so every terminal result has one shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.messages import ErrorInfo, InferenceRequest, RequestResult, StreamDelta
from shared.states import FinishReason, Status, Task

# a generation that ended by itself: what its length says of the model's (and its callers') usual outputs
SELF_ENDED = frozenset({FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP})


@dataclass(slots=True)
class Outcome:
    request: InferenceRequest
    result: RequestResult
    computed: bool = True  # False when the request never reached the model

    @property
    def stop_share(self) -> float | None:
        """Of its `max_new_tokens`, the share a generation that ended by itself (its length, the model's EOS, a stop
        string or token) made; None for one cut short (a deadline, a cancel), failed, or no generation."""
        new = self.request.params.get("max_new_tokens") if self.request.task is Task.GENERATE else None
        made = (self.result.output or {}).get("completion_tokens")
        if not new or made is None or self.result.finish_reason not in SELF_ENDED:
            return None
        return min(1.0, made / new)


@dataclass(slots=True)
class Ack:
    """Nothing to write (the record is already terminal): just acknowledge the stream entry."""

    request: InferenceRequest


@dataclass(slots=True)
class HandBack:
    """Work this worker will not do after all: put it back for another worker."""

    requests: list[InferenceRequest]


@dataclass(slots=True)
class Delta:
    """Tokens of a streaming request released to its caller; published before anything later of the same
    request (the compute side emits in order, the publisher writes deltas first)."""

    request: InferenceRequest
    delta: StreamDelta
    first: bool = False  # the first of this attempt: the publisher sets the delta stream's expiry


Emitted = Outcome | Ack | HandBack | Delta


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def result_for(req: InferenceRequest, status: Status, *, worker: str, now: float,
               output: dict[str, Any] | None = None, error: ErrorInfo | None = None,
               reason: FinishReason | None = None, timings: dict[str, float] | None = None,
               started: float | None = None) -> RequestResult:
    t = dict(timings or {})
    t.setdefault("total_ms", round(now * 1000 - req.created_ms, 3))
    if started is not None:
        t.setdefault("queue_ms", round(started * 1000 - req.created_ms, 3))
    return RequestResult(id=req.id, status=status, output=output, error=error, finish_reason=reason,
                         timings=t, started_ms=_ms(started) if started else None, finished_ms=_ms(now),
                         worker=worker)


def expired_outcome(req: InferenceRequest, worker: str, now: float, where: str,
                    unreachable: float | None = None) -> Outcome:
    """A request ended without compute: its deadline passed `where`, or (`unreachable`: seconds it had left) its
    estimated compute would end after it."""
    message = (f"deadline passed {where}; not computed" if unreachable is None else
               f"deadline unreachable {where}: its estimated compute would end after it ({unreachable:.2f} s away); "
               "not computed")
    return Outcome(req, result_for(req, Status.EXPIRED, worker=worker, now=now, reason=FinishReason.DEADLINE,
                                   error=ErrorInfo("deadline_exceeded", message)), computed=False)


def failed_outcome(req: InferenceRequest, worker: str, now: float, code: str, message: str,
                   computed: bool = False) -> Outcome:
    return Outcome(req, result_for(req, Status.FAILED, worker=worker, now=now, reason=FinishReason.ERROR,
                                   error=ErrorInfo(code, message)), computed=computed)
