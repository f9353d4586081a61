"""vLLM's bad_words as token sequences, and which token each bans next (pure: a stand-in tokenizer)."""

from __future__ import annotations

from gpu_worker.bad_words import always_banned, bad_word_ids, banned_after, banned_next, by_prefix_end, longest_prefix

VOCAB = {"hello": [1, 2], " hello": [3, 2], "bye": [4], " bye": [5, 6], "ok": [7], " ok": [7], "  ": []}


def encode(text: str) -> list[int]:
    return VOCAB.get(text, [])


def test_a_word_is_tokenized_as_it_is_and_after_a_space_where_that_is_a_new_first_token_of_its_length():
    assert bad_word_ids(["hello"], encode) == ((1, 2), (3, 2))
    assert bad_word_ids(["  hello"], encode) == ((1, 2), (3, 2))  # leading spaces are dropped first
    assert bad_word_ids(["bye"], encode) == ((4,),)  # the spaced form is longer: vLLM leaves it out
    assert bad_word_ids(["ok"], encode) == ((7,),)  # the same first token: once
    assert bad_word_ids(["  ", "ok"], encode) == ((7,),)  # no token spells it: nothing to ban
    assert bad_word_ids([], encode) == ()


def test_a_words_last_token_is_banned_where_the_output_ends_with_the_rest():
    words = ((1, 2), (4,), (8, 9, 10))
    assert longest_prefix(words) == 2 and longest_prefix(((4,),)) == 0 and longest_prefix(()) == 0
    assert banned_next(words, []) == [4]  # a one-token word: always
    assert banned_next(words, [5, 1]) == [2, 4]
    assert banned_next(words, [1, 5]) == [4]
    assert banned_next(words, [8]) == [4]  # too short for its prefix
    assert banned_next(words, [8, 9]) == [4, 10]
    assert banned_next(words, [9, 9]) == [4]
    assert banned_next(words, [7, 8, 9]) == [4, 10]  # more of the output than the words need


def test_a_step_looks_only_at_the_words_whose_prefix_ends_with_the_last_token():
    words = ((1, 2), (4,), (8, 9, 10), (5, 9, 11), (3,))
    assert always_banned(words) == [3, 4] and always_banned(((1, 2),)) == []
    index = by_prefix_end(words)
    assert index == {1: [(1, 2)], 9: [(8, 9, 10), (5, 9, 11)]}
    assert banned_after(index, []) == [] and banned_after(index, [2]) == []
    assert banned_after(index, [5, 9]) == [11] and banned_after(index, [0, 8, 9]) == [10]
    assert banned_after(index, [9]) == []  # too short for the prefixes that end with it
