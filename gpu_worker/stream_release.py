"""What of a streaming row's output may be sent to its caller yet (pure: the tokenizer comes in as a
function).

Tokens are released whole, in order, once the text they add is decided:
- not while the text ends in an incomplete character (a multi-byte character split across tokens
  decodes to U+FFFD until its last byte comes);
- not while the text sent so far plus the new text ends with the beginning of a stop string: if the
  stop string completes, the row stops and that text is never the caller's (`cut_at_stop`); if it
  does not, the held tokens go out with the next step's.
So a delta never needs taking back, and the deltas concatenate to the final output up to what is
held at the end; the final record carries the rest (`shared.events`).

Text is decoded incrementally over a few tokens of context before the new ones (as vLLM and TGI do):
a step costs a decode of a handful of tokens, not of the whole output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.messages import StreamDelta
from shared.params import GenerateParams

CONTEXT_TOKENS = 5  # tokens decoded before the new ones so that word boundaries decode as in the whole text
INCOMPLETE = "\ufffd"


@dataclass(slots=True)
class Release:
    """One streaming row: what was released (tokens, and the end of the text for the stop check)."""

    stops: tuple[str, ...]
    released: list[int] = field(default_factory=list)  # output tokens released, in order
    tail: str = ""  # the last characters released, as long as the longest stop string
    first: bool = True  # no delta published by this attempt yet
    base: int = 0  # released tokens the running row was started after (they are part of its prompt)
    prompt: int | None = None  # the request's prompt tokens (its caller's usage counts them), told with each delta
    prompt_ids: tuple[int, ...] | None = None  # with `params.echo`: the prompt's ids, told with the first delta
    keep: int = field(init=False)

    def __post_init__(self) -> None:
        self.keep = max((len(s) for s in self.stops), default=0)

    @classmethod
    def of(cls, params: GenerateParams, streamed: Sequence[int], prompt: Sequence[int]) -> Release:
        """A streaming request's: after what its caller was sent (`streamed`), telling its `prompt`'s size (and
        with `params.echo` its ids)."""
        return cls(params.stop, released=list(streamed), prompt=len(prompt),  # (a tuple once parsed)
                   prompt_ids=tuple(prompt) if params.echo else None)

    @property
    def sent(self) -> int:
        return len(self.released)

    def restart(self) -> tuple[int, ...]:
        """The row starts (again) after what was released: those tokens join its prompt."""
        self.base = len(self.released)
        return tuple(self.released)

    def output(self, row_tokens: list[int]) -> list[int]:
        """The request's output so far: what the row was started after, then the row's own tokens."""
        return self.released[:self.base] + row_tokens


def holds_stop_start(text: str, stops: Sequence[str]) -> bool:
    """`text` ends with the beginning (not the whole) of one of `stops`."""
    return any(text.endswith(s[:k]) for s in stops for k in range(1, len(s)) if s)


def next_delta(rel: Release, tokens: Sequence[int], decode: Callable[[list[int]], str]) -> StreamDelta | None:
    """The tokens of `tokens` (the row's whole output so far) to release now, or None to hold them."""
    if len(tokens) <= rel.sent:
        return None
    lo = max(0, rel.sent - CONTEXT_TOKENS)
    before = decode(list(tokens[lo:rel.sent])) if rel.sent > lo else ""
    window = decode(list(tokens[lo:]))
    if not window.startswith(before) or window.endswith(INCOMPLETE):
        return None
    text = window[len(before):]
    if rel.stops and holds_stop_start(rel.tail + text, rel.stops):
        return None
    delta = StreamDelta(start=rel.sent, token_ids=tuple(tokens[rel.sent:]), text=text, prompt_tokens=rel.prompt,
                        prompt_token_ids=rel.prompt_ids if rel.first else None)
    rel.released.extend(tokens[rel.sent:])
    if rel.keep:
        rel.tail = (rel.tail + text)[-rel.keep:]
    return delta
