"""Cutting a generation at its stop string: text and token ids end before it (pure, a fake tokenizer)."""

from __future__ import annotations

import pytest

from gpu_worker.sequences import Row
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


@pytest.mark.parametrize(("ids", "after", "text", "kept"), [
    # min_tokens 3: the "\n" of the second token is kept; the one the fourth completes cuts
    ([1, 8, 2, 6, 4], 3, "Helx\nlo", [1, 8, 2]),
    # the first token past them completes one: it counts
    ([1, 2, 4, 6], 3, "Hello wor", [1, 2, 4]),
    # one the min_tokens-th token completes does not (vLLM's)
    ([1, 2, 6, 4], 3, "Hello\n wor", [1, 2, 6, 4]),
    # a stop string begun within them and completed past them: cut where it begins
    ([1, 2, 6, 7], 3, "Hello", [1, 2]),
    # one completed within them, whole in one token: kept
    ([1, 2, 9, 4], 3, "Hello\nEND wor", [1, 2, 9, 4]),
    # none completed past them: unchanged
    ([6, 1, 2], 3, "\nHello", [6, 1, 2]),
    ([6, 1], 1, "\nHel", [6, 1]),
    # 0: any occurrence counts, as without min_tokens
    ([6, 1], 0, "", []),
])
def test_cut_after_min_tokens(ids, after, text, kept):
    stops = ["\n", "\nEND"]
    assert cut_at_stop(ids, stops, decode, after=after) == (text, kept)


def _row(tokens: list[int], min_tokens: int, **spec) -> Row:
    from gpu_worker.sequences import GenSpec, Row, SamplingParams

    return Row(spec=GenSpec("r", (1,), max_new_tokens=6, sampling=SamplingParams(min_tokens=min_tokens), **spec),
               start=0, tokens=tokens, generator=None, admitted_at=0.0, prefill_s=0.0, first_token_at=0.0)


def test_below_min_tokens_nothing_but_the_length_or_a_complete_grammar_ends_a_row():
    from types import SimpleNamespace

    from gpu_worker.sequences import finish_reason

    ends = {"eos_ids": frozenset({7}), "stop_ids": frozenset({3}), "stop": ("\n",)}
    for last in (7, 3, 6):  # EOS, a stop token, a stop string
        assert finish_reason(_row([1, last], 3, **ends), decode) is None
    # with min_tokens' own token: vLLM's check for EOS and stop tokens (which the sampler bans there), not for a
    # stop string, which a token past them must complete
    assert finish_reason(_row([1, 2, 7], 3, **ends), decode) is FinishReason.EOS
    assert finish_reason(_row([1, 2, 3], 3, **ends), decode) is FinishReason.STOP
    assert finish_reason(_row([1, 2, 6], 3, **ends), decode) is None
    assert finish_reason(_row([1, 2, 4, 6], 3, **ends), decode) is FinishReason.STOP
    assert finish_reason(_row([1, 2, 6, 2, 6, 7], 6, stop=("\n",)), decode) is FinishReason.LENGTH
    grammar = SimpleNamespace(failed=None, done=True)
    assert finish_reason(_row([1, 2], 3, constraint=grammar), decode) is FinishReason.STOP
    # a grammar row bans nothing for min_tokens: an EOS it draws (its grammar complete) ends it as an EOS does
    assert finish_reason(_row([1, 7], 3, constraint=grammar, **ends), decode) is FinishReason.EOS


def test_past_min_tokens_a_stop_string_ends_a_row_where_its_latest_token_completes_it():
    from gpu_worker.sequences import finish_reason

    # the "\n" of the first token was below min_tokens: it does not end the row later
    assert finish_reason(_row([6, 1, 2], 2, stop=("\n",)), decode) is None
    assert finish_reason(_row([6, 1, 2, 6], 2, stop=("\n",)), decode) is FinishReason.STOP  # another one does
    assert finish_reason(_row([6, 1, 2, 9], 2, stop=("\nEND",)), decode) is FinishReason.STOP
    assert finish_reason(_row([6, 1], 0, stop=("\n",)), decode) is FinishReason.STOP  # off: any occurrence


@pytest.mark.parametrize(("ids", "stops", "text", "kept"), [
    ([1, 2, 3, 6], ["\n"], "Hello,\n", [1, 2, 3, 6]),  # the stop string kept, with its token
    ([1, 2, 8], ["\n"], "Hellox\n", [1, 2, 8]),
    ([1, 2, 9, 1], ["\n"], "Hello\n", [1, 2, 9]),  # the ids through the token completing it, past it or not
    ([1, 2, 9], ["\nEND", "\n"], "Hello\n", [1, 2, 9]),  # the text through the first to complete
    ([1, 6, 4, 6], ["\n"], "Hel\n", [1, 6]),  # the earliest
])
def test_cut_with_the_stop_string_included(ids, stops, text, kept):
    assert cut_at_stop(ids, stops, decode, include=True) == (text, kept)
    assert cut_at_stop([1, 6, 2, 6], ["\n"], decode, after=2, include=True) == ("Hel\nlo\n", [1, 6, 2, 6])


def test_a_stop_string_overlapping_one_within_min_tokens_still_ends_the_row():
    """"\n\n" within the first min_tokens, then a "\n" that makes another with the last of them: it ends the row
    (vLLM looks for it from where the new text could begin it), as the cut finds it."""
    from gpu_worker.sequences import completes_stop, finish_reason

    assert completes_stop("a\n\n\n", "a\n\n", ["\n\n"]) and not completes_stop("a\n\nb", "a\n\n", ["\n\n"])
    row = _row([1, 6, 6, 6], 3, stop=("\n\n",))  # "Hel", then three "\n": the third completes one past min_tokens
    assert finish_reason(row, decode) is FinishReason.STOP
    assert cut_at_stop([1, 6, 6, 6], ["\n\n"], decode, after=3) == ("Hel\n", [1, 6])
