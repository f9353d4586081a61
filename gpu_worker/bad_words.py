"""vLLM's `bad_words`, without torch: the token sequences a request's words are, and which token each bans next.

A word is tokenized as it is and after a space (its spelling at the start of a text and inside one, where a
tokenizer marks a word's leading space in its first token); the second is kept only where it is a different first
token of the same length, as vLLM's `SamplingParams.update_from_tokenizer` keeps it. A sequence's last token is
banned wherever the output's last tokens are the rest of it: a one-token word always, a longer one once its prefix
is drawn (vLLM's `apply_bad_words`, over the output's tokens, not the prompt's). A step looks only at the words
whose prefix ends with the output's last token (`by_prefix_end`), not at every word.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

BadWordIds = tuple[tuple[int, ...], ...]
MAX_BAD_WORD_TOKENS = 1024  # a request's words' tokens in all (vLLM's GPU model runner's bound)


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


def always_banned(words: BadWordIds) -> list[int]:
    """The one-token words: banned at every step."""
    return sorted({w[0] for w in words if len(w) == 1})


def by_prefix_end(words: BadWordIds) -> dict[int, list[tuple[int, ...]]]:
    """The longer words, by the last token of their prefix: a step where the output ends with another token need
    not look at them."""
    out: dict[int, list[tuple[int, ...]]] = {}
    for w in words:
        if len(w) > 1:
            out.setdefault(w[-2], []).append(w)
    return out


def banned_after(index: dict[int, list[tuple[int, ...]]], tail: Sequence[int]) -> list[int]:
    """The longer words' last tokens the next draw may not be, given the output's last tokens `tail` (at least
    `longest_prefix` of them, or the whole output where it is shorter)."""
    if not tail:
        return []
    return [w[-1] for w in index.get(tail[-1], ()) if len(w) - 1 <= len(tail)
            and tuple(tail[len(tail) - len(w) + 1:]) == w[:-1]]


def banned_next(words: BadWordIds, tail: Sequence[int]) -> list[int]:
    """Every token the next draw may not be (`always_banned` and `banned_after` together)."""
    return sorted({*always_banned(words), *banned_after(by_prefix_end(words), tail)})
