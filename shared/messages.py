"""Typed messages for every hop through Redis: these types are the wire schema. `shared.codec` encodes
and decodes them with msgspec (which checks every field against its annotation), never pickled.
They stay frozen dataclasses (msgspec handles them natively), so `dataclasses.replace` works on them.

gateway --InferenceRequest--> lane stream --> worker
worker  --RequestResult-----> result record (+ "done" event) --> gateway / callback dispatcher
gateway --RequestMeta-------> result record (what GET shows while the request is queued)
worker  --LaneStats---------> stats hash --> gateway admission
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from shared.states import FinishReason, Priority, Status, Task


@dataclass(frozen=True, slots=True)
class Callback:
    url: str
    events: tuple[str, ...] = ("completed",)


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One accepted request, as the gateway puts it on its lane stream."""

    KIND: ClassVar[str] = "request"
    id: str
    tenant: str
    model: str
    task: Task
    input: dict[str, Any]
    params: dict[str, Any]
    lane: str
    priority: Priority
    created_ms: int
    deadline_ms: int
    est_tokens: int
    callback: Callback | None = None
    idempotency_key: str | None = None
    stream: bool = False  # publish token deltas as they are decoded (`shared.events`)
    # set by the worker that reads a redelivered streaming request: the tokens its caller was already sent,
    # which the new attempt continues from instead of generating again
    streamed: tuple[int, ...] = ()
    # it holds a slot in its tenant's backlog quota, which its end gives back (False: the tenant has no quota,
    # and ending it costs no Redis command for one; True by default, so a request from an older gateway is
    # always given back)
    quota_slot: bool = True
    # when the gateway's admission expected it to start (epoch ms; None: no estimate, or an older gateway). The
    # scheduler ages a lane by how long its requests have waited past this, so work that is on the schedule it was
    # promised lets shorter work go first (`gpu_worker.dynamic_stage.DynamicStage.urgency`)
    start_eta_ms: int | None = None
    # how often a worker handed it, unstarted, to a less loaded one (`gpu_worker.rebalance`): once at most, so that
    # no request goes back and forth between workers
    moved: int = 0

    def meta(self) -> RequestMeta:
        return RequestMeta(
            id=self.id,
            tenant=self.tenant,
            model=self.model,
            task=self.task,
            lane=self.lane,
            priority=self.priority,
            created_ms=self.created_ms,
            deadline_ms=self.deadline_ms,
            est_tokens=self.est_tokens,
            callback=self.callback,
        )


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """What the result record keeps about a request besides its result (no input: inputs can be large)."""

    KIND: ClassVar[str] = "meta"
    id: str
    tenant: str
    model: str
    task: Task
    lane: str
    priority: Priority
    created_ms: int
    deadline_ms: int
    est_tokens: int
    callback: Callback | None = None


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """Tokens of a streaming request released to its caller: `token_ids` are its output's tokens
    [start, start + len(token_ids)) and `text` what they add to its text. Deltas of one request are
    contiguous; a stop string's possible beginning is never in one (held back until decided)."""

    KIND: ClassVar[str] = "delta"
    start: int
    token_ids: tuple[int, ...]
    text: str
    # with `params.logprobs`: one entry per token, as the result's `output.logprobs` holds them
    logprobs: tuple[dict[str, Any], ...] | None = None
    # the prompt's tokens as the model read it (the result's `output.prompt_tokens`); None: not told (an older worker)
    prompt_tokens: int | None = None
    # with `params.echo`, an attempt's first delta: the prompt's token ids (the result's `output.prompt_token_ids`)
    prompt_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class RequestResult:
    """The terminal outcome of a request. The first one written for an id wins."""

    KIND: ClassVar[str] = "result"
    id: str
    status: Status
    output: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    finish_reason: FinishReason | None = None
    timings: dict[str, float] = field(default_factory=dict)
    started_ms: int | None = None
    finished_ms: int = 0
    worker: str = ""


@dataclass(frozen=True, slots=True)
class LaneStat:
    lane: str
    waiting: int  # read by the worker, not started yet
    running: int  # in the running batch
    completed_rps: float  # completions per second, exponentially weighted
    est_wait_ms: float  # the worker's estimate of queueing delay for a new request in this lane
    # the (priority rank, deadline ms) keys of the waiting requests in the order they start, sampled when many
    # (`gpu_worker.load_outlook.waiting_order`); empty from an older worker or a FIFO one: all count as ahead
    order: tuple[tuple[int, int], ...] = ()
    frees_ms: tuple[int, ...] = ()  # ms from `at_ms` until each running row ends, ascending (the soonest ones)


@dataclass(frozen=True, slots=True)
class LaneStats:
    """One worker's load figures for one model, published at a steady interval; admission reads them."""

    KIND: ClassVar[str] = "lane_stats"
    model: str
    worker: str
    at_ms: int
    max_rows: int
    free_rows: int
    deadline_aware: bool
    prefill_fixed_ms: float
    prefill_ms_per_token: float
    decode_ms_per_step: float
    lanes: tuple[LaneStat, ...] = ()
    # what one more running row adds to a decode step (0 where rows cost nothing, a GPU's; and from older workers)
    decode_ms_per_row: float = 0.0
    preemptible: int = 0  # running batch-priority rows an interactive request that cannot wait may take


@dataclass(frozen=True, slots=True)
class CallbackDelivery:
    """One webhook to send: put on the callback stream atomically with the state change it reports."""

    KIND: ClassVar[str] = "callback"
    delivery_id: str  # the `webhook-id`: the same on every attempt
    request_id: str
    tenant: str
    event: str  # "started" | "completed"
    url: str
    created_ms: int


# the delivery states a caller (or operator) may send again: POST /v1/requests/{id}/callback:replay
REPLAYABLE = frozenset({"dead", "failed"})


@dataclass(frozen=True, slots=True)
class CallbackState:
    """Where a delivery stands; kept with the delivery and copied into the request's record."""

    KIND: ClassVar[str] = "callback_state"
    delivery_id: str
    event: str
    url: str
    status: str  # "pending" | "delivered" | "failed" | "dead" | "disabled"
    attempts: int = 0
    last_status_code: int | None = None
    last_error: str = ""
    next_attempt_ms: int | None = None
    delivered_ms: int | None = None
