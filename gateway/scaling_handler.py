"""AWS Lambda entry point for worker autoscaling, run every minute by an EventBridge schedule.

It reads the backlog of every model (entries in its lane streams: waiting, plus taken by a worker and
not yet acknowledged) and publishes it to CloudWatch as `Backlog` (namespace `batchgate`, dimension
`Deployment`, and once more per `Model`). The workers' Auto Scaling group tracks backlog per
in-service instance, and a step policy starts the first instance when there is a backlog and no
worker: the case a metric published by the workers themselves could never see.

The workers also run the webhook dispatcher and the Batch API's runner. Work of theirs with nothing in the lanes
(a webhook's retries, a batch not yet submitted or finalized) counts as a backlog of one for the deployment, so
that one worker runs while it lasts: scaled to zero, retries would wait for the next request, and a batch created
through the gateway would never start.

No torch; the Redis client and the CloudWatch client are created once per container.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import boto3
import redis

from shared.config import Settings
from shared.keys import Keys
from shared.logs import configure_logging
from shared.redis_io import make_sync_redis

SETTINGS = Settings.from_environ()
configure_logging(SETTINGS.log_level, "json")
NAMESPACE = SETTINGS.metric_namespace
DEPLOYMENT = SETTINGS.deployment
REDIS = make_sync_redis(SETTINGS.redis_url, socket_timeout=5, socket_connect_timeout=5, retry_on_timeout=True,
                        health_check_interval=30)
CLOUDWATCH = boto3.client("cloudwatch", endpoint_url=SETTINGS.cloudwatch_endpoint or None)


def read_backlog(client: redis.Redis, settings: Settings) -> dict[str, int]:
    """Entries in each model's lane streams, in one round trip (acked entries are deleted, so the
    length is what is waiting or being worked on)."""
    keys = Keys(settings.key_prefix)
    pipe = client.pipeline(transaction=False)
    streams = [(m.name, s) for m in settings.models for s in keys.lane_streams(m.name, m.lane_names)]
    for _, stream in streams:
        pipe.xlen(stream)
    counts: dict[str, int] = {m.name: 0 for m in settings.models}
    for (model, _), n in zip(streams, pipe.execute(), strict=True):
        counts[model] += int(n)
    return counts


def read_upkeep(client: redis.Redis, settings: Settings) -> int:
    """The workers' other work: webhook deliveries queued or scheduled (the callback stream's entries are deleted
    once scheduled, a scheduled one once it is done) and batches still active."""
    keys = Keys(settings.key_prefix)
    pipe = client.pipeline(transaction=False)
    pipe.xlen(keys.callback_stream())
    pipe.zcard(keys.callback_due())
    pipe.zcard(keys.batches_active())
    return sum(int(n) for n in pipe.execute())


def metric_data(counts: Mapping[str, int], deployment: str, upkeep: int = 0) -> list[dict[str, Any]]:
    """The CloudWatch datapoints: the deployment's total (at least 1 while the workers have `upkeep`), then one per
    model."""
    base = [{"Name": "Deployment", "Value": deployment}]
    total = max(sum(counts.values()), 1 if upkeep else 0)
    data = [{"MetricName": "Backlog", "Dimensions": base, "Value": float(total), "Unit": "Count"}]
    data += [{"MetricName": "Backlog", "Dimensions": [*base, {"Name": "Model", "Value": model}],
              "Value": float(n), "Unit": "Count"} for model, n in sorted(counts.items())]
    return data


def handler(event: Any, context: Any) -> dict[str, Any]:
    counts = read_backlog(REDIS, SETTINGS)
    upkeep = read_upkeep(REDIS, SETTINGS)
    data = metric_data(counts, DEPLOYMENT, upkeep)
    for i in range(0, len(data), 1000):  # PutMetricData takes at most 1000 datapoints per call
        CLOUDWATCH.put_metric_data(Namespace=NAMESPACE, MetricData=data[i:i + 1000])
    return {"deployment": DEPLOYMENT, "backlog": counts, "total": sum(counts.values()), "upkeep": upkeep}
