"""The SDK's direct mode reports a Redis it cannot reach as `Unavailable` (the SDK's retryable error), after
resuming over the reconnect budget as the HTTP client resumes a dropped event stream, not as redis-py's
ConnectionError."""

from __future__ import annotations

import socket

import pytest

from shared.ids import new_request_id
from shared.sdk import AsyncBatchgateClient
from shared.sdk import client as sdk_client
from shared.sdk import direct as direct_mode
from shared.sdk.errors import Unavailable


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_events_from_an_unreachable_redis_raise_unavailable(monkeypatch):
    monkeypatch.setattr(sdk_client, "EVENT_RETRY_S", 0.001)
    monkeypatch.setattr(sdk_client, "EVENT_RETRY_MAX_S", 0.002)
    monkeypatch.setattr(sdk_client, "EVENT_RECONNECT_S", 0.01)
    calls = []
    real = direct_mode.ops.visible

    async def counted(*args, **kw):
        calls.append(1)
        return await real(*args, **kw)

    monkeypatch.setattr(direct_mode.ops, "visible", counted)
    client = AsyncBatchgateClient.direct(f"redis://127.0.0.1:{closed_port()}/0", key_prefix="bgtest-unreachable")
    rid = new_request_id()
    try:
        with pytest.raises(Unavailable, match=f"event stream of {rid} lost"):
            _ = [e async for e in client.events(rid)]
    finally:
        await client.aclose()
    pauses = client._reconnects(None)
    assert len(calls) == 1 + sum(1 for _ in iter(pauses.next_pause, None))  # every pause of the budget, then gives up
