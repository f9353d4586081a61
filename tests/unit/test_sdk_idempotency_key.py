"""The SDK refuses an Idempotency-Key no header can carry before it sends anything: the caller's mistake is an
`InvalidRequest` (as the gateway and the SDK's direct mode answer it), never an `Unavailable` to retry."""

from __future__ import annotations

import pytest

from shared.sdk.client import AsyncBatchgateClient, BatchgateClient
from shared.sdk.errors import InvalidRequest

BAD = ["a\nb", "", "x" * 256, "tab\there"]


@pytest.mark.parametrize("key", BAD)
def test_the_sync_client_refuses_a_key_no_header_can_carry(key):
    client = BatchgateClient("http://127.0.0.1:9")  # nothing listens: the refusal comes before any connection
    with pytest.raises(InvalidRequest) as err:
        client.submit("m", {"text": "x"}, idempotency_key=key)
    assert err.value.code == "invalid_idempotency_key" and err.value.status == 400


@pytest.mark.parametrize("key", BAD)
async def test_the_async_client_refuses_it_too(key):
    client = AsyncBatchgateClient("http://127.0.0.1:9")
    with pytest.raises(InvalidRequest):
        await client.submit("m", {"text": "x"}, idempotency_key=key)
