"""Content negotiation on `Accept` (`gateway.api.negotiate`, `wants_events`, `ApiResponse.render`): q-values,
specificity, the server's order; pure."""

from __future__ import annotations

import pytest

from gateway.api import EVENT_STREAM, ApiResponse, negotiate, wants_events

JSON, MSGPACK = "application/json", "application/msgpack"


@pytest.mark.parametrize(("accept", "offers", "expected"), [
    (None, (JSON, MSGPACK), JSON),
    ("", (JSON, MSGPACK), JSON),
    ("*/*", (JSON, MSGPACK), JSON),  # a tie: the server's order
    (MSGPACK, (JSON, MSGPACK), MSGPACK),
    ("application/msgpack, */*", (JSON, MSGPACK), MSGPACK),  # named outright beats a wildcard
    ("application/msgpack;q=0.5, application/json", (JSON, MSGPACK), JSON),
    ("application/json;q=0.2, application/msgpack;q=0.9", (JSON, MSGPACK), MSGPACK),
    ("application/*;q=0.3, application/msgpack;q=0", (JSON, MSGPACK), JSON),  # the most specific range rules
    ("text/html", (JSON, MSGPACK), JSON),  # nothing acceptable: the first offer, not a 406
    ("application/msgpack;q=abc", (JSON, MSGPACK), JSON),  # a bad q counts as 0
    ("APPLICATION/MSGPACK", (JSON, MSGPACK), MSGPACK),
    ("text/*", (JSON, EVENT_STREAM), EVENT_STREAM),
])
def test_negotiate(accept, offers, expected):
    assert negotiate(accept, offers) == expected


@pytest.mark.parametrize(("accept", "stream", "expected"), [
    (None, True, False),  # no header: the 202, events read later
    (None, False, False),
    ("text/event-stream", True, True),
    ("text/event-stream", False, True),  # an EventSource client gets events even without stream: true
    ("text/event-stream, application/json", True, True),
    ("text/event-stream, application/json", False, False),
    ("text/event-stream;q=0", True, False),  # refused outright
    ("application/json, text/event-stream;q=0.5", True, False),
    ("*/*", True, False),  # what most HTTP clients send: the 202
    ("*/*", False, False),
    ("text/*", True, False),
    ("application/json", True, False),
])
def test_wants_events(accept, stream, expected):
    assert wants_events(accept, stream) is expected


def test_render_honours_q_values():
    resp = ApiResponse(200, {"a": 1})
    assert resp.render("application/msgpack;q=0.5, application/json")[1] == JSON
    assert resp.render("application/msgpack")[1] == MSGPACK
    assert resp.render("application/x-msgpack, */*;q=0.1")[1] == MSGPACK
    assert resp.render(None)[1] == JSON
