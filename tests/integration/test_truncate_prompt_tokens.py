"""vLLM's `truncate_prompt_tokens`: a prompt keeps its last tokens (left truncation), whatever its length, the
gateway counting and placing it as truncated; greedy, the output is that of the kept tokens sent alone; -1 keeps
the most the model takes; a value the model cannot take is refused at submit."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from gpu_worker.generate_runner import GenerateRunner
from gpu_worker.models import LoadedModel
from gpu_worker.outcomes import Outcome
from shared import openai_shapes as oa
from shared.config import BUILTIN_MODELS, ModelSpec
from shared.errors import ValidationError
from shared.messages import InferenceRequest
from shared.states import Priority, Task
from shared.submit import build_request
from shared.token_limits import TokenLimits
from tests.integration.test_generation_config import NEW, PROMPTS, tiny_llama
from tests.torch_device import DEVICE

SPEC = ModelSpec(name="m", task=Task.GENERATE, source="/nowhere", device=str(DEVICE), dtype="float32",
                 max_input_tokens=8)


def request(rid: str, ids: list[int], **params) -> InferenceRequest:
    now = int(time.time() * 1000)
    return InferenceRequest(id=rid, tenant="t", model="m", task=Task.GENERATE, input={"input_ids": ids},
                            params={"max_new_tokens": NEW, **params}, lane="short", priority=Priority.INTERACTIVE,
                            created_ms=now, deadline_ms=now + 600_000, est_tokens=len(ids) + NEW)


def serve(requests: list[InferenceRequest], spec: ModelSpec = SPEC,
          max_seq_len: int = 128) -> dict[str, tuple[list[int], int] | str]:
    """Each request's (token ids, prompt tokens), or the error code of one refused before it is computed."""
    model, tok = tiny_llama()
    loaded = LoadedModel(spec=spec, path=None, model=model, tokenizer=tok, device=DEVICE, dtype=torch.float32)
    runner = GenerateRunner(loaded, "w", max_rows=8, max_seq_len=max_seq_len)
    prepared = [runner.prepare(r, time.time()) for r in requests]
    done = [p for p in prepared if isinstance(p, Outcome)]
    done += runner.start([p for p in prepared if not isinstance(p, Outcome)], time.time())
    while runner.busy:
        done += runner.step()
    return {o.result.id: (o.result.output["token_ids"], o.result.output["prompt_tokens"]) if o.result.output
            else o.result.error.code for o in done if (isinstance(o, Outcome) and o.result.error) or o.result.output}


def test_a_prompt_keeps_its_last_tokens_and_reads_as_they_read_alone():
    long = PROMPTS["c"]  # 11 tokens, over this model's 8
    got = serve([request("cut", long, truncate_prompt_tokens=5), request("whole", long[-5:]),
                 request("limit", long, truncate_prompt_tokens=-1), request("eight", long[-8:]),
                 request("short", PROMPTS["b"], truncate_prompt_tokens=5),
                 request("outside", [10**6, *long[-5:]], truncate_prompt_tokens=5)])  # cut, then read
    assert got["cut"] == got["whole"] == got["outside"] and got["cut"][1] == 5
    assert got["limit"] == got["eight"] and got["limit"][1] == 8
    assert got["short"][1] == len(PROMPTS["b"])  # shorter than what it keeps: whole
    assert serve([request("over", long)]) == {"over": "input_too_long"}  # without it, the same prompt is refused


def test_minus_one_keeps_what_the_models_context_leaves_beside_the_output():
    """A model file allowing more prompt than the model's context (256 tokens) takes: -1 keeps the prompt's last
    256 - max_new_tokens tokens, read as they read alone (it kept the file's 400, and the request failed)."""
    spec = dataclasses.replace(SPEC, max_input_tokens=400)
    long = [3 + i % 50 for i in range(300)]
    got = serve([request("limit", long, truncate_prompt_tokens=-1), request("tail", long[-(256 - NEW):])],
                spec, max_seq_len=256)
    assert got["limit"] == got["tail"] and got["limit"][1] == 256 - NEW


def test_the_gateway_counts_and_places_a_truncated_prompt(model_cache, loaded_models):
    spec = dataclasses.replace(BUILTIN_MODELS["tiny-llama"], max_input_tokens=64)
    limits = TokenLimits(model_cache)
    text = "many words in a long prompt " * 200  # far over the model's 64 tokens, and its 16 characters a token

    def build(params: dict, inp: dict | None = None) -> InferenceRequest:
        return build_request({"input": inp or {"prompt": text}, "params": params}, spec, "t", time.time(),
                             limits=limits)

    req = build({"truncate_prompt_tokens": 16, "max_new_tokens": 8})
    assert req.est_tokens == 16 + 8 and req.lane == "short" and req.params["truncate_prompt_tokens"] == 16
    assert build({"truncate_prompt_tokens": -1, "max_new_tokens": 8}).est_tokens == 64 + 8
    assert build({"truncate_prompt_tokens": 4}, {"input_ids": list(range(100))}).est_tokens == 4 + 64
    assert "truncate_prompt_tokens" not in build({}, {"prompt": "hi"}).params
    # cut first, then read: an id outside the vocabulary in the part cut off does not count (vLLM's)
    assert build({"truncate_prompt_tokens": 4}, {"input_ids": [10**6, *range(10)]}).est_tokens == 4 + 64
    with pytest.raises(ValidationError) as err:
        build({"truncate_prompt_tokens": 4}, {"input_ids": [*range(10), 10**6]})
    assert err.value.field == "input.input_ids"
    for params, field in (({}, "input.prompt"), ({"truncate_prompt_tokens": 0}, "params.truncate_prompt_tokens"),
                          ({"truncate_prompt_tokens": 65}, "params.truncate_prompt_tokens"),
                          ({"truncate_prompt_tokens": -2}, "params.truncate_prompt_tokens")):
        with pytest.raises(ValidationError) as err:
            build(params)
        assert err.value.field == field, (params, err.value)
    context = limits.context(spec)
    assert context is not None
    # a model file that allows more prompt than the model's context leaves beside the output (the limits are the
    # file's; the context is the model's): -1 keeps what the context leaves, so the prompt loses its start instead of
    # being refused (it kept the file's limit, and the prompt plus its output was then refused)
    longer = {"input_ids": list(range(10)) * (context // 10 + 1)}
    default_new = spec.default_max_new_tokens
    for limit in (context - 4, context, context + 1000):
        spec = dataclasses.replace(spec, max_input_tokens=limit)
        req = build({"truncate_prompt_tokens": -1, "max_new_tokens": 8}, longer)
        assert req.est_tokens == context and req.params["max_new_tokens"] == 8, limit
        req = build({"truncate_prompt_tokens": -1}, longer)  # the default output keeps its room
        assert req.est_tokens == context and req.params["max_new_tokens"] == default_new, limit
    assert build({"truncate_prompt_tokens": -1, "max_new_tokens": 8}, {"input_ids": [1, 2, 3]}).est_tokens == 3 + 8
    spec = dataclasses.replace(spec, max_new_tokens=context + 10)  # an output the context cannot hold: refused
    with pytest.raises(ValidationError) as err:
        build({"truncate_prompt_tokens": -1, "max_new_tokens": context}, longer)
    assert err.value.field == "params.max_new_tokens" and err.value.code == "context_length_exceeded"


def test_the_openai_routes_pass_it():
    tr = oa.translate_completion({"model": "m", "prompt": "hi", "truncate_prompt_tokens": 3,
                                  "truncation_side": "right"})
    assert tr.body["params"]["truncate_prompt_tokens"] == 3 and tr.body["params"]["truncation_side"] == "right"
    assert "truncate_prompt_tokens" not in oa.translate_completion({"model": "m", "prompt": "hi"}).body["params"]


def test_truncation_side_right_keeps_the_first_tokens():
    long = PROMPTS["c"]
    got = serve([request("right", long, truncate_prompt_tokens=5, truncation_side="right"),
                 request("first", long[:5]), request("tail", [*long[:5], 10**6], truncate_prompt_tokens=5,
                                                     truncation_side="right")])
    assert got["right"] == got["first"] == got["tail"] and got["right"][1] == 5


def embed(loaded, texts: list[str], **params) -> dict:
    from gpu_worker.embed_runner import EmbedRunner

    now = int(time.time() * 1000)
    req = InferenceRequest(id="e", tenant="t", model="minilm", task=Task.EMBED, input={"texts": texts},
                           params={"normalize": True, "truncate": False, **params}, lane="short",
                           priority=Priority.INTERACTIVE, created_ms=now, deadline_ms=now + 60_000, est_tokens=10)
    runner = EmbedRunner(loaded, "w")
    job = runner.prepare(req, time.time())
    (out,) = [job] if isinstance(job, Outcome) else runner.start([job], time.time())  # type: ignore[list-item]
    return out.result.output if out.result.output else {"error": out.result.error.code}


def test_an_embedding_keeps_each_texts_first_tokens(model_cache, loaded_models):
    """vLLM's truncate_prompt_tokens on embeddings: each text's first tokens, special tokens included (right
    truncation, as vLLM cuts for pooling models); the result says which texts were cut."""
    minilm = loaded_models["minilm"]
    a, b = "one two three four five six seven", "one two three four five nine ten"
    cut = embed(minilm, [a, b, "one"], truncate_prompt_tokens=7)  # [CLS] one .. five [SEP]
    assert cut["tokens"] == [7, 7, 3] and cut["truncated"] == [True, True, False]
    assert cut["embeddings"][0] == cut["embeddings"][1]  # the same first five words: the same vector
    whole = embed(minilm, [a, b])
    assert whole["embeddings"][0] != whole["embeddings"][1] and "truncated" not in whole
    assert embed(minilm, ["hello " * 600], truncate_prompt_tokens=-1)["tokens"] == [256]  # its most: max_seq_length
    assert embed(minilm, ["hello " * 600]) == {"error": "input_too_long"}
    spec = BUILTIN_MODELS["minilm"]
    limits = TokenLimits(model_cache)
    body = {"input": {"texts": ["hello " * 2000]}, "params": {"truncate_prompt_tokens": 16}}
    req = build_request(body, spec, "t", time.time(), limits=limits)  # any length: the worker cuts it
    assert req.params["truncate_prompt_tokens"] == 16 and req.est_tokens == 16
    assert "truncate_prompt_tokens" not in build_request({"input": {"text": "x"}}, spec, "t", time.time()).params
    for bad in (0, -2, limits.max_text_tokens(spec) + 1):
        with pytest.raises(ValidationError) as err:
            build_request({**body, "params": {"truncate_prompt_tokens": bad}}, spec, "t", time.time(), limits=limits)
        assert err.value.field == "params.truncate_prompt_tokens"
    tr = oa.translate_embeddings({"model": "minilm", "input": "x", "truncate_prompt_tokens": -1})
    assert tr.body["params"] == {"truncate_prompt_tokens": -1}
