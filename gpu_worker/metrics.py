"""The worker's Prometheus metrics (served on its own /metrics listener)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_SIZE = (1, 2, 4, 8, 16, 32, 64, 128, 256)

WORKER_BACKLOG = Gauge("batchgate_worker_backlog", "Requests waiting in the worker's lane queues",
                       ["model", "lane"])
RUNNING = Gauge("batchgate_running_sequences", "Sequences in the running decode batch", ["model"])
BATCH_SIZE = Histogram("batchgate_batch_size", "Requests per prefill/encode batch", ["model", "lane"],
                       buckets=_SIZE)
QUEUE_WAIT = Histogram("batchgate_queue_wait_seconds", "Submit to start of compute", ["model", "lane"],
                       buckets=_LAT)
COMPUTE = Histogram("batchgate_compute_seconds", "Start of compute to result", ["model"], buckets=_LAT)
TTFT = Histogram("batchgate_ttft_seconds", "Prefill start to first token", ["model"], buckets=_LAT)
RESULTS = Counter("batchgate_results_total", "Terminal results written by workers", ["model", "status"])
TOKENS = Counter("batchgate_generated_tokens_total", "Generated tokens", ["model"])
TOKENS_PER_S = Gauge("batchgate_tokens_per_second", "Generated tokens per second over the last interval",
                     ["model"])
KV_PADDING = Gauge("batchgate_kv_padding_fraction", "Share of attended cache positions that are padding",
                   ["model"])
PHASE_SECONDS = Counter("batchgate_engine_seconds_total", "Engine time by phase", ["model", "phase"])
EXPIRED_BEFORE_COMPUTE = Counter("batchgate_expired_before_compute_total",
                                 "Requests expired at the worker without any compute", ["model", "lane"])
DEADLINE_MISSES = Counter("batchgate_deadline_misses_total", "Requests that reached their deadline while running",
                          ["model", "lane"])
REDELIVERIES = Counter("batchgate_redeliveries_total", "Stream entries read again after a worker lost them",
                       ["model"])
DEAD_LETTERS = Counter("batchgate_dead_letters_total", "Entries moved to the dead-letter stream", ["model"])
COMPUTE_ON_EXPIRED = Counter("batchgate_compute_on_expired_total",
                             "Requests whose compute started after their deadline (FIFO baseline only)", ["model"])
PREEMPTIONS = Counter("batchgate_preemptions_total", "Batch-priority rows preempted for interactive work", ["model"])
HANDED_TO_PEERS = Counter("batchgate_handed_to_peers_total",
                          "Waiting requests handed back to the stream for a less loaded worker", ["model"])
