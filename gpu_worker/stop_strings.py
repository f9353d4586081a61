"""Cutting a generation at its stop string, text and tokens alike (pure: the tokenizer comes in as a
function).

The engine stops a row at the step whose token completes a stop string, so the row's last tokens
spell the stop string (and possibly text after it, inside the same token). What the caller gets:
`text` ends right before the first stop string, and `token_ids` is the longest prefix of the
generated tokens whose decoding stays within that text, so the tokens never spell any of the stop
string either. A token that straddles the cut (part of it before the stop string, part inside) is
left out of `token_ids`; its part before the cut is still in `text`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def cut_at_stop(token_ids: list[int], stops: Sequence[str], decode: Callable[[list[int]], str],
                after: int = 0, include: bool = False) -> tuple[str, list[int]]:
    """`(text, token_ids)` cut before the earliest stop string (`include`, vLLM's include_stop_str_in_output: right
    after the first one to complete); unchanged when none occurs. `after` (a request's min_tokens): only a stop
    string that a token past the first `after` completes counts (vLLM's)."""
    text = decode(token_ids)
    floor = len(decode(token_ids[:after])) if after else 0  # an occurrence must end past it
    found = [(i, i + len(s)) for s in stops if s and (i := text.find(s, max(0, floor - len(s) + 1))) >= 0]
    if not found:
        return text, token_ids
    # the stop is found the step it completes, so only the last few tokens lie past the cut: walk back
    keep = len(token_ids)
    if include:  # the text through the first stop string to complete, the ids through the token completing it
        text = text[:min(end for _, end in found)]
        while keep > 1 and len(decode(token_ids[:keep - 1])) >= len(text):
            keep -= 1
        return text, token_ids[:keep]
    text = text[:min(i for i, _ in found)]
    while keep > 0 and not _within(decode(token_ids[:keep]), text):
        keep -= 1
    return text, token_ids[:keep]


def _within(decoded: str, text: str) -> bool:
    return len(decoded) <= len(text) and text.startswith(decoded)
