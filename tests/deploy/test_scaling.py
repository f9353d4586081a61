"""The autoscaling Lambda: reads the backlog from the real Redis, publishes it to CloudWatch (moto)."""

from __future__ import annotations

import datetime as dt
import importlib
import sys

import boto3
import pytest
import redis
from moto import mock_aws

from shared.keys import Keys

pytestmark = [pytest.mark.redis]


@pytest.fixture
def aws_env(monkeypatch):
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def test_metric_data_has_the_total_then_one_per_model(aws_env):
    with mock_aws():
        from gateway.scaling_handler import metric_data  # the module makes its clients at import

    data = metric_data({"b": 2, "a": 5}, "prod")
    assert [d["Value"] for d in data] == [7.0, 5.0, 2.0]
    assert data[0]["Dimensions"] == [{"Name": "Deployment", "Value": "prod"}]
    assert data[1]["Dimensions"][1] == {"Name": "Model", "Value": "a"}


def test_the_workers_own_work_keeps_one_worker_with_empty_lanes(aws_env):
    """A webhook's retries or a batch the runner has not finished (both run on the workers) count as a backlog of
    one when the lanes are empty: scaled to zero, retries waited for the next request, and a batch never started."""
    with mock_aws():
        from gateway.scaling_handler import metric_data

    assert metric_data({"a": 0}, "prod", upkeep=3)[0]["Value"] == 1.0
    assert metric_data({"a": 5}, "prod", upkeep=3)[0]["Value"] == 5.0
    assert metric_data({"a": 0}, "prod", upkeep=0)[0]["Value"] == 0.0


def test_the_upkeep_counts_scheduled_webhooks_and_active_batches(redis_url, prefix, monkeypatch, aws_env):
    monkeypatch.setenv("BATCHGATE_REDIS_URL", redis_url)
    monkeypatch.setenv("BATCHGATE_KEY_PREFIX", prefix)
    keys = Keys(prefix)
    client = redis.Redis.from_url(redis_url)
    client.zadd(keys.callback_due(), {"d1": 1, "d2": 2})
    client.zadd(keys.batches_active(), {"batch_1": 1})
    client.close()
    with mock_aws():
        sys.modules.pop("gateway.scaling_handler", None)
        module = importlib.import_module("gateway.scaling_handler")
        out = module.handler({"source": "aws.events"}, None)
    sys.modules.pop("gateway.scaling_handler", None)
    assert out["upkeep"] == 3 and out["total"] == 0


def test_handler_publishes_each_models_backlog(redis_url, prefix, monkeypatch, aws_env):
    monkeypatch.setenv("BATCHGATE_REDIS_URL", redis_url)
    monkeypatch.setenv("BATCHGATE_KEY_PREFIX", prefix)
    monkeypatch.setenv("BATCHGATE_DEPLOYMENT", "test-deployment")
    keys = Keys(prefix)
    client = redis.Redis.from_url(redis_url)
    for lane in ("short", "short", "long"):
        client.xadd(keys.lane_stream("tiny-llama", lane), {"m": b"x"})
    client.xadd(keys.lane_stream("minilm", "short"), {"m": b"x"})
    client.close()
    with mock_aws():
        sys.modules.pop("gateway.scaling_handler", None)
        module = importlib.import_module("gateway.scaling_handler")
        out = module.handler({"source": "aws.events"}, None)
        assert out == {"deployment": "test-deployment", "backlog": {"minilm": 1, "tiny-llama": 3}, "total": 4,
                       "upkeep": 0}
        now = dt.datetime.now(dt.UTC)
        stats = boto3.client("cloudwatch").get_metric_statistics(
            Namespace="batchgate", MetricName="Backlog",
            Dimensions=[{"Name": "Deployment", "Value": "test-deployment"}],
            StartTime=now - dt.timedelta(minutes=5), EndTime=now + dt.timedelta(minutes=1), Period=60,
            Statistics=["Maximum"])
        assert [p["Maximum"] for p in stats["Datapoints"]] == [4.0]
    sys.modules.pop("gateway.scaling_handler", None)
