"""Per-request penalties: OpenAI's logit bias, its presence and frequency penalties over the output, and the
repetition penalty (transformers' definition, over prompt and output) overriding the model's. The engine's
batched rows (a late joiner among them) pick the tokens `generate` picks on each prompt alone with the same
logits processors, and a streamed request run again after a crash counts what its caller was already sent as
output."""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from gpu_worker.outcomes import Outcome
from gpu_worker.sampling import Penalties, penalize
from gpu_worker.sequences import SamplingParams
from shared.messages import InferenceRequest
from tests import tiny_runner
from tests.tiny_runner import TOKENIZER, run_alone, runner_for
from tests.torch_device import on_device

NEW = 24
PROMPTS = {"a": [5, 9, 5, 9, 5, 9, 17], "b": [30, 31, 32], "c": [40, 41, 40, 41, 40, 41, 40, 41, 40, 41, 7]}
PENALTIES = [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"presence_penalty": -2.0, "frequency_penalty": 0.3},
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 1.3, "presence_penalty": 0.7, "frequency_penalty": 0.4},
    {"logit_bias": {"5851": -100, "1022": -100, "5862": 5.0}},  # bans the first tokens of c and a; favours one
    {"logit_bias": {"7": 2.5, "40": 3.0}, "frequency_penalty": 1.0},
    {"logit_bias": {"5851": -100, "7": 4.0, "40": 6.0}, "repetition_penalty": 3.0, "presence_penalty": 0.5},
]


class Bias(LogitsProcessor):
    """The reference for OpenAI's logit_bias: added to the logits before anything else."""

    def __init__(self, bias: dict[str, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for tok, b in self.bias.items():
            scores[0, int(tok)] += b
        return scores


class OpenAIPenalties(LogitsProcessor):
    """The reference for OpenAI's penalties: its documented formula over the tokens generated after
    `prompt_len`."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for tok, n in Counter(input_ids[0, self.prompt_len:].tolist()).items():
            scores[0, tok] -= n * self.frequency + self.presence
        return scores


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_runner.tiny_llama(seed=5)


def request(rid: str, params: dict[str, Any], streamed: list[int] | None = None) -> InferenceRequest:
    return tiny_runner.request(rid, PROMPTS[rid], params, NEW, streamed)


def served(model: LlamaForCausalLM, params: dict[str, Any]) -> dict[str, list[int]]:
    """Rows a and b together, c joining after three steps: each row's tokens."""
    results = tiny_runner.served(model, PROMPTS, dict.fromkeys(PROMPTS, params), NEW)
    return {rid: result.output["token_ids"] for rid, result in results.items()}


@on_device
def generated(model: LlamaForCausalLM, params: dict[str, Any]) -> dict[str, list[int]]:
    """`generate` on each prompt alone with the processors in vLLM's order: the bias, transformers' own repetition
    penalty, OpenAI's penalties (the model's own repetition penalty is off: the processor stands for it)."""
    out = {}
    for rid, ids in PROMPTS.items():
        processors = LogitsProcessorList([
            Bias(params.get("logit_bias", {})),
            RepetitionPenaltyLogitsProcessor(params.get("repetition_penalty", 1.0)),
            OpenAIPenalties(len(ids), params.get("presence_penalty", 0.0), params.get("frequency_penalty", 0.0))])
        seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, repetition_penalty=1.0,
                             logits_processor=processors)
        out[rid] = seq[0, len(ids):].tolist()
    return out


@pytest.mark.parametrize("params", PENALTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_penalized_greedy_tokens_equal_generate_with_the_same_processors(model, params):
    plain, penalized = served(model, {}), served(model, params)
    assert penalized == generated(model, params)
    assert penalized != plain  # the penalty changed what was picked: the comparison is not of unpenalized runs


def test_a_request_of_its_own_overrides_the_models_repetition_penalty(model):
    model.generation_config.repetition_penalty = 1.8
    try:
        assert served(model, {}) == generated(model, {"repetition_penalty": 1.8})
        assert served(model, {"repetition_penalty": 1.0}) == generated(model, {})  # 1: off, for this request
    finally:
        model.generation_config.repetition_penalty = 1.0


@pytest.mark.parametrize("sent", [2, 9])
def test_a_streamed_request_run_again_counts_what_was_sent_as_output(model, sent):
    """After a crash, the tokens its caller was sent join the prompt; for the presence and frequency penalties
    they are still output, so the rest of the output is what an unbroken run gives."""
    params = {"frequency_penalty": 1.5, "presence_penalty": 0.5}
    whole = served(model, params)["c"]  # unpenalized, c's output repeats a token at once
    result = run_alone(runner_for(model), request("c", params, streamed=whole[:sent]))
    assert result.output["token_ids"] == whole


def test_sampled_rows_never_draw_a_banned_token(model):
    """Sampling (OpenAI's default) draws from the biased logits: every token a seeded run drew, banned, is never
    drawn again with the same seed."""
    sampled = {"temperature": 1.0, "seed": 7}
    drawn = {t for tokens in served(model, sampled).values() for t in tokens}
    banned = served(model, {**sampled, "logit_bias": {str(t): -100 for t in drawn}})
    assert all(len(tokens) == NEW for tokens in banned.values())
    assert not drawn & {t for tokens in banned.values() for t in tokens}


def test_a_bias_beyond_the_vocabulary_fails_the_request_alone(model):
    runner = runner_for(model)
    out = runner.prepare(request("a", {"logit_bias": {str(len(TOKENIZER)): -100}}), time.time())
    assert isinstance(out, Outcome) and out.result.error is not None
    assert out.result.error.code == "invalid_input" and "vocabulary" in out.result.error.message


def test_penalize_matches_the_formulas_on_random_rows():
    rng = random.Random(1)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2)) * 3
    rows = []
    for i in (0, 2, 3, 5):
        p = SamplingParams(repetition_penalty=rng.choice([1.0, 1.4, 0.8]), presence_penalty=rng.uniform(-2, 2),
                           frequency_penalty=rng.uniform(-2, 2),
                           logit_bias=tuple((rng.randrange(50), rng.uniform(-100, 100)) for _ in range(i)))
        prompt = [rng.randrange(50) for _ in range(rng.randint(1, 12))]
        output = [rng.randrange(50) for _ in range(rng.randint(0, 12))]
        rows.append((i, p, (prompt, output)))
    # the state as a row builds it: the prompt at once, then its output a token or two at a time
    states = [Penalties(p, prompt, [], 50, logits.device) for _, p, (prompt, _) in rows]
    for state, (_, _, (_, output)) in zip(states, rows, strict=True):
        for end in range(0, len(output) + 2, 2):
            state.caught_up(output[:end])
    out = penalize(logits, [(i, p, state) for (i, p, _), state in zip(rows, states, strict=True)])
    at_once = [Penalties(p, prompt, output, 50, logits.device) for _, p, (prompt, output) in rows]
    assert torch.equal(out, penalize(logits, [(i, p, st) for (i, p, _), st in zip(rows, at_once, strict=True)]))
    expected = logits.clone()
    for i, p, (prompt, output) in rows:
        for tok, bias in p.logit_bias:
            expected[i, tok] += bias
        for tok in set(prompt) | set(output):
            x = expected[i, tok].item()
            expected[i, tok] = x * p.repetition_penalty if x < 0 else x / p.repetition_penalty
        for tok, n in Counter(output).items():
            expected[i, tok] -= n * p.frequency_penalty + p.presence_penalty
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.equal(out[[1, 4]], logits[[1, 4]])  # rows not listed are untouched
