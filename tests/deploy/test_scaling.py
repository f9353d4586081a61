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
        assert out == {"deployment": "test-deployment", "backlog": {"minilm": 1, "tiny-llama": 3}, "total": 4}
        now = dt.datetime.now(dt.UTC)
        stats = boto3.client("cloudwatch").get_metric_statistics(
            Namespace="batchgate", MetricName="Backlog",
            Dimensions=[{"Name": "Deployment", "Value": "test-deployment"}],
            StartTime=now - dt.timedelta(minutes=5), EndTime=now + dt.timedelta(minutes=1), Period=60,
            Statistics=["Maximum"])
        assert [p["Maximum"] for p in stats["Datapoints"]] == [4.0]
    sys.modules.pop("gateway.scaling_handler", None)
