"""The model runner port: what a compute loop asks of the torch side (`EmbedRunner`, `GenerateRunner`).

A runner turns a request into a `Job` (tokenized, typed, filed under its real lane), starts batches
of jobs on the model, advances running rows one decode step at a time, and removes rows the
scheduler gives up on. It decides nothing: what to start and what to remove come from the scheduler.
No torch here, so the compute loop and its tests import none.
"""

from __future__ import annotations

from typing import Any, Protocol

from gpu_worker.job import Job
from gpu_worker.outcomes import Delta, Outcome
from gpu_worker.service_model import CostPrior
from shared.messages import InferenceRequest
from shared.states import FinishReason


class Runner(Protocol):
    @property
    def busy(self) -> bool:
        """Rows are running (a decode step has work)."""
        ...

    @property
    def free_rows(self) -> int: ...

    def prepare(self, req: InferenceRequest, now: float) -> Job | Outcome:
        """The job for `req`, or the outcome of a request it cannot take (invalid, too long)."""
        ...

    def start(self, batch: list[Job], now: float) -> list[Outcome]:
        """Start `batch` on the model; returns the jobs already done (an encoder's whole batch)."""
        ...

    def begin_chunked(self, job: Job, now: float) -> list[Outcome]:
        """Start prefilling a long prompt a chunk per `step` (an encoder runs it whole)."""
        ...

    @property
    def chunking(self) -> bool:
        """A prompt is being prefilled in chunks."""
        ...

    @property
    def chunk_left(self) -> int:
        """Prompt tokens of the chunked prefill still to go (0 when none is in progress)."""
        ...

    @property
    def fused(self) -> bool:
        """Chunks of a long prompt ride in the decode steps' forwards (see `gpu_worker.fused_step`)."""
        ...

    @property
    def last_chunk(self) -> tuple[int, float]:
        """(prompt tokens, seconds) of the chunk the last step prefilled; (0, 0.0) if none."""
        ...

    def step(self, chunk_tokens: int = 0) -> list[Outcome]:
        """Up to `chunk_tokens` of a chunked prefill, then one decode step for every running row; returns the
        rows that finished."""
        ...

    def remove(self, ids: set[str], reason: FinishReason) -> list[Outcome]:
        """Running rows leave now with what they have (the one way to end a row early)."""
        ...

    def resumed_whole(self, job: Job, reason: FinishReason = FinishReason.LENGTH) -> Outcome:
        """A streaming job with no row: its result from what its caller was sent (`generation_result`)."""
        ...

    def hold_back(self, ids: frozenset[str]) -> None:
        """Exactly the running rows `ids` sit out the next steps, keeping their work (`gpu_worker.background_rows`
        decides which; an encoder keeps no rows between calls and ignores it)."""
        ...

    def take_deltas(self) -> list[Delta]:
        """Tokens of streaming rows their callers may have now, since the last call (an encoder has none)."""
        ...

    def remaining_tokens(self) -> dict[str, int]: ...

    def running_ids(self) -> list[str]: ...

    def engine_stats(self) -> Any: ...

    def warm_up(self) -> CostPrior:
        """Run once before serving (first-call imports and kernels happen now, not on a request); returns the costs
        it measured, which stand in for the measurements until the first of each (`ServiceTracker.seed`)."""
        ...


MODEL_CALLS_KEPT = 10_000


def count_calls(calls: dict[str, int], batch: list[Job]) -> None:
    """How often each request reached the model (tests and debugging); only the latest ids are kept."""
    for job in batch:
        calls[job.id] = calls.pop(job.id, 0) + 1
    while len(calls) > MODEL_CALLS_KEPT:
        del calls[next(iter(calls))]
