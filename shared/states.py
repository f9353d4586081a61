"""Request lifecycle states, tasks and priorities: the enums every hop agrees on."""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL: frozenset[Status] = frozenset({Status.SUCCEEDED, Status.FAILED, Status.EXPIRED, Status.CANCELLED})


class Task(StrEnum):
    GENERATE = "generate"
    EMBED = "embed"

    @property
    def model_kind(self) -> str:
        """As a sentence names such a model: "a generation model", "an embedding model"."""
        return "a generation model" if self is Task.GENERATE else "an embedding model"


class Priority(StrEnum):
    """Interactive work is scheduled before batch work; batch work never pushes interactive past its deadline."""

    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        return 0 if self is Priority.INTERACTIVE else 1


class FinishReason(StrEnum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    DEADLINE = "deadline"
    CANCELLED = "cancelled"
    ERROR = "error"
    DONE = "done"  # encoders: the whole input was processed
