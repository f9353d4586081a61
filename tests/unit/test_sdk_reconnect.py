"""The SDK resumes a dropped event stream over a budget of doubling pauses, counted afresh after each event: long
enough for a gateway that tells its streams to reconnect and exits seconds later, then comes back (a user's probe:
five tries 0.2 s apart gave up after a second)."""

from __future__ import annotations

import httpx
import pytest

from shared.sdk import BatchgateClient
from shared.sdk import client as sdk_client
from shared.sdk.errors import NotFound, Unavailable
from shared.sdk.reconnect import Reconnects


def test_pauses_double_to_their_longest_and_stop_at_the_budget() -> None:
    r = Reconnects(0.2, 2.0, 30.0)
    pauses = list(iter(r.next_pause, None))
    assert pauses[:6] == pytest.approx([0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    assert sum(pauses) == pytest.approx(30.0) and max(pauses) == 2.0
    assert r.next_pause() is None
    r.reset()  # an event came
    assert r.next_pause() == pytest.approx(0.2)


@pytest.mark.parametrize("bad", [(0.0, 1.0, 5.0), (1.0, 0.5, 5.0), (0.1, 1.0, -1.0)])
def test_a_policy_that_would_spin_or_never_pause_is_refused(bad: tuple[float, float, float]) -> None:
    with pytest.raises(ValueError):
        Reconnects(*bad)


def test_the_event_stream_survives_a_gateway_gone_for_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream ends after the gateway's `error` event; the gateway then refuses connections for 3 s (longer
    than the old five tries took) and comes back: the client resumes from the last event id and gets the rest."""
    sleeps: list[float] = []
    monkeypatch.setattr(sdk_client.time, "sleep", sleeps.append)
    gone_until = 3.0
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("last-event-id"))
        if len(seen) == 1:
            body = ('event: delta\nid: 2\ndata: {"index": 0, "text": "ab", "token_ids": [1, 2]}\n\n'
                    'event: error\ndata: {"error": {"code": "unavailable", "message": "shutting down"}}\n\n')
            return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})
        if sum(sleeps) < gone_until:
            raise httpx.ConnectError("connection refused")
        body = 'event: done\nid: 3\ndata: {"id": "r", "status": "succeeded"}\n\n'
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    client = BatchgateClient("http://gw.test", api_key="k", transport=httpx.MockTransport(handler))
    events = [e.event for e in client.events("r")]
    assert events == ["delta", "error", "done"]
    assert seen[-1] == "2" and sum(sleeps) >= gone_until  # resumed after its last event, past the old 1 s


def test_the_event_stream_gives_up_once_the_budget_is_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    monkeypatch.setattr(sdk_client.time, "sleep", sleeps.append)

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    client = BatchgateClient("http://gw.test", api_key="k", transport=httpx.MockTransport(handler))
    with pytest.raises(Unavailable, match="event stream of r lost"):
        list(client.events("r"))
    assert sum(sleeps) == pytest.approx(sdk_client.EVENT_RECONNECT_S)


def test_only_progress_starts_the_count_again() -> None:
    """An event id past the last one, or a new status, is progress; the status each connection opens with, the
    id the caller resumed from, or an event with no id is not."""
    r = Reconnects(1.0, 1.0, 2.0).resume_from("5")
    assert r.next_pause() == 1.0
    r.progress("5")  # the resumed-from id again: nothing new
    assert r.next_pause() == 1.0 and r.next_pause() is None
    r.progress("6")
    assert r.next_pause() == 1.0  # new tokens: a fresh budget
    r.progress("6", "queued")  # the first status: news
    assert r.next_pause() == 1.0 and r.next_pause() == 1.0
    r.progress("6", "queued")  # the same status, as each reconnect opens with it: not
    r.progress(None)
    assert r.next_pause() is None
    r.progress("6", "running")
    assert r.next_pause() == 1.0


def test_a_gateway_that_answers_and_drops_at_once_cannot_keep_the_caller_forever(monkeypatch) -> None:
    """Each connection gets the status every stream opens with, then ends cleanly without `done` (a gateway shutting
    down over and over, a proxy closing streams): the client pauses between tries and gives up once the budget is
    spent (it reconnected at once and counted the repeated status as an event: forever)."""
    sleeps: list[float] = []
    monkeypatch.setattr(sdk_client.time, "sleep", sleeps.append)
    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        assert len(calls) < 1000, "reconnecting forever"
        body = 'event: status\nid: 0\ndata: {"id": "r", "status": "queued"}\n\n'
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    client = BatchgateClient("http://gw.test", api_key="k", transport=httpx.MockTransport(handler))
    with pytest.raises(Unavailable, match="ended before its done event") as err:
        list(client.events("r"))
    assert err.value.code == "stream_lost" and min(sleeps) > 0
    assert sum(sleeps) == pytest.approx(sdk_client.EVENT_RECONNECT_S)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_load_balancer_s_502_and_a_gateway_s_503_are_resumed_through(monkeypatch, asynchronous: bool) -> None:
    """Between gateways, a load balancer answers a 502 with an HTML page and a starting gateway a 503: both are
    waited through as a dropped connection is (the HTML page raised JSONDecodeError, the 503 ended the stream)."""
    import asyncio

    sleeps: list[float] = []

    async def asleep(s: float) -> None:
        sleeps.append(s)

    monkeypatch.setattr(sdk_client.time, "sleep", sleeps.append)
    monkeypatch.setattr(sdk_client.asyncio, "sleep", asleep)
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("last-event-id"))
        sse = {"content-type": "text/event-stream"}
        if len(seen) == 1:
            return httpx.Response(200, text='event: delta\nid: 2\ndata: {"index": 0, "text": "ab", "token_ids": [1, 2]}'
                                             '\n\n', headers=sse)
        if len(seen) == 2:
            return httpx.Response(502, text="<html><body>502 Bad Gateway</body></html>",
                                  headers={"content-type": "text/html"})
        if len(seen) == 3:
            return httpx.Response(503, json={"error": {"code": "unavailable", "message": "queue unreachable"}})
        return httpx.Response(200, text='event: done\nid: 3\ndata: {"id": "r", "status": "succeeded"}\n\n', headers=sse)

    transport = httpx.MockTransport(handler)
    if asynchronous:
        async def read() -> list[str]:
            async with sdk_client.AsyncBatchgateClient("http://gw.test", transport=transport) as client:
                return [e.event async for e in client.events("r")]
        events = asyncio.run(read())
    else:
        events = [e.event for e in BatchgateClient("http://gw.test", transport=transport).events("r")]
    assert events == ["delta", "done"] and seen == [None, "2", "2", "2"] and len(sleeps) == 3


def test_an_error_the_caller_must_handle_is_not_retried(monkeypatch) -> None:
    monkeypatch.setattr(sdk_client.time, "sleep", lambda s: pytest.fail("retried a 404"))

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"code": "not_found", "message": "no request r"}})

    client = BatchgateClient("http://gw.test", transport=httpx.MockTransport(handler))
    with pytest.raises(NotFound):
        list(client.events("r"))


def test_reconnect_s_zero_never_resumes(monkeypatch) -> None:
    monkeypatch.setattr(sdk_client.time, "sleep", lambda s: pytest.fail("resumed"))

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    client = BatchgateClient("http://gw.test", transport=httpx.MockTransport(handler), reconnect_s=0)
    with pytest.raises(Unavailable, match="lost"):
        list(client.events("r"))
    with pytest.raises(ValueError, match="reconnect_s"):
        BatchgateClient("http://gw.test", reconnect_s=-1)
