"""Mistral's tool-call tokens kept in the text of a request that offers tools (`gpu_worker.tool_tokens`): its v11
calls, `[TOOL_CALLS]name[ARGS]{...}`, are written with special tokens that decoding otherwise drops, leaving text
no parser can tell from an answer."""

from __future__ import annotations

import copy
import dataclasses
import time

import torch

from gpu_worker.generate_runner import GenerateRunner
from gpu_worker.models import LoadedModel
from gpu_worker.outcomes import Outcome
from gpu_worker.tool_tokens import decode_keeping, special_ids
from shared.config import ModelSpec
from shared.states import Task
from shared.tool_call_formats import kept_tokens, mistral_calls
from tests.tiny_runner import TOKENIZER, request, run_alone, tiny_llama
from tests.torch_device import DEVICE

TAGS = ("[TOOL_CALLS]", "[ARGS]")


def mistral_like():
    """The tests' byte-level BPE with Mistral's tool-call tokens added as special tokens, as in its HF tokenizers
    (`[CALL_ID]` left out: a tokenizer without one of the names is served with the others)."""
    tok = copy.deepcopy(TOKENIZER)
    tok.add_special_tokens({"additional_special_tokens": list(TAGS)})
    return tok


def test_the_tool_tokens_are_spelled_out_and_every_other_special_token_dropped():
    tok = mistral_like()
    kept = special_ids(tok, kept_tokens("mistral"))
    assert sorted(kept.values()) == sorted(TAGS)
    call, args = (tok.convert_tokens_to_ids(t) for t in TAGS)
    words = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids = [*words("Sure."), call, *words("get_weather"), args, *words('{"city": "Paris"}'), tok.eos_token_id]
    text = decode_keeping(tok, ids, kept)
    assert text == 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'  # </s> dropped as before
    assert mistral_calls(text) == ("Sure.", [("get_weather", '{"city": "Paris"}')])
    assert tok.decode(ids, skip_special_tokens=True) == 'Sure.get_weather{"city": "Paris"}'  # what it was
    assert decode_keeping(tok, ids, {}) == tok.decode(ids, skip_special_tokens=True)
    # names that are plain text in a tokenizer, or absent from it, need no keeping
    assert special_ids(TOKENIZER, kept_tokens("mistral")) == {} and special_ids(tok, ()) == {}


def runner(parser: str) -> GenerateRunner:
    tok = mistral_like()
    model = tiny_llama(0)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    spec = ModelSpec(name="m", task=Task.GENERATE, source="/nowhere", device=str(DEVICE), dtype="float32",
                     tool_call_parser=parser)
    return GenerateRunner(LoadedModel(spec=spec, path=None, model=model, tokenizer=tok, device=DEVICE,
                                      dtype=torch.float32), "w", max_rows=4, max_seq_len=128)


def test_a_request_offering_tools_keeps_them_in_its_text_streamed_or_not():
    """The model pushed to write `[TOOL_CALLS]` (a logit bias): a request that offers tools to a `mistral` model
    reads it in its text, streamed deltas too; one without tools, or to a model of another format, does not."""
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    r = runner("mistral")
    call = r.tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    params = {"logit_bias": {call: 100.0}, "ignore_eos": True}

    def served(rr: GenerateRunner, with_tools: bool, stream: bool = False) -> tuple[str, list[str]]:
        """The result's text, and the streamed deltas' texts (the last tokens come with the result)."""
        req = request("a", [5, 6, 7], params, 4, streamed=[] if stream else None)
        if with_tools:
            req = dataclasses.replace(req, input={**req.input, "tools": tools})
        if not stream:
            return run_alone(rr, req).output["text"], []
        done = rr.start([rr.prepare(req, time.time())], time.time())  # type: ignore[list-item]
        deltas = []
        while rr.busy:
            done += rr.step()
            deltas += [d.delta.text for d in rr.take_deltas()]
        (out,) = [o for o in done if isinstance(o, Outcome)]
        return out.result.output["text"], deltas

    assert served(r, True) == ("[TOOL_CALLS]" * 4, [])
    text, deltas = served(r, True, stream=True)
    streamed = "".join(deltas)
    assert text == "[TOOL_CALLS]" * 4 and streamed and streamed == "[TOOL_CALLS]" * (len(streamed) // 12)
    assert served(r, False) == ("", [])
    assert served(runner("hermes"), True) == ("", [])
