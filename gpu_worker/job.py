"""One request inside a worker's compute side, created once when a compute loop takes it in.

A `Job` carries what every later step needs, typed and in one unit: the request it answers, its
typed params, its token ids, its lane, priority rank, deadline (wall-clock seconds), its size in a
batch and its state. The scheduler's lane queues, its running set and the engine's row all hold this
same object; nothing downstream re-reads the wire dicts. Pure: no torch, no Redis.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_worker.stream_release import Release
    from shared.messages import InferenceRequest
    from shared.params import EmbedParams, GenerateParams


class JobState(enum.Enum):
    QUEUED = "queued"  # in a lane queue, waiting to be planned
    RUNNING = "running"  # in the running batch (or being encoded)
    DONE = "done"  # left the compute side: an outcome, an ack or a hand-back was emitted


@dataclass(slots=True, eq=False)
class Job:
    id: str
    lane: str
    rank: int  # 0 interactive, 1 batch
    deadline: float  # wall-clock seconds
    arrived: float  # when this worker's compute loop took it in
    tokens: int  # prompt + max_new_tokens (generation) or input tokens (encoders): files it under a lane
    prompt_tokens: int  # longest sequence to prefill / encode (sets the padded width)
    size: int = 1  # rows it occupies in a batch (texts for embeddings)
    new_tokens: int = 0  # tokens to generate (0 for encoders)
    request: InferenceRequest | None = None
    params: GenerateParams | EmbedParams | None = None
    inputs: tuple[tuple[int, ...], ...] = ()  # token ids: the prompt, or one sequence per text to embed
    state: JobState = JobState.QUEUED
    attempts: int = 0  # times this worker started it on the model (a preempted row is started again)
    stream: Release | None = None  # a streaming generation: what its caller was sent
    grammar: Any = None  # a structured output's matcher, compiled at prepare, before any token (gpu_worker.constraints)
    constraint: Any = None  # its row's grammar state, this admission (`Constraint`): failed or not
    bad_words: tuple[tuple[int, ...], ...] = ()  # vLLM's bad_words as token sequences, tokenized at prepare

    @property
    def due(self) -> float:
        """When it was expected to start (wall-clock seconds): the start the gateway's admission estimated, else
        its arrival here. The scheduler ages lanes by the time their requests have waited past this."""
        eta = self.request.start_eta_ms if self.request is not None else None
        return eta / 1000 if eta is not None else self.arrived

    @property
    def req(self) -> InferenceRequest:
        """The request this job answers (every job built by a runner has one)."""
        if self.request is None:
            raise LookupError(f"job {self.id} carries no request")
        return self.request
