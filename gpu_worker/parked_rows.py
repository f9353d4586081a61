"""Running rows that sit out decode steps: their caches are copied aside and their cache rows freed; brought
back, a row continues exactly where it stopped (torch only; which rows sit out is decided by
`gpu_worker.background_rows`).

Why: on a GPU a decode step costs about the same for 1 row or 64, but on a CPU every row adds to every
step, so a full batch of batch-priority rows would slow an interactive row's tokens several-fold. Parked,
such rows cost the interactive rows nothing and lose no work (a preempted row starts again from its
prompt). A parked row keeps its token history, its sampler's state and the cached keys and values of
its `end - start` positions; on return it is placed right-aligned at the batch's current end, so its
positions and masks read as if it had never left. Its copy lives on the CPU (a GPU's cache memory is
budgeted for the running rows), and it still counts as a running row: `max_rows` bounds both together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker.sequences import Row


@dataclass(slots=True)
class Parked:
    row: Row
    keys: list[torch.Tensor]  # per layer: [kv_heads, length, head_dim]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1]) if self.keys else 0


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
        for i in sorted((i for i, r in enumerate(e.rows) if r.spec.id in wanted), reverse=True):
            row = e.rows[i]
            cols = slice(row.start, e.end)
            self.rows[row.spec.id] = Parked(row, [k[i, :, cols].to("cpu", copy=True) for k in e.cache.keys],
                                            [v[i, :, cols].to("cpu", copy=True) for v in e.cache.values])
            last = len(e.rows) - 1
            if i != last:  # the last running row fills the gap, as when a row retires
                moved = e.rows[last]
                e.cache.move_row(last, i, moved.start, e.end)
                e.rows[i] = moved
            e.rows.pop()

    def release(self, ids: Iterable[str]) -> None:
        """Parked rows `ids` join the running batch again, right-aligned at its end."""
        e = self.engine
        for rid in [rid for rid in ids if rid in self.rows]:
            parked = self.rows.pop(rid)
            n = parked.length
            e._make_room_left(n)  # (a missing column for its next token is made by the step, as for any row)
            dst = len(e.rows)
            cols = slice(e.end - n, e.end)
            for k, v, pk, pv in zip(e.cache.keys, e.cache.values, parked.keys, parked.values, strict=True):
                k[dst, :, cols] = pk.to(k.device)
                v[dst, :, cols] = pv.to(v.device)
            parked.row.start = e.end - n
            e.rows.append(parked.row)

    def ids(self) -> list[str]:
        return list(self.rows)

    def remaining(self) -> dict[str, int]:
        return {rid: p.row.spec.max_new_tokens - len(p.row.tokens) for rid, p in self.rows.items()}
