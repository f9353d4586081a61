"""vLLM's `allowed_token_ids` and `bad_words`: greedy, a row is `generate` with `prefix_allowed_tokens_fn` and with
`bad_words_ids` (the words tokenized as vLLM tokenizes them), token for token, its batch-mate not held; a sampled
row draws only allowed tokens; a resumed row remembers the output it already sent; bad values are refused at
submit."""

from __future__ import annotations

import time

import pytest
import torch

from gpu_worker.bad_words import MAX_BAD_WORD_TOKENS, bad_word_ids
from gpu_worker.generate_runner import GenerateRunner
from gpu_worker.models import LoadedModel
from gpu_worker.outcomes import Outcome
from gpu_worker.sampling import Penalties, penalize, select_tokens
from gpu_worker.sequences import SamplingParams
from shared import openai_shapes as oa
from shared.config import BUILTIN_MODELS, ModelSpec
from shared.errors import ValidationError
from shared.states import Task
from shared.submit import build_request
from shared.token_limits import TokenLimits
from tests.integration.test_generation_config import NEW, PROMPTS, generated, tiny_llama
from tests.integration.test_stop_token_ids import request, serve
from tests.torch_device import DEVICE


def reference(model, ids: list[int], **kwargs) -> list[int]:
    seq = model.generate(torch.tensor([ids], device=model.device), do_sample=False, max_new_tokens=NEW,
                         min_new_tokens=NEW, attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                                     device=model.device), **kwargs)
    return seq[0, len(ids):].tolist()


def test_greedy_rows_with_allowed_token_ids_are_generate_with_prefix_allowed_tokens():
    model, tok = tiny_llama()
    plain = generated(model)
    allowed = sorted({*plain["a"][::2], 11, 12, 13})  # every other token it drew, and three it did not
    want = reference(model, PROMPTS["a"], prefix_allowed_tokens_fn=lambda _batch, _ids: allowed)
    assert want != plain["a"] and set(want) <= set(allowed)  # the premise: the restriction changed the output
    got = serve(model, tok, [request("a", allowed_token_ids=allowed), request("b")])
    assert got["a"] == (want, "length")
    assert got["b"] == (plain["b"], "length")  # its batch-mate is not held to them
    sampled = serve(model, tok, [request("a", allowed_token_ids=[11, 12, 13], temperature=1.0, seed=3)])
    assert set(sampled["a"][0]) <= {11, 12, 13} and len(sampled["a"][0]) == NEW


def test_greedy_rows_with_bad_words_are_generate_with_bad_words_ids():
    model, tok = tiny_llama()
    plain = generated(model)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    def spelled(at: int, n: int) -> bool:  # the output's tokens there are one of the ways its text tokenizes
        return tuple(plain["a"][at:at + n]) in bad_word_ids([tok.decode(plain["a"][at:at + n])], encode)

    # a two-token word the output spells, and a one-token word it spells later
    pair = next(i for i in range(1, NEW - 1) if spelled(i, 2))
    one_at = next(i for i in range(pair + 3, NEW) if spelled(i, 1))
    words = [tok.decode(plain["a"][pair:pair + 2]), tok.decode(plain["a"][one_at:one_at + 1])]
    ids = bad_word_ids(words, encode)
    want = reference(model, PROMPTS["a"], bad_words_ids=[list(w) for w in ids])
    assert want[:pair + 1] == plain["a"][:pair + 1] and want[pair + 1] != plain["a"][pair + 1]  # the premise
    got = serve(model, tok, [request("a", bad_words=words), request("b")])
    assert got["a"] == (want, "length")
    assert got["b"] == (plain["b"], "length")


def test_a_resumed_row_bans_after_the_output_it_already_sent():
    """A streamed row run again continues after what its caller was sent: a word begun there is not finished."""
    params = SamplingParams(bad_words=((7, 8), (3, 4, 5)))
    logits = torch.zeros(1, 16)
    state = Penalties(params, prompt=[1, 2, 7], output=[9, 3, 4], vocab=16, device=torch.device("cpu"))
    out = penalize(logits, [(0, params, state)])
    assert out[0, 5] == float("-inf") and out[0, 8] == 0.0  # the prompt's 7 is not output: (7, 8) not begun
    state.caught_up([7])
    out = penalize(logits, [(0, params, state)])
    assert out[0, 8] == float("-inf") and out[0, 5] == 0.0
    # every token banned but the allowed ones, whatever the logits say
    allowed = SamplingParams(allowed_token_ids=(2, 9))
    tokens = select_tokens(torch.arange(16.0)[None], [allowed], [None],
                           lambda _i: Penalties(allowed, (), (), 16, torch.device("cpu")))
    assert tokens == [9]


def test_more_bad_word_tokens_than_a_step_checks_fail_the_request_before_it_is_computed():
    model, tok = tiny_llama()
    spec = ModelSpec(name="m", task=Task.GENERATE, source="/nowhere", device=str(DEVICE), dtype="float32")
    runner = GenerateRunner(LoadedModel(spec=spec, path=None, model=model, tokenizer=tok, device=DEVICE,
                                        dtype=torch.float32), "w", max_rows=4, max_seq_len=128)
    few = runner.prepare(request("a", bad_words=["w1" * 40] * 4), time.time())
    assert not isinstance(few, Outcome) and sum(map(len, few.bad_words)) <= MAX_BAD_WORD_TOKENS
    words = [f"w{i}" * 40 for i in range(128)]  # many tokens each, twice (as is and after a space)
    out = runner.prepare(request("a", bad_words=words), time.time())  # failed at prepare: nothing computed
    assert isinstance(out, Outcome) and out.result.error is not None
    assert out.result.error.code == "invalid_input" and "at most 1024" in out.result.error.message


def test_bad_values_are_refused_at_submit(model_cache, loaded_models):
    spec = BUILTIN_MODELS["tiny-llama"]
    limits = TokenLimits(model_cache)
    vocab = limits.vocab_size(spec)
    assert vocab is not None

    def build(params: dict) -> dict:
        return build_request({"input": {"prompt": "hi"}, "params": params}, spec, "t", time.time(),
                             limits=limits).params

    kept = build({"allowed_token_ids": [vocab - 1], "bad_words": ["x"]})
    assert kept["allowed_token_ids"] == [vocab - 1] and kept["bad_words"] == ["x"]
    assert "allowed_token_ids" not in build({}) and "bad_words" not in build({"bad_words": []})
    for params, field in (({"allowed_token_ids": [vocab]}, "params.allowed_token_ids"),
                          ({"allowed_token_ids": []}, "params.allowed_token_ids"),
                          ({"allowed_token_ids": [-1]}, "params.allowed_token_ids"),
                          ({"bad_words": [""]}, "params.bad_words"),
                          ({"bad_words": ["w"] * 129}, "params.bad_words")):
        with pytest.raises(ValidationError) as err:
            build(params)
        assert err.value.field == field, (params, err.value)


def test_the_openai_routes_pass_them():
    tr = oa.translate_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            "allowed_token_ids": [3, 4], "bad_words": ["no"]})
    assert tr.body["params"]["allowed_token_ids"] == [3, 4] and tr.body["params"]["bad_words"] == ["no"]
    plain = oa.translate_completion({"model": "m", "prompt": "hi", "bad_words": []}).body["params"]
    assert "allowed_token_ids" not in plain and "bad_words" not in plain
