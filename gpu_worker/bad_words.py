"""vLLM's `bad_words`, without torch: the token sequences a request's words are, and which token each bans next.

A word is tokenized as it is and after a space (its spelling at the start of a text and inside one, where a
tokenizer marks a word's leading space in its first token); the second is kept only where it is a different first
token of the same length, as vLLM's `SamplingParams.update_from_tokenizer` keeps it. A sequence's last token is
banned wherever the output's last tokens are the rest of it: a one-token word always, a longer one once its prefix
is drawn (vLLM's `apply_bad_words`, over the output's tokens, not the prompt's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

BadWordIds = tuple[tuple[int, ...], ...]


def bad_word_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> BadWordIds:
    """The token sequences of `words` under `encode` (a tokenizer's, without special tokens)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if not plain:
            continue  # spelled by no token (whitespace alone): nothing to ban
        out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def longest_prefix(words: BadWordIds) -> int:
    """How many of the output's last tokens the words need to see: their longest prefix."""
    return max((len(w) - 1 for w in words), default=0)


def banned_next(words: BadWordIds, tail: Sequence[int]) -> list[int]:
    """The tokens the next draw may not be, given the output's last tokens `tail` (at least `longest_prefix`
    of them, or the whole output where it is shorter)."""
    banned = []
    for w in words:
        prefix = len(w) - 1
        if prefix > len(tail):
            continue
        if prefix == 0 or tuple(tail[len(tail) - prefix:]) == w[:-1]:
            banned.append(w[-1])
    return banned
