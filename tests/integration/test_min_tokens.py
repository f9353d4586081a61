"""vLLM's `min_tokens`: below them a row draws neither its EOS nor its stop tokens, and no stop string ends it;
greedy, it is `generate` with `min_new_tokens` token for token; its batch-mates are not held."""

from __future__ import annotations

import pytest
import torch

from shared import openai_shapes as oa
from tests.integration.test_generation_config import NEW, PROMPTS, generated, tiny_llama
from tests.integration.test_stop_token_ids import request, serve


def reference(model, ids: list[int], ends: list[int], least: int) -> list[int]:
    seq = model.generate(torch.tensor([ids], device=model.device), do_sample=False, max_new_tokens=NEW,
                         min_new_tokens=least, eos_token_id=ends, pad_token_id=ends[0],
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=model.device))
    return seq[0, len(ids):].tolist()


def test_greedy_rows_with_min_tokens_are_generate_with_min_new_tokens():
    model, tok = tiny_llama()
    plain = generated(model)
    at = next(i for i in range(2, NEW // 2) if plain["a"][i] not in plain["a"][:i])  # a token met there first
    eos = plain["a"][at]
    model.generation_config.eos_token_id = eos
    assert serve(model, tok, [request("a")])["a"] == (plain["a"][:at + 1], "eos")  # the EOS ends it there
    least = at + 3
    want = reference(model, PROMPTS["a"], [eos], least)
    assert eos not in want[:least] and len(want) > least  # the premise: generate went on past the EOS
    got = serve(model, tok, [request("a", min_tokens=least), request("b")])
    assert got["a"][0] == want and got["a"][1] == ("eos" if want[-1] == eos else "length")
    assert got["b"] == serve(model, tok, [request("b")])["b"]  # its batch-mate is not held
    # its stop tokens too: generate bans every id of its eos_token_id list
    stop = plain["a"][1]  # drawn below min_tokens in the plain output
    assert stop != eos and stop in want[:least]
    both = reference(model, PROMPTS["a"], [eos, stop], least)
    assert both[:least] != want[:least]  # banning it changed the output
    got = serve(model, tok, [request("a", min_tokens=least, stop_token_ids=[stop])])
    assert got["a"][0] == both


def test_a_forced_end_token_waits_for_min_tokens_greedy_and_sampled():
    """A stop token biased to be drawn every step: the row holds exactly min_tokens tokens before it."""
    model, tok = tiny_llama()
    forced = 42
    for sampling in ({}, {"temperature": 1.0, "seed": 7}):
        got = serve(model, tok, [request("a", stop_token_ids=[forced], logit_bias={str(forced): 100.0},
                                         min_tokens=5, **sampling)])
        ids, reason = got["a"]
        assert len(ids) == 6 and ids[-1] == forced and forced not in ids[:5] and reason == "stop", (sampling, ids)


def test_ignore_eos_still_bans_the_eos_below_min_tokens():
    """vLLM bans the model's EOS below min_tokens whether or not it ends the output (ignore_eos): benchmark clients
    send both, to have exactly so many tokens of text."""
    model, tok = tiny_llama()
    eos = tok.eos_token_id
    model.generation_config.eos_token_id = eos
    got = serve(model, tok, [request("a", logit_bias={str(eos): 100.0}, ignore_eos=True, min_tokens=3,
                                     max_new_tokens=5)])
    ids, reason = got["a"]
    assert eos not in ids[:3] and ids[3:] == [eos, eos] and reason == "length", ids


def test_the_openai_routes_pass_it():
    tr = oa.translate_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "min_tokens": 4})
    assert tr.body["params"]["min_tokens"] == 4
    assert "min_tokens" not in oa.translate_completion({"model": "m", "prompt": "hi"}).body["params"]
    with pytest.raises(oa.OpenAIError) as err:  # the prompt scored alone: no token is kept
        oa.translate_completion({"model": "m", "prompt": "hi", "echo": True, "max_tokens": 0, "min_tokens": 1})
    assert err.value.param == "min_tokens"
