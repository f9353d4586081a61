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


def test_a_librarys_per_request_info_lines_are_off_and_its_records_are_json_in_json_mode():
    """httpx logs each webhook attempt's URL (a receiver's token in its query string) at INFO: off; any other
    library's record is a JSON line in JSON mode. In a process of its own: logging's set-up is global."""
    import subprocess
    import sys

    code = ("import logging; from shared.logs import configure_logging; configure_logging('info', 'json'); "
            "logging.getLogger('httpx').info('HTTP Request: POST http://x/hook?token=SECRET'); "
            "logging.getLogger('uvicorn.error').info('Uvicorn running on http://127.0.0.1:1')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "SECRET" not in out.stderr
    (line,) = out.stderr.splitlines()
    assert json.loads(line)["event"] == "Uvicorn running on http://127.0.0.1:1"
    assert json.loads(line)["logger"] == "uvicorn.error" and json.loads(line)["level"] == "info"
