"""The script a worker hands entries back to its model's streams with (`RedisQueue.hand_back`)."""

from __future__ import annotations

from collections.abc import Sequence

from gpu_worker.work_queue import Held, entry_fields
from shared.keys import GROUP

# A hand-back of one model's entries (its lanes' streams share a hash slot). KEYS: the streams; ARGV[1]: the group,
# then per entry: its stream's index in KEYS, its id, the request. A fresh copy of each, then ours acked and deleted,
# in one step: a worker blocked reading the streams (an idle one, which a hand-back to a less loaded worker is for,
# `gpu_worker.rebalance`) is served every fresh entry at once, not the first alone while the rest go to whoever reads
# next (the worker that handed them back, as often as not, when each was its own XADD).
HAND_BACK_LUA = """
for i = 2, #ARGV, 3 do
  local key = KEYS[tonumber(ARGV[i])]
  redis.call('XADD', key, '*', 'm', ARGV[i + 2])
  redis.call('XACK', key, ARGV[1], ARGV[i + 1])
  redis.call('XDEL', key, ARGV[i + 1])
end
return 0
"""


def hand_back_calls(held: Sequence[Held]) -> list[tuple[list[str], list[bytes | str | int]]]:
    """The (KEYS, ARGV) of one `HAND_BACK_LUA` call per model of `held`."""
    by_model: dict[str, list[Held]] = {}
    for h in held:
        by_model.setdefault(h.model, []).append(h)
    calls: list[tuple[list[str], list[bytes | str | int]]] = []
    for group in by_model.values():
        streams = sorted({h.stream for h in group})
        args: list[bytes | str | int] = [GROUP]
        for h in group:
            (payload,) = entry_fields(h.request).values()
            args += [streams.index(h.stream) + 1, h.entry_id, payload]
        calls.append((streams, args))
    return calls
