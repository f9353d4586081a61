"""What the generation engine is given and gives back, without torch: a sequence to generate, its
sampling parameters, its result, and the engine's running counters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.states import FinishReason

MIN_TEMPERATURE = 1e-4

# a token's log probability and the likeliest alternatives' (token id, log probability), likeliest first
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # the model's `generation_config.repetition_penalty`, as `generate` applies it (greedy or sampled): every token
    # of the sequence so far, prompt included, has its logit divided by it (multiplied, if negative)
    repetition_penalty: float = 1.0
    # OpenAI's: every token the output holds so far has its logit lowered by `presence_penalty`, and by
    # `frequency_penalty` once per time it occurs (the prompt's tokens are not counted)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's logit_bias
    logprobs: int | None = None  # each token's log probability and this many likeliest alternatives; None: none
    prompt_logprobs: int | None = None  # the same for each prompt token (the first: None); None: none
    min_p: float = 0.0  # tokens less likely than this fraction of the likeliest are dropped (after temperature)
    # vLLM's min_tokens, of this row's own tokens: until it holds this many, its EOS and stop tokens are banned
    # (`sampling.Penalties` holds which); 0: off
    min_tokens: int = 0
    # vLLM's allowed_token_ids: every other token is banned; None: off
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's bad_words as token sequences (`gpu_worker.bad_words`): each one's last token is banned after the rest
    bad_words: tuple[tuple[int, ...], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE  # tiny temperatures overflow the softmax: greedy is the limit

    # whether any bias or penalty applies: read for every row at every step, so worked out once
    penalized: bool = field(init=False, compare=False, repr=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "penalized", self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                           or self.frequency_penalty != 0.0 or bool(self.logit_bias) or self.min_tokens > 0
                           or self.allowed_token_ids is not None or bool(self.bad_words))


@dataclass(frozen=True, slots=True)
class GenSpec:
    """What the engine needs to generate one sequence."""

    id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()
    stop_ids: frozenset[int] = frozenset()  # the request's own stop tokens (finish_reason stop, kept in the output)
    # banned below the sampling's min_tokens: the model's EOS (ignore_eos or not, as vLLM's) and the stop tokens
    ends: frozenset[int] = frozenset()
    # how its output reads where the engine's own reading is not the caller's (special tokens spelled, a tool
    # parser's kept): its stop strings are looked for in the text its caller gets
    decode: Callable[[list[int]], str] | None = None
    owner: Any = None  # the caller's object for this sequence (the worker's Job), handed back in the result
    # the last `resumed` of `prompt_ids` are output already (a streamed request run again continues after what
    # its caller was sent): output for the presence and frequency penalties
    resumed: int = 0
    # its structured output's grammar state (`gpu_worker.constraints.Constraint`): a spec is built per admission
    constraint: Any = None
    stop_tail: int = field(init=False, default=0)  # the last tokens to decode to see a stop string whole

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_tail", stop_tail_tokens(self.stop))

    def history(self, tokens: Sequence[int] = ()) -> tuple[Sequence[int], Sequence[int]]:
        """(prompt, output so far) with `tokens` generated: what the penalties read."""
        cut = len(self.prompt_ids) - self.resumed
        return self.prompt_ids[:cut], (*self.prompt_ids[cut:], *tokens)

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens


@dataclass(slots=True)
class GenResult:
    id: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # from prefill start to the first token
    decode_s: float = 0.0  # from the first token to the last
    admitted_at: float = 0.0
    owner: Any = None
    logprobs: list[TokenLogprob] | None = None  # one per token of `token_ids`, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first None), when asked


@dataclass(slots=True)
class EngineStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    forward_s: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    prefill_padded_tokens: int = 0
    decode_tokens: int = 0
    kv_real: int = 0  # sum over steps of the real tokens attended
    kv_padded: int = 0  # sum over steps of the cache positions attended
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def kv_padding_fraction(self) -> float:
        return 1.0 - self.kv_real / self.kv_padded if self.kv_padded else 0.0


class EngineFull(RuntimeError):
    """Raised when asked to prefill beyond the engine's row or width capacity (a scheduler bug)."""


def group_by_length(lengths: list[int], tolerance: float, alone: Sequence[bool] = ()) -> list[list[int]]:
    """Indices grouped (longest first) so each group's padding stays within `tolerance` of its width; an index
    flagged `alone` is a group of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if alone and alone[i]:
            continue
        if groups:
            g = groups[-1]
            width = lengths[g[0]]
            padded = width * (len(g) + 1)
            real = sum(lengths[j] for j in g) + lengths[i]
            if padded - real <= tolerance * padded:
                g.append(i)
                continue
        groups.append([i])
    return groups + [[i] for i in order if alone and alone[i]]


@dataclass(slots=True)
class Row:
    """A sequence in the running batch: its tokens so far and where its cache starts."""

    spec: GenSpec
    start: int
    tokens: list[int]
    generator: Any  # a torch.Generator of its own when sampling, else None
    admitted_at: float
    prefill_s: float
    first_token_at: float
    penalties: Any = None  # its `sampling.Penalties` when it has a bias or a penalty
    logprobs: list[TokenLogprob] | None = None  # one per token of `tokens`, when its sampling asks for them


def stop_tail_tokens(stop: tuple[str, ...]) -> int:
    """How many of a row's last tokens to decode to see every stop string whole: a token spells at least one
    byte (byte-level BPE, SentencePiece's byte fallback), so a stop string of B bytes spans at most B tokens,
    one more on each side where a token straddles it; counting characters misses one of multibyte characters
    (an emoji is 4 tokens of a byte-level vocabulary)."""
    return max((len(s.encode("utf-8")) for s in stop), default=0) + 8


def finish_reason(row: Row, decode_tail: Callable[[list[int]], str] | None) -> FinishReason | None:
    """Why `row` is done after its latest token (None: not done): EOS, its structured output complete, a stop
    string in the decoded tail, or its length. Below its `min_tokens`, neither EOS, a stop token nor a stop string
    ends it (its EOS and stop tokens are banned there); a stop string ends it only where a token past them completes
    it (vLLM's: a later token does not end it for one the first `min_tokens` hold)."""
    spec = row.spec
    if spec.constraint is not None and spec.constraint.failed:  # drawn unmasked: never a complete answer
        return FinishReason.ERROR
    short = len(row.tokens) < spec.sampling.min_tokens
    if row.tokens[-1] in spec.eos_ids and (not short or spec.constraint is not None):  # a grammar row bans none
        return FinishReason.EOS
    if row.tokens[-1] in spec.stop_ids and not short:  # before stop strings, as vLLM checks them
        return FinishReason.STOP
    if spec.constraint is not None and spec.constraint.done:  # its grammar takes no more tokens: complete
        return FinishReason.STOP
    decode = spec.decode or decode_tail
    if spec.stop and decode is not None and len(row.tokens) > spec.sampling.min_tokens:
        tail = decode(row.tokens[-spec.stop_tail:])
        if spec.sampling.min_tokens == 0 and any(s in tail for s in spec.stop):
            return FinishReason.STOP
        if spec.sampling.min_tokens and completes_stop(tail, decode(row.tokens[-spec.stop_tail:-1]), spec.stop):
            return FinishReason.STOP
    if len(row.tokens) >= spec.max_new_tokens:
        return FinishReason.LENGTH
    return None


def completes_stop(text: str, before: str, stops: Sequence[str]) -> bool:
    """The latest token (`text` is `before` with it) completes an occurrence of one of `stops`: one that ends past
    `before`, overlapping what it holds or not (a row with min_tokens was not stopped by those it holds already)."""
    return any(s and text.find(s, max(0, len(before) - len(s) + 1)) >= 0 for s in stops)
