"""vLLM's `stop_token_ids`: a row ends where it draws one of its request's stop tokens, the token kept in its
output, `finish_reason` stop; its batch-mates go on; `ignore_eos` leaves them in force; a token outside the
vocabulary is refused."""

from __future__ import annotations

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
from tests.integration.test_generation_config import NEW, PROMPTS, generated, tiny_llama
from tests.torch_device import DEVICE


def request(rid: str, **params) -> InferenceRequest:
    now = int(time.time() * 1000)
    return InferenceRequest(id=rid, tenant="t", model="m", task=Task.GENERATE, input={"input_ids": PROMPTS[rid]},
                            params={"max_new_tokens": NEW, **params}, lane="short", priority=Priority.INTERACTIVE,
                            created_ms=now, deadline_ms=now + 600_000, est_tokens=len(PROMPTS[rid]) + NEW)


def serve(model, tok, requests: list[InferenceRequest]) -> dict[str, tuple[list[int], str]]:
    spec = ModelSpec(name="m", task=Task.GENERATE, source="/nowhere", device=str(DEVICE), dtype="float32")
    loaded = LoadedModel(spec=spec, path=None, model=model, tokenizer=tok, device=DEVICE, dtype=torch.float32)
    runner = GenerateRunner(loaded, "w", max_rows=4, max_seq_len=128)
    done = runner.start([runner.prepare(r, time.time()) for r in requests], time.time())  # type: ignore[misc]
    while runner.busy:
        done += runner.step()
    return {o.result.id: (o.result.output["token_ids"], o.result.finish_reason) for o in done
            if isinstance(o, Outcome)}


def test_a_row_ends_at_its_stop_token_and_keeps_it():
    model, tok = tiny_llama()
    plain = generated(model)
    at = next(i for i in range(2, NEW) if plain["a"][i] not in plain["a"][:i])  # a token met there first
    stop = plain["a"][at]
    got = serve(model, tok, [request("a", stop_token_ids=[stop]), request("b")])
    assert got["a"] == (plain["a"][:at + 1], "stop")
    assert got["b"] == (plain["b"], "length")  # its batch-mate goes on
    got = serve(model, tok, [request("a", stop_token_ids=[stop], ignore_eos=True)])
    assert got["a"] == (plain["a"][:at + 1], "stop")
    never = next(t for t in range(tok.vocab_size) if t not in plain["a"])
    assert serve(model, tok, [request("a", stop_token_ids=[never])])["a"] == (plain["a"], "length")


def test_ids_outside_the_vocabulary_are_refused_at_submit_and_by_the_worker(model_cache, loaded_models):
    spec = BUILTIN_MODELS["tiny-llama"]
    limits = TokenLimits(model_cache)
    vocab = limits.vocab_size(spec)
    assert vocab is not None
    ok = build_request({"input": {"prompt": "hi"}, "params": {"stop_token_ids": [vocab - 1]}}, spec, "t",
                       time.time(), limits=limits)
    assert ok.params["stop_token_ids"] == [vocab - 1]
    assert "stop_token_ids" not in build_request({"input": {"prompt": "hi"}}, spec, "t", time.time()).params
    for bad, field in (([vocab], "params.stop_token_ids"), ([-1], "params.stop_token_ids"),
                       ([1] * 65, "params.stop_token_ids")):
        with pytest.raises(ValidationError) as err:
            build_request({"input": {"prompt": "hi"}, "params": {"stop_token_ids": bad}}, spec, "t", time.time(),
                          limits=limits)
        assert err.value.field == field
    model, tok = tiny_llama()
    got = GenerateRunner(LoadedModel(spec=ModelSpec(name="m", task=Task.GENERATE, source="/x", device=str(DEVICE),
                                                    dtype="float32"), path=None, model=model, tokenizer=tok,
                                     device=DEVICE, dtype=torch.float32), "w", max_rows=2, max_seq_len=64
                         ).prepare(request("a", stop_token_ids=[len(tok) + 5]), time.time())
    assert isinstance(got, Outcome) and got.result.error is not None and got.result.error.code == "invalid_input"


def test_the_openai_routes_pass_them():
    tr = oa.translate_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [7]})
    assert tr.body["params"]["stop_token_ids"] == [7]
    assert "stop_token_ids" not in oa.translate_completion({"model": "m", "prompt": "hi"}).body["params"]


def test_a_failed_format_is_an_error_even_where_the_unmasked_token_would_end_the_row():
    """A row whose grammar failed drew its token unmasked: never a complete answer, whether that token is an EOS,
    a stop token or anything else."""
    from types import SimpleNamespace

    from gpu_worker.sequences import GenSpec, Row, finish_reason
    from shared.states import FinishReason

    def row(failed: str | None, token: int) -> Row:
        spec = GenSpec(id="r", prompt_ids=(1,), max_new_tokens=8, eos_ids=frozenset({2}), stop_ids=frozenset({3}),
                       constraint=SimpleNamespace(failed=failed, done=failed is not None))
        return Row(spec=spec, start=0, tokens=[5, token], generator=None, admitted_at=0.0, prefill_s=0.0,
                   first_token_at=0.0)

    for token in (2, 3, 9):
        assert finish_reason(row("grammar error", token), None) is FinishReason.ERROR
    assert finish_reason(row(None, 2), None) is FinishReason.EOS
    assert finish_reason(row(None, 3), None) is FinishReason.STOP
    assert finish_reason(row(None, 9), None) is None
