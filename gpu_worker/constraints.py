"""Structured output on the engine's logits (`params.response_format`, see `shared.structured_output`).

`Grammars` compiles a request's format against the model's tokenizer once, when the request is prepared; each
time the request joins the running batch its row gets a `Constraint` of its own: a copy of that matcher,
advanced over any output its caller was already sent. Each step, `mask` sets every token the grammar does not
allow next to -inf (after the bias and penalties, before greedy or sampled choice), and `accept` advances the
matcher over the chosen token; a row whose grammar can take no more tokens is done (`finish_reason` stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
import torch
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from shared.structured_output import ResponseFormat, grammar_of, one_line, reason_of

log = structlog.get_logger(__name__)

# llguidance's limits, tighter than its defaults where they bound a step: a mask that would take more lexer work
# than this fails its row (about 10 ms of it) instead of stalling every row's step
LIMITS = LLParserLimits(step_lexer_fuel=150_000, initial_lexer_fuel=500_000)  # worst mask seen: ~0.3 s


class Constraint:
    """One row's grammar state. A grammar llguidance cannot follow after all (a limit of its lexer or parser met
    with this tokenizer, where the gateway's check had none) leaves the row `failed`: it ends at once, and its
    request fails with llguidance's reason, never passing for a complete answer."""

    __slots__ = ("failed", "matcher")

    def __init__(self, matcher: LLMatcher, failed: str | None = None) -> None:
        self.matcher, self.failed = matcher, failed

    def mask(self, row: torch.Tensor) -> None:
        """Every token the grammar does not allow next gets -inf in `row` (one row of float logits, in place).
        Ids beyond the tokenizer's (a padded embedding) are never allowed."""
        try:
            bias = self.matcher.compute_logit_bias()
        except BaseException as exc:  # a panic in llguidance's Rust: the row fails, not the step
            self.failed = reason_of(exc)
            return
        if self._check():
            return
        n = min(len(bias), row.shape[-1])
        allowed = torch.frombuffer(bytearray(bias[:n]), dtype=torch.uint8)
        row[n:] = float("-inf")
        row[:n].masked_fill_(allowed.to(row.device, non_blocking=True) == 0, float("-inf"))

    def accept(self, token: int) -> None:
        if self.failed is None:
            try:
                self.matcher.consume_token(token)
            except BaseException as exc:
                self.failed = reason_of(exc)
            self._check()

    @property
    def done(self) -> bool:
        """The grammar takes no more tokens: complete, or failed."""
        return self.failed is not None or bool(self.matcher.is_stopped())

    def _check(self) -> bool:
        if self.failed is None and self.matcher.is_error():
            self.failed = one_line(self.matcher.get_error())
        return self.failed is not None


class Grammars:
    """A model's tokenizer as llguidance reads it, built on first use (a fast tokenizer is needed)."""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: Sequence[int]) -> None:
        from transformers import PreTrainedTokenizerFast

        self._hf, self._vocab, self._eos = tokenizer, vocab, sorted(eos_ids)
        self._fast = isinstance(tokenizer, PreTrainedTokenizerFast)  # llguidance reads only Rust tokenizers
        self._tokenizer: LLTokenizer | None = None
        self.unusable: str | None = None  # why llguidance cannot read this tokenizer (then no format is served)

    def _llg(self) -> LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf

            n_vocab = max(self._vocab, len(self._hf))
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=n_vocab, eos_token=self._eos or None)
        return self._tokenizer

    def compile(self, fmt: ResponseFormat) -> LLMatcher | str:
        """A matcher at the format's start, or why the format cannot constrain this model."""
        if not self._fast:
            return ("response_format: this model's tokenizer is not a fast (Rust `tokenizers`) one, which structured "
                    "output needs")
        if self.unusable is not None:
            return f"response_format: this model's tokenizer cannot drive structured output: {self.unusable}"
        try:
            matcher = LLMatcher(self._llg(), grammar_of(fmt), log_level=0, limits=LIMITS)
        except BaseException as exc:  # the tokenizer or the grammar refused
            return f"response_format: cannot be compiled: {reason_of(exc)}"
        if matcher.is_error():
            return f"response_format: cannot be compiled: {one_line(matcher.get_error())}"
        return matcher

    def warm(self) -> None:
        """Read the tokenizer now (at load; up to a second for a large vocabulary), not on a first request. One
        llguidance cannot read (a WordPiece decoder, an EOS outside the vocabulary) leaves the model served without
        structured output, said once here and in each refusal (it ended the worker in a traceback)."""
        if self._fast and self.unusable is None:
            try:
                self._llg()
            except BaseException as exc:  # ValueError, RuntimeError, a Rust panic (no Exception): see `reason_of`
                self.unusable = reason_of(exc)
                log.warning("structured output unavailable for this model's tokenizer", reason=self.unusable)

    @staticmethod
    def start(compiled: LLMatcher, output: Sequence[int]) -> Constraint:
        """A row's own constraint: the compiled matcher copied, advanced over the `output` already sent."""
        matcher = compiled.deep_copy()
        if output and not matcher.consume_tokens(list(output)):
            return Constraint(matcher, f"the output already sent does not follow the format: "
                                       f"{one_line(matcher.get_error())}")
        return Constraint(matcher)
