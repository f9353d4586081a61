"""Cutting a generation at its stop string: text and token ids end before it (pure, a fake tokenizer)."""

from __future__ import annotations

import pytest

from gpu_worker.stop_strings import cut_at_stop
from shared.states import FinishReason

# token id -> its text; several tokens are longer than one character, so a stop string can start inside one
VOCAB = {1: "Hel", 2: "lo", 3: ",", 4: " wor", 5: "ld", 6: "\n", 7: "END", 8: "x\n", 9: "\nEND", 10: "é"}


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids)


@pytest.mark.parametrize(("ids", "stops", "text", "kept"), [
    # the stop string is a token of its own, last: it goes from both
    ([1, 2, 3, 6], ["\n"], "Hello,", [1, 2, 3]),
    # spelled by two tokens
    ([1, 2, 6, 7], ["\nEND"], "Hello", [1, 2]),
    # inside one token with text before it: that text stays in `text`, the straddling token leaves the ids
    ([1, 2, 8], ["\n"], "Hellox", [1, 2]),
    # the earliest of several stop strings wins, whichever is listed first
    ([1, 4, 5, 3, 6], ["\n", ","], "Hel world", [1, 4, 5]),
    # the stop string at the very start: nothing is left
    ([9, 1], ["\n"], "", []),
    # no stop string in the text (finished for another reason): unchanged
    ([1, 2, 10], ["\n"], "Helloé", [1, 2, 10]),
    # an empty stop string is ignored, not a cut at 0
    ([1, 2], ["", "\n"], "Hello", [1, 2]),
    # no tokens at all
    ([], ["\n"], "", []),
])
def test_cut_at_stop(ids, stops, text, kept):
    got_text, got_ids = cut_at_stop(ids, stops, decode)
    assert (got_text, got_ids) == (text, kept)
    assert decode(got_ids) == got_text[: len(decode(got_ids))]  # the ids always spell a prefix of the text
    assert not any(s and s in decode(got_ids) for s in stops) or got_ids == ids


@pytest.mark.parametrize("stop", ["\U0001F600\U0001F600\U0001F600", "日本語のテキスト", "END", "\n\n"])
def test_a_stop_string_is_seen_however_many_byte_tokens_it_takes(stop):
    """A byte-level vocabulary spells a multibyte character with several tokens: the decoded tail a row is
    checked against must hold the whole stop string, however many bytes it has (three emoji are 12 tokens)."""
    from gpu_worker.sequences import GenSpec, Row, finish_reason

    def byte_decode(ids: list[int]) -> str:  # one token per byte
        return bytes(ids).decode("utf-8", errors="replace")

    tokens = list(b" hello ") + list(stop.encode())
    row = Row(spec=GenSpec("r", (1,), max_new_tokens=1000, stop=(stop,)), start=0, tokens=tokens, generator=None,
              admitted_at=0.0, prefill_s=0.0, first_token_at=0.0)
    assert finish_reason(row, byte_decode) is FinishReason.STOP
    before = Row(spec=row.spec, start=0, tokens=tokens[:-1], generator=None, admitted_at=0.0, prefill_s=0.0,
                 first_token_at=0.0)
    assert finish_reason(before, byte_decode) is None  # one byte short: not yet
