"""The JSON log lines: msgspec renders what structlog's `JSONRenderer` would (the same object once parsed, for
the events batchgate logs), and the timestamp is structlog's ISO 8601 UTC one, to the microsecond."""

from __future__ import annotations

import datetime as dt
import json
import re
import time

import structlog

from shared.logs import UtcTimestamp, render_json


class Opaque:
    def __repr__(self) -> str:
        return "Opaque()"


def test_an_event_renders_as_structlogs_renderer_does():
    event = {"event": "request accepted", "request_id": "req_x", "model": "tiny-llama", "lane": "short",
             "est_tokens": 24, "share": 0.25, "ok": True, "none": None, "items": [1, "two", {"three": 3}],
             "pair": (1, 2), "text": "é ✓ \n \"quoted\"", "object": Opaque()}
    ours = render_json(None, "info", dict(event))
    assert "\n" not in ours  # one line per event
    assert json.loads(ours) == json.loads(structlog.processors.JSONRenderer()(None, "info", dict(event)))


def test_what_json_cannot_hold_is_still_a_line():
    assert json.loads(render_json(None, "info", {"event": "e", "nan": float("nan")})) == {"event": "e", "nan": None}
    assert json.loads(render_json(None, "info", {"event": "e", 7: "a key not a string"})) == {
        "event": "e", "7": "a key not a string"}


def test_the_timestamp_is_iso_utc_to_the_microsecond(monkeypatch):
    stamp = UtcTimestamp()
    for now in (1_764_342_000.0, 1_764_342_000.000001, 1_764_342_000.999999, 1_764_342_001.5, 1_764_342_000.25,
                time.time()):
        monkeypatch.setattr(time, "time", lambda now=now: now)
        text = stamp(None, "info", {})["timestamp"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", text), text
        # structlog's own, to the microsecond (its isoformat drops a zero fraction; float rounding may differ by 1)
        expected = dt.datetime.fromtimestamp(now, dt.UTC)
        assert abs(dt.datetime.fromisoformat(text) - expected) <= dt.timedelta(microseconds=1), (text, expected)
