"""A tiny random Llama with the built-in byte-level BPE tokenizer behind a `GenerateRunner`: the engine tests that
compare batched rows (one joining late) with `generate` on each prompt alone (penalties, structured output)."""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from gpu_worker.generate_runner import GenerateRunner
from gpu_worker.models import LoadedModel, build_bpe_tokenizer
from gpu_worker.outcomes import Outcome
from shared.config import ModelSpec
from shared.messages import InferenceRequest, RequestResult
from shared.states import Priority, Task
from tests.torch_device import DEVICE

TOKENIZER = PreTrainedTokenizerFast(tokenizer_object=build_bpe_tokenizer(), pad_token="<pad>", bos_token="<s>",
                                    eos_token="</s>", unk_token="<unk>")
LATE = "c"  # the row that joins after three steps


def tiny_llama(seed: int, eos: int | None = None) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=len(TOKENIZER), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, eos_token_id=eos, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval().to(DEVICE)


def runner_for(model: LlamaForCausalLM) -> GenerateRunner:
    spec = ModelSpec(name="m", task=Task.GENERATE, source="/nowhere", device=str(DEVICE), dtype="float32")
    loaded = LoadedModel(spec=spec, path=None, model=model, tokenizer=TOKENIZER, device=DEVICE,
                         dtype=torch.float32)
    return GenerateRunner(loaded, "w", max_rows=4, max_seq_len=128)


def request(rid: str, ids: list[int], params: dict[str, Any], new: int,
            streamed: list[int] | None = None) -> InferenceRequest:
    now = int(time.time() * 1000)
    return InferenceRequest(id=rid, tenant="t", model="m", task=Task.GENERATE, input={"input_ids": ids},
                            params={"max_new_tokens": new, **params}, lane="short", priority=Priority.INTERACTIVE,
                            created_ms=now, deadline_ms=now + 600_000, est_tokens=len(ids) + new,
                            stream=streamed is not None, streamed=streamed or [])


def served(model: LlamaForCausalLM, prompts: dict[str, list[int]], params: dict[str, dict[str, Any]],
           new: int) -> dict[str, RequestResult]:
    """Every row but `LATE` together, `LATE` joining after three steps: each row's result."""
    runner = runner_for(model)
    first = [runner.prepare(request(r, ids, params[r], new), time.time()) for r, ids in prompts.items() if r != LATE]
    done = runner.start(first, time.time())  # type: ignore[arg-type]
    for _ in range(3):
        done += runner.step()
    done += runner.start([runner.prepare(request(LATE, prompts[LATE], params[LATE], new), time.time())],  # type: ignore
                         time.time())
    while runner.busy:
        done += runner.step()
    return {o.result.id: o.result for o in done if isinstance(o, Outcome)}


def run_alone(runner: GenerateRunner, req: InferenceRequest) -> RequestResult:
    """One request started and stepped until it is done."""
    done = runner.start([runner.prepare(req, time.time())], time.time())  # type: ignore[list-item]
    while runner.busy:
        done += runner.step()
    (out,) = [o for o in done if isinstance(o, Outcome)]
    return out.result
