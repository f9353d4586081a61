"""Which tokens of a streaming row go to its caller, and when (`gpu_worker.stream_release`)."""

from __future__ import annotations

import random

from gpu_worker.stop_strings import cut_at_stop
from gpu_worker.stream_release import Release, holds_stop_start, next_delta

# a byte-level "tokenizer": each token is some bytes; text is their UTF-8 decoding, U+FFFD where incomplete
VOCAB = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"\xc3", 6: b"\xa9", 7: b"\n", 8: b"EN", 9: b"D", 10: b" "}


def decode(ids: list[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def run(tokens: list[int], stops: tuple[str, ...] = ()) -> tuple[Release, list]:
    rel, deltas = Release(stops), []
    for n in range(1, len(tokens) + 1):
        d = next_delta(rel, tokens[:n], decode)
        if d is not None:
            deltas.append(d)
    return rel, deltas


def test_every_token_goes_out_once_in_order_and_the_texts_add_up():
    tokens = [1, 2, 3, 4, 10, 1]
    rel, deltas = run(tokens)
    assert [t for d in deltas for t in d.token_ids] == tokens
    assert [d.start for d in deltas] == list(range(len(tokens)))
    assert "".join(d.text for d in deltas) == decode(tokens) and rel.released == tokens


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    _, deltas = run([1, 5, 6, 2])
    assert [d.token_ids for d in deltas] == [(1,), (5, 6), (2,)]
    assert "".join(d.text for d in deltas) == "Helélo" and "\ufffd" not in "".join(d.text for d in deltas)


def test_the_beginning_of_a_stop_string_is_held_until_decided():
    # "\nEN" might become "\nEND": held; "\nEN " is not a stop string after all: released with what follows
    _, deltas = run([1, 7, 8, 10, 2], stops=("\nEND",))
    assert [d.token_ids for d in deltas] == [(1,), (7, 8, 10), (2,)]
    # when it completes, nothing of it was sent: the row stops and the record's text ends before it
    tokens = [1, 2, 7, 8, 9]
    _, deltas = run(tokens[:4], stops=("\nEND",))
    sent = "".join(d.text for d in deltas)
    final, final_ids = cut_at_stop(tokens, ("\nEND",), decode)
    assert sent == "Hello" and final.startswith(sent)
    assert final_ids[:sum(len(d.token_ids) for d in deltas)] == [t for d in deltas for t in d.token_ids]


def test_random_outputs_never_send_a_stop_strings_text_and_always_prefix_the_final_output():
    rng = random.Random(7)
    stops = ("\nEND", "lo w")
    for _ in range(300):
        tokens = [rng.choice(list(VOCAB)) for _ in range(rng.randint(1, 12))]
        text = decode(tokens)
        hit = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
        if hit >= 0:  # the engine stops the row at the token completing the stop string
            n = next(n for n in range(1, len(tokens) + 1) if any(s in decode(tokens[:n]) for s in stops))
            tokens = tokens[:n]
        rel, deltas = run(tokens[:-1] if hit >= 0 else tokens, stops)
        sent = "".join(d.text for d in deltas)
        final, final_ids = cut_at_stop(tokens, stops, decode) if hit >= 0 else (decode(tokens), tokens)
        assert final.startswith(sent), (tokens, sent, final)
        assert final_ids[:len(rel.released)] == rel.released
        assert not any(s in sent for s in stops)


def test_a_restarted_row_continues_after_what_was_sent():
    rel = Release((), released=[1, 2])
    assert rel.restart() == (1, 2) and rel.base == 2
    # the new row generates only new tokens; the output is what was sent, then those
    assert rel.output([3]) == [1, 2, 3]
    d = next_delta(rel, rel.output([3]), decode)
    assert d is not None and d.start == 2 and d.token_ids == (3,) and d.text == " wor"


def test_each_delta_tells_the_prompts_tokens():
    """A caller's usage so far (vLLM's continuous_usage_stats) needs the prompt's tokens from the first delta on;
    an older worker's deltas tell none."""
    rel, deltas = Release((), prompt=7), []
    for n in range(1, 4):
        if (d := next_delta(rel, [1, 2, 3][:n], decode)) is not None:
            deltas.append(d)
    assert deltas and all(d.prompt_tokens == 7 for d in deltas)
    assert all(d.prompt_tokens is None for d in run([1, 2])[1])


def test_with_echo_the_first_delta_of_an_attempt_tells_the_prompts_ids():
    from shared.params import GenerateParams

    rel = Release.of(GenerateParams(echo=True), [], [4, 5, 6])
    first = next_delta(rel, [1], decode)
    rel.first = False  # as the runner marks it once published
    later = next_delta(rel, [1, 2], decode)
    assert first is not None and later is not None
    assert (first.prompt_token_ids, first.prompt_tokens, later.prompt_token_ids) == ((4, 5, 6), 3, None)
    plain = Release.of(GenerateParams(), [], [4, 5, 6])
    assert next_delta(plain, [1], decode).prompt_token_ids is None  # not asked: not sent


def test_holds_stop_start():
    assert holds_stop_start("abc\nE", ("\nEND",)) and not holds_stop_start("abc\nEND", ("\nEND",))
    assert not holds_stop_start("abc", ("\nEND",)) and not holds_stop_start("abc", ())
