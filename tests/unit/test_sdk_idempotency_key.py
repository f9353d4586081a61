"""The SDK refuses an Idempotency-Key no header can carry before it sends anything: the caller's mistake is an
`InvalidRequest` (as the gateway and the SDK's direct mode answer it), never an `Unavailable` to retry."""

from __future__ import annotations

import pytest

from shared.sdk.client import AsyncBatchgateClient, BatchgateClient
from shared.sdk.errors import InvalidRequest, NotFound

BAD = ["a\nb", "", "x" * 256, "tab\there", "ключ", "k1, k2"]  # (a header carries ASCII as it is; a comma joins two)


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


def test_a_value_json_cannot_carry_is_an_invalid_request_before_anything_is_sent():
    """NaN, bytes: the caller's mistake, answered as the gateway answers it (never a raw ValueError or TypeError)."""
    client = BatchgateClient("http://127.0.0.1:9")
    for inp, params in (({"prompt": "x"}, {"temperature": float("nan")}), ({"prompt": b"x"}, None)):
        with pytest.raises(InvalidRequest) as err:
            client.submit("m", inp, params=params)
        assert err.value.code == "invalid_request" and err.value.status == 400


async def test_ids_and_model_names_are_one_path_segment_each():
    """An id or a name from elsewhere cannot change the route or add a query (`x?wait=abc`, `a/../../v1/models`)."""
    import httpx

    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.raw_path.decode())
        return httpx.Response(404, json={"error": {"code": "not_found", "message": "no"}})

    client = AsyncBatchgateClient("http://127.0.0.1:9", transport=httpx.MockTransport(answer))
    for rid in ("x?wait=abc", "req_a/../../v1/models"):
        with pytest.raises(NotFound):
            await client.get(rid)
    with pytest.raises(NotFound):
        await client.submit("m/../x", {"prompt": "x"})
    assert seen == ["/v1/requests/x%3Fwait%3Dabc", "/v1/requests/req_a%2F..%2F..%2Fv1%2Fmodels",
                    "/v1/models/m%2F..%2Fx/requests"]
    await client.aclose()


@pytest.mark.parametrize("key", [*BAD, "a", "k-1", "~ +-./:;", "x" * 255, "a,b", ",", "\x7f", "é"])
def test_the_openapi_documents_pattern_is_the_rule_the_gateway_keeps(key):
    """The documented schema (`KEY_PATTERN`, length 1-255) takes exactly the keys `valid_idempotency_key` takes: it
    allowed commas, which the gateway refuses."""
    import re

    from gateway.openapi import document
    from shared.config import Settings
    from shared.idempotency_keys import KEY_PATTERN, MAX_KEY_CHARS, valid_idempotency_key

    doc = document(Settings())
    schemas = [p["schema"] for path in doc["paths"].values() for op in path.values() if isinstance(op, dict)
               for p in op.get("parameters", []) if p.get("name") == "Idempotency-Key"]
    assert schemas and all(s == {"type": "string", "minLength": 1, "maxLength": MAX_KEY_CHARS,
                                 "pattern": KEY_PATTERN} for s in schemas)
    by_schema = 1 <= len(key) <= MAX_KEY_CHARS and re.fullmatch(KEY_PATTERN.strip("^$"), key) is not None  # ECMA's $
    assert by_schema == valid_idempotency_key(key)
