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

import torch
from llguidance import LLMatcher, LLTokenizer

from shared.structured_output import ResponseFormat, grammar_of, one_line


class Constraint:
    """One row's grammar state."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher

    def mask(self, row: torch.Tensor) -> None:
        """Every token the grammar does not allow next gets -inf in `row` (one row of float logits, in place).
        Ids beyond the tokenizer's (a padded embedding) are never allowed."""
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        keep = torch.zeros(row.shape[-1], dtype=torch.bool)
        n = min(len(allowed), row.shape[-1])
        keep[:n] = allowed[:n] > 0
        row.masked_fill_(~keep.to(row.device, non_blocking=True), float("-inf"))

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar takes no more tokens: complete (or, never expected, in an error state)."""
        return bool(self.matcher.is_stopped())


class Grammars:
    """A model's tokenizer as llguidance reads it, built on first use (a fast tokenizer is needed)."""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: Sequence[int]) -> None:
        self._hf, self._vocab, self._eos = tokenizer, vocab, sorted(eos_ids)
        self._tokenizer: LLTokenizer | None = None

    def _llg(self) -> LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf

            n_vocab = max(self._vocab, len(self._hf))
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=n_vocab, eos_token=self._eos or None)
        return self._tokenizer

    def compile(self, fmt: ResponseFormat) -> LLMatcher | str:
        """A matcher at the format's start, or why the format cannot constrain this model."""
        from transformers import PreTrainedTokenizerFast

        if not isinstance(self._hf, PreTrainedTokenizerFast):
            return ("response_format: this model's tokenizer is not a fast (Rust `tokenizers`) one, which structured "
                    "output needs")
        try:
            matcher = LLMatcher(self._llg(), grammar_of(fmt), log_level=0)
        except ValueError as exc:  # the tokenizer or the grammar, refused by llguidance
            return f"response_format: cannot be compiled: {one_line(str(exc))}"
        if matcher.is_error():
            return f"response_format: cannot be compiled: {one_line(matcher.get_error())}"
        return matcher

    @staticmethod
    def start(compiled: LLMatcher, output: Sequence[int]) -> Constraint:
        """A row's own constraint: the compiled matcher copied, advanced over the `output` already sent."""
        matcher = compiled.deep_copy()
        if output:
            matcher.consume_tokens(list(output))
        return Constraint(matcher)
