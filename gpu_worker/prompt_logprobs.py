"""Prompt tokens' log probabilities (`sampling.prompt_logprobs`, vLLM's `prompt_logprobs`; OpenAI's completions
`echo` with `logprobs`): each prompt token's log probability given the tokens before it, and the likeliest
alternatives, from the prefill's own forward (the logits of every prompt position, kept for the rows that ask
instead of the last alone). The first token has none (nothing comes before it): its entry is None.

A prompt prefilled whole gets them from its one forward; a prompt prefilled in chunks from each chunk's forward
(fused into a decode step or not): position p's logits score token p + 1, so the last position of a chunk scores
the next chunk's first token. The engine hands them out with the row's result (`take`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_worker.sampling import token_logprobs
from gpu_worker.sequences import GenSpec, TokenLogprob


class PromptLogprobs:
    def __init__(self) -> None:
        self.kept: dict[str, list[TokenLogprob | None]] = {}  # by sequence id, until its result

    @staticmethod
    def wanted(specs: Sequence[GenSpec]) -> bool:
        """Whether a forward of these prompts must keep the logits of every position."""
        return any(s.sampling.prompt_logprobs is not None for s in specs)

    def whole(self, specs: Sequence[GenSpec], logits: torch.Tensor, pads: Sequence[int]) -> None:
        """Right-aligned prompts' forward: `logits` [rows, width, vocab], row i's prompt after `pads[i]` columns."""
        for i, spec in enumerate(specs):
            if spec.sampling.prompt_logprobs is not None:
                self.chunk(spec, logits[i, pads[i]:], 0)

    def chunk(self, spec: GenSpec, logits: torch.Tensor, lo: int) -> None:
        """Prompt positions [lo, lo + len(logits)) of `spec` were computed with `logits` ([positions, vocab])."""
        if spec.sampling.prompt_logprobs is None:
            return
        prompt = spec.prompt_ids
        if lo == 0:  # a prompt's first chunk (a prefill tried again starts over)
            self.kept[spec.id] = [None]
        kept = self.kept.setdefault(spec.id, [])
        targets = prompt[lo + 1:lo + len(logits) + 1]  # the last position of the prompt scores nothing
        if targets:
            kept += token_logprobs(logits[:len(targets)], targets, [spec.sampling.prompt_logprobs] * len(targets))

    def take(self, spec_id: str) -> list[TokenLogprob | None] | None:
        return self.kept.pop(spec_id, None)
