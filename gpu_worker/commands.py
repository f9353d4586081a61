"""What the worker's asyncio side (and sibling engines) tell a compute loop, through its inbox."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.job import Job
from shared.messages import InferenceRequest


@dataclass(slots=True)
class Add:
    """Requests read from the model's streams."""

    requests: list[InferenceRequest]
    arrived: float


@dataclass(slots=True)
class Adopt:
    """Jobs another engine of the same model took in, whose real lane is one of this engine's."""

    items: list[Job]


@dataclass(slots=True)
class Cancel:
    ids: set[str]


@dataclass(slots=True)
class Drain:
    """Stop starting new work; finish running rows until `until`, then hand back the rest."""

    until: float


@dataclass(frozen=True, slots=True)
class Release:
    """Another worker's engine serving `lanes`, of `rows` rows, is at `level` (waiting less free rows), less than a turn
    of its rows: hand back for it waiting requests this engine cannot start now (`gpu_worker.rebalance`)."""

    lanes: frozenset[str]
    level: int
    rows: int


Command = Add | Adopt | Cancel | Drain | Release
