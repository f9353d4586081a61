"""The gateway's Prometheus metrics."""

from __future__ import annotations

import functools

from prometheus_client import Counter, Gauge, Histogram

from shared.messages import InferenceRequest
from shared.queue_client import Observer

SUBMITTED = Counter("batchgate_submitted_total", "Requests accepted (202/200) by the gateway", ["model", "lane"])
CANCELLED = Counter("batchgate_cancelled_total", "Requests cancelled by callers", ["model"])
ERRORS = Counter("batchgate_gateway_errors_total", "Error responses by code", ["code"])
REJECTED = Counter("batchgate_rejected_total", "Submits rejected at admission", ["model", "lane", "reason"])
BACKLOG = Gauge("batchgate_backlog", "Entries in a lane stream (queued + in progress)", ["model", "lane"])
HTTP_LATENCY = Histogram("batchgate_http_seconds", "Gateway handler latency", ["route", "status"],
                         buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30, 60))
WAITERS = Gauge("batchgate_waiters", "Long-poll / sync-wait requests currently waiting")


# The children of the metrics every request touches, looked up once per set of labels (prometheus_client's
# `labels` takes a lock and builds its key on each call); the sets are few: routes x statuses, models x lanes.
@functools.lru_cache(maxsize=4096)
def http_latency(route: str, status: int) -> Histogram:
    return HTTP_LATENCY.labels(route, str(status))


@functools.lru_cache(maxsize=4096)
def _submitted(model: str, lane: str) -> Counter:
    return SUBMITTED.labels(model, lane)


class Counted(Observer):
    """The caller operations' events, as the counters above."""

    def submitted(self, req: InferenceRequest) -> None:
        _submitted(req.model, req.lane).inc()

    def rejected(self, req: InferenceRequest, code: str) -> None:
        REJECTED.labels(req.model, req.lane, code).inc()

    def cancelled(self, model: str) -> None:
        CANCELLED.labels(model).inc()
