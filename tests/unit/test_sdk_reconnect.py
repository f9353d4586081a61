"""The SDK resumes a dropped event stream over a budget of doubling pauses, counted afresh after each event: long
enough for a gateway that tells its streams to reconnect and exits seconds later, then comes back (a user's probe:
five tries 0.2 s apart gave up after a second)."""

from __future__ import annotations

import httpx
import pytest

from shared.sdk import BatchgateClient
from shared.sdk import client as sdk_client
from shared.sdk.errors import Unavailable
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
