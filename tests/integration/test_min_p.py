"""vLLM's `min_p`: a sampled row never draws a token less likely than `min_p` times its likeliest one (after
temperature); 0 is off. Native `params.min_p`, the OpenAI routes' `min_p`, the engine's sampling."""

from __future__ import annotations

import time

import pytest
import torch

from gpu_worker.sampling import sample_row
from gpu_worker.sequences import SamplingParams
from shared import openai_shapes as oa
from shared.config import BUILTIN_MODELS
from shared.errors import ValidationError
from shared.submit import build_request


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 400) -> set[int]:
    gen = torch.Generator().manual_seed(7)
    return {int(sample_row(logits, params, gen)) for _ in range(n)}


def test_tokens_below_the_fraction_of_the_likeliest_are_never_drawn():
    probs = torch.tensor([0.40, 0.30, 0.15, 0.10, 0.05])
    logits = probs.log()
    assert draws(logits, SamplingParams(temperature=1.0)) == {0, 1, 2, 3, 4}  # off: every token comes up
    assert draws(logits, SamplingParams(temperature=1.0, min_p=0.3)) == {0, 1, 2}  # 0.12 and above
    assert draws(logits, SamplingParams(temperature=1.0, min_p=0.74)) == {0, 1}  # 0.296 and above
    assert draws(logits, SamplingParams(temperature=1.0, min_p=1.0)) == {0}
    # after temperature: a hotter distribution is flatter, so the same fraction keeps more tokens
    assert draws(logits, SamplingParams(temperature=3.0, min_p=0.6)) == {0, 1, 2, 3}  # p^(1/3): 0.44 of the top


def test_min_p_goes_before_top_k_and_top_p():
    logits = torch.tensor([0.40, 0.30, 0.15, 0.10, 0.05]).log()
    assert draws(logits, SamplingParams(temperature=1.0, top_k=2, min_p=0.1)) == {0, 1}
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.9)) == {0, 1, 2, 3}
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.9, min_p=0.3)) == {0, 1, 2}
    # min_p first, then top-p over what it kept (vLLM's order since its V1 engine): 0.4, 0.3 and 0.15 renormalised
    # reach 0.8 at the second token; top-p first would keep the third
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.8, min_p=0.3)) == {0, 1}


def test_the_native_and_openai_routes_take_it():
    spec = BUILTIN_MODELS["tiny-llama"]
    req = build_request({"input": {"prompt": "hi"}, "params": {"temperature": 0.8, "min_p": 0.05}}, spec, "t",
                        time.time())
    assert req.params["min_p"] == 0.05
    plain = build_request({"input": {"prompt": "hi"}, "params": {"temperature": 0.8}}, spec, "t", time.time())
    assert "min_p" not in plain.params  # off is left out: a worker that predates it reads the request as before
    for bad in (-0.1, 1.5, "0.1"):
        with pytest.raises(ValidationError) as err:
            build_request({"input": {"prompt": "hi"}, "params": {"min_p": bad}}, spec, "t", time.time())
        assert err.value.field == "params.min_p"
    tr = oa.translate_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "min_p": 0.1})
    assert tr.body["params"]["min_p"] == 0.1
    assert "min_p" not in oa.translate_completion({"model": "m", "prompt": "hi"}).body["params"]
