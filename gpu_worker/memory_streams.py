"""Redis Streams with one consumer group per stream, modelled in memory for `MemoryQueue`.

What is modelled is what the worker relies on: entries in id order; the group's last-delivered id
(entries after it are new); its pending list (owner, time of the last delivery, delivery count);
consumers with a last-seen time, created by their first delivery or claim (as in Redis 7.0). Claiming
an idle entry counts a delivery; an entry deleted while pending is dropped by the next claim.
Times are the caller's clock, in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_worker.work_queue import Entry


@dataclass(slots=True)
class Pending:
    consumer: str
    delivered_at: float
    deliveries: int = 1


@dataclass(slots=True)
class Group:
    last_delivered: tuple[int, int] = (0, 0)
    pending: dict[bytes, Pending] = field(default_factory=dict)
    consumers: dict[str, float] = field(default_factory=dict)  # name: last seen

    def seen(self, consumer: str, now: float, *, create: bool = False) -> None:
        if create or consumer in self.consumers:
            self.consumers[consumer] = now

    def owned_by(self, consumer: str) -> dict[bytes, Pending]:
        """{entry id: pending} of what `consumer` owns, in id order."""
        mine = sorted((eid for eid, p in self.pending.items() if p.consumer == consumer), key=entry_key)
        return {eid: self.pending[eid] for eid in mine}

    def renew(self, consumer: str, ids: list[bytes], now: float) -> int:
        """Reset the idle time of those of `ids` that `consumer` owns, counting no delivery."""
        self.seen(consumer, now)
        mine = [p for eid in ids if (p := self.pending.get(eid)) is not None and p.consumer == consumer]
        for p in mine:
            p.delivered_at = now
        if mine:
            self.seen(consumer, now, create=True)
        return len(mine)


@dataclass(slots=True)
class Stream:
    name: str
    entries: dict[bytes, dict[bytes, bytes]] = field(default_factory=dict)  # in id order
    group: Group | None = None

    def deliver(self, consumer: str, count: int, now: float) -> list[Entry]:
        """Up to `count` new entries, now pending for `consumer`."""
        g = self.group
        if g is None or count <= 0:
            return []
        g.seen(consumer, now)
        out: list[Entry] = []
        for eid, fields in self.entries.items():
            if entry_key(eid) > g.last_delivered:
                g.last_delivered = entry_key(eid)
                g.pending[eid] = Pending(consumer, now)
                g.seen(consumer, now, create=True)
                out.append(Entry(self.name, eid, fields))
                if len(out) == count:
                    break
        return out

    def claim_idle(self, consumer: str, min_idle_s: float, count: int, now: float,
                   owner: str | None = None) -> list[Entry]:
        """Up to `count` entries idle for `min_idle_s` (only `owner`'s, when given), now `consumer`'s, each with a
        delivery more."""
        g = self.group
        if g is None:
            return []
        g.seen(consumer, now)
        out: list[Entry] = []
        for eid in sorted(g.pending, key=entry_key):
            p = g.pending[eid]
            if len(out) >= count:
                break
            if now - p.delivered_at < min_idle_s or (owner is not None and p.consumer != owner):
                continue
            if eid not in self.entries:  # deleted meanwhile: dropped from the pending list, not returned
                del g.pending[eid]
                continue
            p.consumer, p.delivered_at, p.deliveries = consumer, now, p.deliveries + 1
            g.seen(consumer, now, create=True)
            out.append(Entry(self.name, eid, self.entries[eid], p.deliveries))
        return out

    def delete(self, entry_id: bytes) -> None:
        """XACK + XDEL."""
        self.entries.pop(entry_id, None)
        if self.group is not None:
            self.group.pending.pop(entry_id, None)


def entry_key(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq)
