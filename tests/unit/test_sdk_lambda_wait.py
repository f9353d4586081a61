"""In a Lambda (`lambda_context`), the SDK's waits end with the invocation's time, less its margin, whatever
`timeout` asks; a `result` cut short that way says so (it named the timeout asked, 60 s, after 1 s)."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.sdk.client import AsyncBatchgateClient, BatchgateClient


class Ctx:
    def __init__(self, remaining_ms: int) -> None:
        self._end = time.monotonic() + remaining_ms / 1000

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._end - time.monotonic()) * 1000))


def queued(waits: list[float]):
    def answer(method: str, path: str, params: dict | None = None, **_: object) -> dict:
        waits.append(wait := (params or {}).get("wait", 0.0))
        time.sleep(wait)  # a long-poll that finds it still queued
        return {"id": "req_x", "status": "queued"}
    return answer


def test_a_result_cut_by_the_invocations_end_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    with BatchgateClient("http://127.0.0.1:9", lambda_context=Ctx(1500), deadline_margin_s=0.5) as client:
        monkeypatch.setattr(client, "_request", queued(waits))
        with pytest.raises(TimeoutError, match=r"still queued after [01]\.\d s, the time left in this Lambda invocation"
                                               r" less deadline_margin_s \(not the 60\.0 s asked\)"):
            client.result("req_x", timeout=60.0)
    assert 0.5 <= max(waits) <= 1.0  # the long-poll asked no more than the invocation had left
    with BatchgateClient("http://127.0.0.1:9") as plain:  # no Lambda: the timeout asked
        monkeypatch.setattr(plain, "_request", queued([]))
        with pytest.raises(TimeoutError, match=r"still queued after 0\.0 s$"):
            plain.result("req_x", timeout=0.0)


def test_the_async_client_says_it_too(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        client = AsyncBatchgateClient("http://127.0.0.1:9", lambda_context=Ctx(1500), deadline_margin_s=0.5)
        answer = queued([])

        async def request(*args: object, **kwargs: object) -> dict:
            return await asyncio.to_thread(answer, *args, **kwargs)

        monkeypatch.setattr(client, "_request", request)
        with pytest.raises(TimeoutError, match=r"the time left in this Lambda invocation"):
            await client.result("req_x", timeout=60.0)
        await client.aclose()

    asyncio.run(scenario())
