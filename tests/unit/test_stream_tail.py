"""What of a final output an event stream still owes its caller (`shared.events._Cursor`): pure, every case."""

from __future__ import annotations

from shared.events import _Cursor
from shared.messages import StreamDelta


def test_text_cut_inside_the_first_token_still_reaches_a_fresh_caller():
    # a stop string cut inside the first token: the token is left out, its text before the cut is the output
    ev = _Cursor().tail({"text": " s", "token_ids": []})
    assert ev is not None and ev.data == {"index": 0, "text": " s", "token_ids": []}


def test_the_tail_is_what_no_delta_carried():
    cur = _Cursor()
    cur.take(StreamDelta(start=0, token_ids=(5, 6), text="ab"))
    ev = cur.tail({"text": "abc", "token_ids": [5, 6]})  # "c" was held back (a possible stop string), then released
    assert ev is not None and ev.data == {"index": 2, "text": "c", "token_ids": []} and ev.id == "2"
    assert cur.tail({"text": "abc", "token_ids": [5, 6]}) is None  # nothing is sent twice


def test_nothing_owed_when_everything_was_sent_or_the_output_is_empty():
    cur = _Cursor()
    cur.take(StreamDelta(start=0, token_ids=(5,), text="a"))
    assert cur.tail({"text": "a", "token_ids": [5]}) is None
    assert _Cursor().tail({"text": "", "token_ids": []}) is None
    assert _Cursor().tail(None) is None and _Cursor().tail({"vector": [0.1]}) is None


def test_a_caller_that_reconnected_with_every_token_is_not_sent_them_again():
    cur = _Cursor(skip_to=2)
    assert cur.take(StreamDelta(start=0, token_ids=(5, 6), text="ab")) is None
    assert cur.tail({"text": "ab", "token_ids": [5, 6]}) is None
