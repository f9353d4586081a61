"""A model whose context is shorter than its model file allows (a GPT-2 of 48 learned positions, the file
allowing 40 + 40 tokens): a request past the context is refused at submit where the gateway can count it, else
failed alone by the worker before it is computed; the model is served, and the requests that fit run."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from gpu_worker import models
from gpu_worker.assembly import build_runners
from gpu_worker.job import Job
from gpu_worker.models import build_bpe_tokenizer
from gpu_worker.outcomes import Outcome
from shared.config import ModelSpec
from shared.errors import ValidationError
from shared.faults import Faults
from shared.messages import InferenceRequest
from shared.states import Priority, Status, Task
from shared.submit import build_request
from shared.token_limits import TokenLimits

CONTEXT = 48


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    path = tmp_path_factory.mktemp("gpt2-48")
    tok = PreTrainedTokenizerFast(tokenizer_object=build_bpe_tokenizer(), pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", unk_token="<unk>")
    cfg = AutoConfig.for_model("gpt2", vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=CONTEXT,
                               eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return ModelSpec(name="g", task=Task.GENERATE, source=str(path), device="cpu", dtype="float32",
                     max_input_tokens=40, max_new_tokens=40, default_max_new_tokens=32, max_running=4)


def test_the_gateway_refuses_or_fits_a_request_to_the_models_context(short_context_model):
    spec, limits = short_context_model, TokenLimits()

    def submit(body):
        return build_request(body, spec, "t", time.time(), limits=limits)

    ids = list(range(5, 35))  # 30 tokens
    with pytest.raises(ValidationError) as err:  # asked for 30 new tokens: 60 > 48
        submit({"input": {"input_ids": ids}, "params": {"max_new_tokens": 30}})
    assert err.value.field == "params.max_new_tokens" and "at most 18 new tokens fit" in err.value.message
    assert submit({"input": {"input_ids": ids}, "params": {"max_new_tokens": 18}}).params["max_new_tokens"] == 18
    # no max_new_tokens given: the default (32) shrinks to what fits
    assert submit({"input": {"input_ids": ids}}).params["max_new_tokens"] == 18
    with pytest.raises(ValidationError) as err:  # a prompt that fills the context alone
        submit({"input": {"input_ids": list(range(5, 45)) + list(range(5, 13))}})
    assert err.value.field == "input.input_ids"
    counted = submit({"input": {"prompt": "hello world"}})  # counted by the model's own tokenizer
    assert counted.params["max_new_tokens"] == 32


def request(rid: str, ids: list[int], new: int) -> InferenceRequest:
    now = int(time.time() * 1000)
    return InferenceRequest(id=rid, tenant="t", model="g", task=Task.GENERATE, input={"input_ids": ids},
                            params={"max_new_tokens": new}, lane="short", priority=Priority.INTERACTIVE,
                            created_ms=now, deadline_ms=now + 600_000, est_tokens=len(ids) + new)


def test_the_worker_fails_a_request_past_the_context_alone_and_serves_the_rest(short_context_model, tmp_path):
    loaded = models.load(short_context_model, tmp_path)
    (runner,) = build_runners(loaded, "w", Faults(), [("all", short_context_model.lanes)])
    assert runner.engine.max_seq_len == CONTEXT  # rows sized for the context, not the model file's 80
    over = runner.prepare(request("over", list(range(5, 35)), 30), time.time())  # within the file: 60 <= 80
    assert isinstance(over, Outcome) and over.result.status is Status.FAILED
    assert over.result.error.code == "context_length_exceeded" and "context of 48" in over.result.error.message
    jobs = [runner.prepare(request(f"fit-{i}", list(range(5, 5 + n)), CONTEXT - n), time.time())
            for i, n in enumerate((3, 20, 30))]
    assert all(isinstance(j, Job) for j in jobs)
    done = runner.start(jobs, time.time())  # type: ignore[arg-type]
    while runner.busy:
        done += runner.step()
    results = {o.result.id: o.result for o in done if isinstance(o, Outcome)}
    assert {rid: r.status for rid, r in results.items()} == {f"fit-{i}": Status.SUCCEEDED for i in range(3)}
    assert [len(results[f"fit-{i}"].output["token_ids"]) for i in range(3)] == [45, 28, 18]  # to the last position
