"""Next-token selection per row: greedy, or temperature / top-k / top-p / min-p sampling with a per-row seed."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpu_worker.bad_words import always_banned, banned_after, by_prefix_end, longest_prefix
from gpu_worker.sequences import GenSpec, Row, SamplingParams, TokenLogprob


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
    if params.min_p > 0.0:  # vLLM's: relative to the likeliest token, on the tempered distribution, before top-k/p
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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
                  penalties: Callable[[int], Penalties] | None = None, constraints: Sequence[Any] = ()) -> list[int]:
    """Tokens for every row of `logits` [rows, vocab]: one vectorised argmax, then the sampled rows. `penalties(i)`:
    row i's `Penalties`, asked only for a row with a bias or a penalty; `constraints[i]`: row i's structured-output
    `gpu_worker.constraints.Constraint` or None, which masks its logits last and takes its token."""
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized and penalties is not None:
        logits = penalize(logits, [(i, params[i], penalties(i)) for i in penalized])
    bound = [i for i, c in enumerate(constraints) if c is not None]
    if bound:
        logits = logits if penalized and penalties is not None else logits.float().clone()
        for i in bound:
            constraints[i].mask(logits[i])
    chosen = torch.argmax(logits, dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        chosen = chosen.clone()
        for i in sampled:
            chosen[i] = sample_row(logits[i], params[i], generators[i])
    tokens: list[int] = chosen.tolist()
    for i in bound:
        constraints[i].accept(tokens[i])
    return tokens


SCORED_ROWS = 256  # rows of logits scored at once: a prompt's every position in slices, not one float32 copy


def token_logprobs(logits: torch.Tensor, targets: Sequence[int], ks: Sequence[int]) -> list[TokenLogprob]:
    """Each row of `logits` ([rows, vocab]): its target token's log probability and its `ks[i]` likeliest tokens'.
    One log-softmax and one top-k per `SCORED_ROWS` rows, one copy to the host each."""
    if len(targets) > SCORED_ROWS:
        return [entry for lo in range(0, len(targets), SCORED_ROWS) for entry in token_logprobs(
            logits[lo:lo + SCORED_ROWS], targets[lo:lo + SCORED_ROWS], ks[lo:lo + SCORED_ROWS])]
    scores = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(list(targets), dtype=torch.long, device=logits.device)
    picked = scores.gather(1, chosen[:, None])[:, 0].tolist()
    k = min(max(ks, default=0), scores.shape[-1])
    if not k:
        return [(lp, ()) for lp in picked]
    values, ids = (t.tolist() for t in scores.topk(k, dim=-1))
    return [(lp, tuple(zip(i[:want], v[:want], strict=True)))
            for lp, i, v, want in zip(picked, ids, values, ks, strict=True)]


def keep_logprobs(logits: torch.Tensor, tokens: Sequence[int], rows: Sequence[Row]) -> None:
    """Each row that asks (`sampling.logprobs`) keeps its new token's log probability under `logits` ([rows,
    vocab], the model's own: before temperature, penalties and bias, as vLLM's raw logprobs) and its likeliest
    alternatives."""
    asking = [i for i, r in enumerate(rows) if r.spec.sampling.logprobs is not None]
    if not asking:
        return
    index = torch.tensor(asking, dtype=torch.long, device=logits.device)
    scored = token_logprobs(logits.index_select(0, index), [tokens[i] for i in asking],
                           [rows[i].spec.sampling.logprobs or 0 for i in asking])
    for i, entry in zip(asking, scored, strict=True):
        row = rows[i]
        if row.logprobs is None:
            row.logprobs = []
        row.logprobs.append(entry)


class Penalties:
    """A penalized row's tokens as its bias and penalties read them, held on the logits' device and kept up to date
    a token at a time: which tokens the sequence holds, prompt and output (the repetition penalty), and how often
    each occurs in the output (presence and frequency); the bias as tensors. Re-reading the whole prompt and output
    every step cost a step O(prompt) Python and several host-to-device copies per row (a model whose own
    `generation_config` sets a repetition penalty penalizes every row)."""

    __slots__ = ("always", "banned", "bias_ids", "bias_values", "counts", "disallowed", "keep", "seen", "tail", "taken",
                 "words_after")

    def __init__(self, params: SamplingParams, prompt: Sequence[int], output: Sequence[int], vocab: int,
                 device: torch.device, ends: Sequence[int] = ()) -> None:
        """`ends`: the tokens that would end the row (its EOS and stop tokens), banned below its `min_tokens`."""
        self.seen = self.counts = self.bias_ids = self.bias_values = self.banned = self.disallowed = None
        self.taken = 0  # of the row's generated tokens, those counted in already
        if params.min_tokens and ends:
            self.banned = torch.tensor(sorted(ends), dtype=torch.long, device=device)
        if params.allowed_token_ids is not None:
            self.disallowed = torch.ones(vocab, dtype=torch.bool, device=device)
            self.disallowed[torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.long,
                                         device=device)] = False
        # bad words: a word whose last token the model cannot draw never completes
        words = tuple(w for w in params.bad_words if w[-1] < vocab)
        always = always_banned(words)
        self.always = torch.tensor(always, dtype=torch.long, device=device) if always else None
        self.words_after = by_prefix_end(words)  # the longer ones, looked at where the output ends with their prefix
        self.keep = longest_prefix(words)  # the output's last tokens they need to see
        self.tail = list(output[max(0, len(output) - self.keep):]) if self.keep else []
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            if prompt or output:
                self.seen[torch.tensor([*prompt, *output], dtype=torch.long, device=device)] = True
        if params.presence_penalty or params.frequency_penalty:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            if output:
                ids = torch.tensor(list(output), dtype=torch.long, device=device)
                self.counts.index_add_(0, ids, torch.ones(len(output), dtype=torch.float32, device=device))
        if params.logit_bias:
            self.bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=device)
            self.bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)

    @classmethod
    def of(cls, spec: GenSpec, logits: torch.Tensor) -> Penalties | None:
        """A joining row's state (its prompt and any output a resumed stream already sent), if it needs one. A row
        with a structured output bans nothing for min_tokens: its grammar says when it is complete."""
        p = spec.sampling
        if not p.penalized:
            return None
        ends = () if spec.constraint is not None or not p.min_tokens else [t for t in spec.ends if t < logits.shape[-1]]
        return cls(p, *spec.history(), logits.shape[-1], logits.device, ends)

    def caught_up(self, tokens: Sequence[int]) -> Penalties:
        """Count in the row's generated `tokens` not yet counted (one a step); they only ever grow."""
        if len(tokens) < self.taken:
            raise RuntimeError(f"a row's tokens shrank from {self.taken} to {len(tokens)}: its penalties would drift")
        for t in tokens[self.taken:]:
            if self.seen is not None:
                self.seen[t] = True
            if self.counts is not None:
                self.counts[t] += 1.0
        if self.keep:
            self.tail = [*self.tail, *tokens[self.taken:]][-self.keep:]
        self.taken = len(tokens)
        return self


def penalize(logits: torch.Tensor, rows: list[tuple[int, SamplingParams, Penalties]]) -> torch.Tensor:
    """`logits` (a float32 copy) with each listed row's (index, params, state) bias and penalties applied, in vLLM's
    order: OpenAI's `logit_bias` added; the repetition penalty as transformers' `RepetitionPenaltyLogitsProcessor`
    applies it (every token of prompt and output: a positive logit divided by it, a negative one multiplied);
    OpenAI's frequency and presence penalties over the output's tokens (`logit - count * frequency - presence`);
    below its `min_tokens`, the tokens that would end it banned (vLLM's MinTokensLogitsProcessor); and every token
    outside its `allowed_token_ids` or completing one of its `bad_words` banned (vLLM's)."""
    out = logits.float().clone()
    for i, p, state in rows:
        row = out[i]
        if state.disallowed is not None:
            row.masked_fill_(state.disallowed, float("-inf"))
        if state.always is not None:
            row.index_fill_(0, state.always, float("-inf"))
        if state.words_after and (bad := banned_after(state.words_after, state.tail)):
            row[bad] = float("-inf")
        if state.banned is not None and state.taken < p.min_tokens:
            row.index_fill_(0, state.banned, float("-inf"))
        if state.bias_ids is not None:
            row.index_add_(0, state.bias_ids, state.bias_values)
        if state.seen is not None:
            penalized = torch.where(row < 0, row * p.repetition_penalty, row / p.repetition_penalty)
            row.copy_(torch.where(state.seen, penalized, row))
        if state.counts is not None:
            row.sub_(state.counts * p.frequency_penalty + (state.counts > 0) * p.presence_penalty)
    return out
