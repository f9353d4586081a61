"""Every Redis key and channel name batchgate uses, built in this one module.

Hash tags keep the keys that one command or script touches in one Redis Cluster slot:
- `{m:<model>}`: a model's lane streams, dead-letter stream, stats and cancel channel. A worker
  reads all lanes of a model with one XREADGROUP, so they must share a slot.
- `{r:<id>}`: one request's record, its "done" channel (the finish script writes and publishes
  atomically) and, for a streaming request, its stream of token deltas.
- `{i:<tenant>:<hash>}`: an idempotency key.
- `{cb}`: the callback stream, schedule and delivery states (the dispatcher moves a delivery between
  them atomically).
The prefix (default "bg") lets several deployments, or tests, share one Redis without touching
each other's data.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

GROUP = "workers"


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "bg"

    # --- per model ---------------------------------------------------------------------------
    def lane_stream(self, model: str, lane: str) -> str:
        return f"{self.prefix}:{{m:{model}}}:lane:{lane}"

    def lane_streams(self, model: str, lanes: list[str] | tuple[str, ...]) -> list[str]:
        return [self.lane_stream(model, lane) for lane in lanes]

    def dead_letter(self, model: str) -> str:
        return f"{self.prefix}:{{m:{model}}}:dead"

    def lane_stats(self, model: str) -> str:
        return f"{self.prefix}:{{m:{model}}}:stats"

    def cancel_channel(self, model: str) -> str:
        return f"{self.prefix}:{{m:{model}}}:cancel"

    # --- per request -------------------------------------------------------------------------
    def record(self, request_id: str) -> str:
        return f"{self.prefix}:{{r:{request_id}}}:rec"

    def done_channel(self, request_id: str) -> str:
        return f"{self.prefix}:{{r:{request_id}}}:done"

    def events(self, request_id: str) -> str:
        """A streaming request's token deltas (a stream), kept as long as its record (`gpu_worker.delta_script`)."""
        return f"{self.prefix}:{{r:{request_id}}}:ev"

    def idempotency(self, tenant: str, key: str) -> str:
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]
        return f"{self.prefix}:{{i:{tenant}:{digest}}}"

    # --- callbacks: one slot ({cb}) for the stream, the schedule and the delivery states --------
    def callback_stream(self) -> str:
        return f"{self.prefix}:{{cb}}:stream"

    def callback_deadlines(self) -> str:
        """Requests with a webhook by when they must have a result (deadline + grace, ms): the dispatcher expires
        the overdue ones (`gateway.dispatcher`), so their `completed` webhook goes even with no worker alive."""
        return f"{self.prefix}:{{cb}}:deadlines"

    def callback_due(self) -> str:
        return f"{self.prefix}:{{cb}}:due"

    def callback_state(self, delivery_id: str) -> str:
        return f"{self.prefix}:{{cb}}:d:{delivery_id}"

    def callback_dead(self) -> str:
        return f"{self.prefix}:{{cb}}:dead"

    def callback_disabled(self, tenant: str) -> str:
        return f"{self.prefix}:{{cb}}:off:{tenant}"

    # --- batches (the Batch API): one slot ({b:<id>}) per batch for its record, items, lines and lease ----
    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:{{b:{batch_id}}}"

    def batch_items(self, batch_id: str) -> str:
        return f"{self.prefix}:{{b:{batch_id}}}:items"

    def batch_lines(self, batch_id: str) -> str:
        return f"{self.prefix}:{{b:{batch_id}}}:lines"

    def batch_lease(self, batch_id: str) -> str:
        return f"{self.prefix}:{{b:{batch_id}}}:lease"

    def batches(self, tenant: str) -> str:
        return f"{self.prefix}:batches:t:{tenant}"

    def batches_active(self) -> str:
        return f"{self.prefix}:batches:active"

    # --- tenants ---------------------------------------------------------------------------------
    def tenant(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}"

    def webhook_default(self) -> str:
        return f"{self.prefix}:webhooks:default"

    def api_key(self, key_hash: str) -> str:
        return f"{self.prefix}:apikey:{key_hash}"

    def tenant_keys(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:keys"

    def tenant_active(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:active"

    def rate(self, tenant: str, window: int) -> str:
        return f"{self.prefix}:rate:{tenant}:{window}"

    # --- files (shared/files.py): metadata per file, a per-tenant index per purpose and one of all ----
    def file(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    def files(self, tenant: str, purpose: str | None = None) -> str:
        """A tenant's file ids (a sorted set read in lexical order, in which its members sort by creation:
        shared/files.py), all of them or those of one purpose. The purpose comes first: it has no ':', so no
        tenant name collides."""
        return f"{self.prefix}:files:{purpose or 'all'}:{tenant}"

    # --- deployment-wide ---------------------------------------------------------------------
    def model_registry(self) -> str:
        return f"{self.prefix}:models"

    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def alive(self, worker: str) -> str:
        """A worker's liveness mark: renewed with each heartbeat, it expires (on Redis's clock) once the worker
        is silent; its stream entries can then be taken over at once (`gpu_worker.upkeep`)."""
        return f"{self.prefix}:alive:{worker}"

    def done_channel_prefix(self) -> str:
        return f"{self.prefix}:{{r:"
