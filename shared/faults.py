"""Fault-injection hooks for the fault-injection test suite and the chaos script. Off unless set.

`BATCHGATE_FAULTS` is a comma-separated list:
- `kill_after_result_write=N`: SIGKILL this worker right after its N-th result write (before XACK);
- `kill_after_ack=N`: SIGKILL right after its N-th XACK;
- `kill_at_prefill=N`: SIGKILL at its N-th prefill (mid-batch: entries read, nothing written);
- `kill_token=T`: SIGKILL whenever a request whose input holds token id T reaches prefill (a request
  that keeps killing workers: it must end in the dead-letter stream);
- `raise_token=T`: the model raises for a request whose input holds token id T (a poison request
  that fails alone).
Production configs never set it; the worker logs a warning when it is set.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.errors import ConfigError

_COUNTED = ("kill_after_result_write", "kill_after_ack", "kill_at_prefill")


class InjectedFault(RuntimeError):
    """Raised by the model when `raise_token` is in a request's input."""


@dataclass
class Faults:
    kill_at: dict[str, int] = field(default_factory=dict)
    kill_token: int | None = None
    raise_token: int | None = None
    _hits: dict[str, int] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.kill_at or self.kill_token is not None or self.raise_token is not None)

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> Faults:
        raw = (os.environ if env is None else env).get("BATCHGATE_FAULTS", "")
        faults = cls()
        for part in filter(None, (p.strip() for p in raw.split(","))):
            name, _, value = part.partition("=")
            try:
                number = int(value)
            except ValueError as exc:
                raise ConfigError(f"BATCHGATE_FAULTS: {part!r} needs an integer value") from exc
            if name in _COUNTED:
                faults.kill_at[name] = number
            elif name == "kill_token":
                faults.kill_token = number
            elif name == "raise_token":
                faults.raise_token = number
            else:
                raise ConfigError(f"BATCHGATE_FAULTS: unknown fault {name!r}")
        return faults

    def point(self, name: str) -> None:
        """A named place in the worker's flow: dies here if armed for this hit."""
        if name not in self.kill_at:
            return
        self._hits[name] = self._hits.get(name, 0) + 1
        if self._hits[name] == self.kill_at[name]:
            os.kill(os.getpid(), signal.SIGKILL)

    def check_tokens(self, token_ids: list[int] | tuple[int, ...]) -> None:
        if self.kill_token is not None and self.kill_token in token_ids:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.raise_token is not None and self.raise_token in token_ids:
            raise InjectedFault(f"injected model failure (token {self.raise_token})")
