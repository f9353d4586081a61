"""Next-token selection per row: greedy, or temperature / top-k / top-p sampling with a per-row seed."""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from gpu_worker.sequences import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator of the row's own, so its draws do not depend on its batch-mates."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return gen


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from a 1-D logits vector; returns a 0-d long tensor (no host sync)."""
    scores = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        drop = cum > params.top_p
        drop[1:] = drop[:-1].clone()  # keep the token that crosses the threshold
        drop[0] = False
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    if not bool(probs.sum() > 0):  # nothing left to sample from (all masked): the most likely token
        return torch.argmax(logits)
    return torch.multinomial(probs, 1, generator=generator)[0]


def select_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                  history: Callable[[int], tuple[Sequence[int], Sequence[int]]] | None = None) -> list[int]:
    """Tokens for every row of `logits` [rows, vocab]: one vectorised argmax, then the sampled rows. `history(i)`:
    row i's (prompt, output so far), read only for a row with a penalty."""
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized and history is not None:
        logits = penalize(logits, [(i, params[i], history(i)) for i in penalized])
    chosen = torch.argmax(logits, dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        chosen = chosen.clone()
        for i in sampled:
            chosen[i] = sample_row(logits[i], params[i], generators[i])
    return chosen.tolist()


def penalize(logits: torch.Tensor,
             rows: list[tuple[int, SamplingParams, tuple[Sequence[int], Sequence[int]]]]) -> torch.Tensor:
    """`logits` (a float32 copy) with each listed row's (index, params, (prompt, output)) bias and penalties
    applied, in vLLM's order: OpenAI's `logit_bias` added; the repetition penalty as transformers'
    `RepetitionPenaltyLogitsProcessor` applies it (every token of prompt and output: a positive logit divided by
    it, a negative one multiplied); OpenAI's frequency and presence penalties over the output's tokens
    (`logit - count * frequency - presence`)."""
    out = logits.float().clone()
    for i, p, (prompt, output) in rows:
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=logits.device)
            out[i, ids] += torch.tensor([b for _, b in p.logit_bias], dtype=out.dtype, device=logits.device)
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted({*prompt, *output}), dtype=torch.long, device=logits.device)
            scores = out[i, ids]
            out[i, ids] = torch.where(scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty)
        if output and (p.presence_penalty or p.frequency_penalty):
            counts = Counter(output)
            ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
            times = torch.tensor(list(counts.values()), dtype=out.dtype, device=logits.device)
            out[i, ids] -= times * p.frequency_penalty + p.presence_penalty
    return out
