"""How the SDK resumes a request's dropped event stream (with its Last-Event-ID): pauses that double from
`first_s` up to `max_s`, until they add up to `budget_s`; the stream making progress (an event id past the last
one, a new status) starts the count again, an event a reconnect only repeats (the status every connection opens
with) does not, so a gateway that answers and drops at once cannot keep a caller retrying forever. The budget
covers a gateway restarting (the old one tells its streams to reconnect seconds before it exits, the new one takes
seconds to come up) and a Redis failover; a budget of 0 never resumes. Pure: the caller sleeps."""

from __future__ import annotations


class Reconnects:
    def __init__(self, first_s: float, max_s: float, budget_s: float) -> None:
        if first_s <= 0 or max_s < first_s or budget_s < 0:
            raise ValueError("reconnect pauses must be positive, the longest no shorter than the first")
        self.first_s, self.max_s, self.budget_s = first_s, max_s, budget_s
        self._id: str | None = None
        self._status: str | None = None
        self.reset()

    def progress(self, event_id: str | None, status: str | None = None) -> None:
        """An event came with this id (and, a status event, this status): the count starts again if the stream
        moved on since the last one."""
        moved = (event_id is not None and event_id != self._id) or (status is not None and status != self._status)
        self._id = event_id if event_id is not None else self._id
        self._status = status if status is not None else self._status
        if moved:
            self.reset()

    def resume_from(self, event_id: str | None) -> Reconnects:
        """Where the stream starts (the caller's Last-Event-ID): not progress in itself."""
        self._id = event_id
        return self

    def reset(self) -> None:
        """The stream is alive again."""
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
