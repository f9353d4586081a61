"""How the SDK resumes a request's dropped event stream (with its Last-Event-ID): pauses that double from
`first_s` up to `max_s`, until they add up to `budget_s`; an event received starts the count again. The budget
covers a gateway restarting (the old one tells its streams to reconnect seconds before it exits, the new one takes
seconds to come up) and a Redis failover. Pure: the caller sleeps."""

from __future__ import annotations


class Reconnects:
    def __init__(self, first_s: float, max_s: float, budget_s: float) -> None:
        if first_s <= 0 or max_s < first_s or budget_s < 0:
            raise ValueError("reconnect pauses must be positive, the longest no shorter than the first")
        self.first_s, self.max_s, self.budget_s = first_s, max_s, budget_s
        self.reset()

    def reset(self) -> None:
        """An event came: the stream is alive again."""
        self.spent = 0.0
        self.pause = self.first_s

    def next_pause(self) -> float | None:
        """The pause before the next attempt; None once the budget is spent (the caller gives up)."""
        left = self.budget_s - self.spent
        if left <= 1e-9:
            return None
        pause = min(self.pause, left)
        self.spent += pause
        self.pause = min(self.pause * 2, self.max_s)
        return pause
