"""Running rows that sit out decode steps, where they are: their caches stay in their cache rows, which the
running batch's view of the cache no longer covers; brought back, a row continues exactly where it stopped
(torch only; which rows sit out is decided by `gpu_worker.background_rows`).

Why: on a GPU a decode step costs about the same for 1 row or 64, but on a CPU every row adds to every
step, so a full batch of batch-priority rows would slow an interactive row's tokens several-fold. Parked,
such rows cost the interactive rows nothing and lose no work (a preempted row starts again from its
prompt). A parked row keeps its token history, its sampler's state and the cached keys and values of
its positions, and it still counts as a running row: `max_rows` bounds both together.

How, without copying caches (copying the caches of 60 rows aside took 60-90 ms on a CPU, a stall every
interactive arrival paid): the cache's running rows start at row `base` (`SlotKVCache.set_base`) and the
parked rows sit in rows [0, base).
- Parking k rows: they are swapped to the front of the running rows, with the few running rows there
  (so at most min(k, running - k) row swaps), and `base` moves past them.
- Bringing rows back: they are swapped to the end of the parked rows, and `base` moves back over them.
  Their tokens end where they stopped, behind the batch's end, so a row is shifted in its cache row to
  end at the batch's end; when every parked row comes back at once, all parked in the same step, and
  the running rows are fewer, the running rows are shifted back to meet them instead (a CPU parks 60
  batch rows beside one interactive row, and brings them back when it finishes).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpu_worker.sequences import Row


@dataclass(slots=True)
class Parked:
    row: Row
    slot: int  # its cache row (absolute: below the cache's `base`)
    end: int  # the column after its last cached token: its tokens are in [row.start, end)

    @property
    def length(self) -> int:
        return self.end - self.row.start


class ParkedRows:
    def __init__(self, engine: Any) -> None:  # the GenerationEngine that owns it (no import: it imports this)
        self.engine = engine
        self.rows: dict[str, Parked] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.rows

    def hold(self, ids: Iterable[str]) -> None:
        """Exactly the rows `ids` (of those running) sit out the next steps: others held so far come back."""
        wanted = set(ids)
        self.release([rid for rid in self.rows if rid not in wanted])
        self.park(wanted - set(self.rows))

    def park(self, ids: Iterable[str]) -> None:
        e = self.engine
        wanted = set(ids)
        going = [i for i, r in enumerate(e.rows) if r.spec.id in wanted]
        k = len(going)
        if not k:
            return
        base = e.cache.base
        staying = [j for j in range(k) if e.rows[j].spec.id not in wanted]  # in the front k rows, not parked
        for j, i in zip(staying, [i for i in going if i >= k], strict=True):
            e.cache.swap_rows(base + i, base + j, min(e.rows[i].start, e.rows[j].start), e.end)
            e.rows[i], e.rows[j] = e.rows[j], e.rows[i]
        for j, row in enumerate(e.rows[:k]):
            self.rows[row.spec.id] = Parked(row, base + j, e.end)
        del e.rows[:k]
        e.cache.set_base(base + k)

    def release(self, ids: Iterable[str]) -> None:
        """Parked rows `ids` join the running batch again, at its front, their tokens ending at its end."""
        e = self.engine
        wanted = set(ids)
        back = [p for rid, p in self.rows.items() if rid in wanted]
        if not back:
            return
        m = len(back)
        base = e.cache.base
        edge = base - m  # the rows [edge, base) will hold them
        # those below the edge trade places with parked rows that stay, in [edge, base)
        outside = [p for p in back if p.slot < edge]
        blocking = [p for p in self.rows.values() if p.slot >= edge and p.row.spec.id not in wanted]
        for p, q in zip(outside, blocking, strict=True):
            e.cache.swap_rows(p.slot, q.slot, min(p.row.start, q.row.start), max(p.end, q.end))
            p.slot, q.slot = q.slot, p.slot
        for p in back:
            del self.rows[p.row.spec.id]
        back.sort(key=lambda p: p.slot)
        ends = {p.end for p in back}
        lag = e.end - back[0].end
        if not self.rows and len(ends) == 1 and len(e.rows) < m and all(r.start >= lag for r in e.rows):
            # the running rows (fewer) move back to end where the parked ones stopped
            if e.rows:
                e.cache.shift_columns(len(e.rows), min(r.start for r in e.rows), e.end, -lag)
                for r in e.rows:
                    r.start -= lag
            e.end = back[0].end
            e.cache.set_base(edge)
        else:  # each comes forward in its own row to end at the batch's end
            e._make_room_left(max(p.length for p in back))
            e.cache.set_base(edge)
            for i, p in enumerate(back):
                n = p.length
                e.cache.copy_span(i, p.row.start, i, e.end - n, n)
                p.row.start = e.end - n
        e.rows[:0] = [p.row for p in back]

    def ids(self) -> list[str]:
        return list(self.rows)

    def remaining(self) -> dict[str, int]:
        return {rid: p.row.spec.max_new_tokens - len(p.row.tokens) for rid, p in self.rows.items()}
