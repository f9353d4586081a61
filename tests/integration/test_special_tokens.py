"""vLLM's `skip_special_tokens` (default true) and how the token that ends an output reads: the text of an EOS or
a stop token is left out unless `include_stop_str_in_output`, special or not, as vLLM's; with
`skip_special_tokens: false` the tokenizer's special tokens are spelled in the text, in the stream as in the
result."""

from __future__ import annotations

import dataclasses
import time

import torch

from gpu_worker.generate_runner import GenerateRunner
from gpu_worker.models import LoadedModel
from gpu_worker.outcomes import Outcome
from shared import openai_shapes as oa
from shared.config import ModelSpec
from shared.states import Task
from tests.integration.test_generation_config import generated, tiny_llama
from tests.integration.test_stop_token_ids import request
from tests.torch_device import DEVICE


def outputs(model, tok, **params) -> tuple[dict, str, str]:
    """The request's result output and finish reason, streamed: and the text its deltas add up to with the part
    the gateway sends last (what the result holds past them: `shared.events`)."""
    spec = ModelSpec(name="m", task=Task.GENERATE, source="/nowhere", device=str(DEVICE), dtype="float32")
    runner = GenerateRunner(LoadedModel(spec=spec, path=None, model=model, tokenizer=tok, device=DEVICE,
                                        dtype=torch.float32), "w", max_rows=2, max_seq_len=128)
    job = runner.prepare(dataclasses.replace(request("a", **params), stream=True), time.time())
    done = runner.start([job], time.time())  # type: ignore[list-item]
    sent = "".join(d.delta.text for d in runner.take_deltas())
    while runner.busy:
        done += runner.step()
        sent += "".join(d.delta.text for d in runner.take_deltas())
    (out,) = [o for o in done if isinstance(o, Outcome)]
    text = out.result.output["text"]
    assert text.startswith(sent), (sent, text)  # the deltas never send what the result leaves out
    return out.result.output, str(out.result.finish_reason), sent


def test_the_ending_tokens_text_is_left_out_unless_asked_for_special_or_not():
    model, tok = tiny_llama()
    plain = generated(model)
    at = next(i for i in range(2, 12) if plain["a"][i] not in plain["a"][:i])
    ordinary = plain["a"][at]  # an EOS that is no special token: its text would show
    assert ordinary not in tok.all_special_ids and tok.decode([ordinary])
    model.generation_config.eos_token_id = ordinary
    out, reason, _ = outputs(model, tok)
    assert reason == "eos" and out["token_ids"] == plain["a"][:at + 1]
    assert out["text"] == tok.decode(plain["a"][:at], skip_special_tokens=True)
    kept, _, _ = outputs(model, tok, include_stop_str_in_output=True)
    assert kept["text"] == tok.decode(plain["a"][:at + 1], skip_special_tokens=True) != out["text"]


def test_special_tokens_are_spelled_where_asked():
    model, tok = tiny_llama()
    unk, eos = tok.unk_token_id, tok.eos_token_id
    three = {"logit_bias": {str(unk): 100.0}, "max_new_tokens": 3}  # the unknown token, drawn three times
    out, reason, sent = outputs(model, tok, **three)
    assert out["token_ids"] == [unk] * 3 and reason == "length" and out["text"] == ""  # special: left out
    out, _, sent = outputs(model, tok, **three, skip_special_tokens=False)
    assert out["text"] == "<unk>" * 3 and sent.startswith("<unk>")  # the stream spells them too
    # a stop string is looked for in the text the caller gets, special tokens spelled
    out, reason, sent = outputs(model, tok, **three, skip_special_tokens=False, stop=["k><u"])
    assert (out["text"], out["token_ids"], reason, sent) == ("<un", [], "stop", "")  # the token it cuts: left out
    out, reason, _ = outputs(model, tok, **three, stop=["k><u"])  # not spelled: no such text
    assert (out["text"], reason) == ("", "length")
    model.generation_config.eos_token_id = eos
    ending = {"logit_bias": {str(eos): 100.0}, "min_tokens": 2, "skip_special_tokens": False}
    out, reason, _ = outputs(model, tok, **ending)
    assert reason == "eos" and out["token_ids"][-1] == eos and len(out["token_ids"]) == 3
    assert "</s>" not in out["text"]  # the EOS that ended it left out, as vLLM's
    out, _, sent = outputs(model, tok, **ending, include_stop_str_in_output=True)
    assert out["text"].endswith("</s>") and not sent.endswith("</s>")  # sent last, from the result


def test_the_openai_routes_pass_it():
    tr = oa.translate_completion({"model": "m", "prompt": "hi", "skip_special_tokens": False})
    assert tr.body["params"]["skip_special_tokens"] is False
    assert "skip_special_tokens" not in oa.translate_completion({"model": "m", "prompt": "hi"}).body["params"]
