"""A model's `generation_config` as `generate` applies it: its repetition penalty changes the greedy tokens, and
the engine applies it too (batched rows, a late joiner); what it does not apply is named at load."""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from gpu_worker.generate_runner import GenerateRunner
from gpu_worker.generation_config import ignored_generation_settings, unapplied_sampling_defaults
from gpu_worker.models import LoadedModel, build_bpe_tokenizer
from gpu_worker.outcomes import Outcome
from shared.config import ModelSpec
from shared.messages import InferenceRequest
from shared.states import Priority, Task
from tests.torch_device import DEVICE, on_device

NEW = 24
PROMPTS = {"a": [5, 9, 5, 9, 5, 9, 17], "b": [30, 31, 32], "c": [40, 41, 40, 41, 40, 41, 40, 41, 40, 41, 7]}


def tiny_llama() -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    tok = PreTrainedTokenizerFast(tokenizer_object=build_bpe_tokenizer(), pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", unk_token="<unk>")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(3)
    return LlamaForCausalLM(cfg).eval().to(DEVICE), tok


def request(rid: str) -> InferenceRequest:
    now = int(time.time() * 1000)
    return InferenceRequest(id=rid, tenant="t", model="m", task=Task.GENERATE, input={"input_ids": PROMPTS[rid]},
                            params={"max_new_tokens": NEW}, lane="short", priority=Priority.INTERACTIVE,
                            created_ms=now, deadline_ms=now + 600_000, est_tokens=len(PROMPTS[rid]) + NEW)


def served(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast) -> dict[str, list[int]]:
    """Rows a and b together, c joining after three steps: each row's tokens."""
    spec = ModelSpec(name="m", task=Task.GENERATE, source="/nowhere", device=str(DEVICE), dtype="float32")
    loaded = LoadedModel(spec=spec, path=None, model=model, tokenizer=tok, device=DEVICE,
                         dtype=torch.float32)
    runner = GenerateRunner(loaded, "w", max_rows=4, max_seq_len=128)
    done = runner.start([runner.prepare(request(r), time.time()) for r in ("a", "b")], time.time())  # type: ignore
    for _ in range(3):
        done += runner.step()
    done += runner.start([runner.prepare(request("c"), time.time())], time.time())  # type: ignore[list-item]
    while runner.busy:
        done += runner.step()
    return {o.result.id: o.result.output["token_ids"] for o in done if isinstance(o, Outcome)}


@on_device
def generated(model: LlamaForCausalLM) -> dict[str, list[int]]:
    out = {}
    for rid, ids in PROMPTS.items():
        seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)
        out[rid] = seq[0, len(ids):].tolist()
    return out


def test_the_models_repetition_penalty_is_applied_as_generate_applies_it():
    model, tok = tiny_llama()
    plain = generated(model)
    assert served(model, tok) == plain
    model.generation_config.repetition_penalty = 1.8
    penalized = generated(model)
    assert penalized != plain  # the penalty changes the greedy tokens of this model: the check can fail
    assert served(model, tok) == penalized


def test_settings_the_engine_does_not_apply_are_named():
    assert ignored_generation_settings(GenerationConfig()) == {}
    assert ignored_generation_settings(GenerationConfig(repetition_penalty=1.1, temperature=0.7, top_p=0.8)) == {}
    cfg = GenerationConfig(no_repeat_ngram_size=3, suppress_tokens=[5], forced_bos_token_id=0, num_beams=4)
    assert ignored_generation_settings(cfg) == {"no_repeat_ngram_size": 3, "suppress_tokens": [5],
                                                "forced_bos_token_id": 0, "num_beams": 4}


def test_sampling_defaults_are_named_not_applied():
    """A model that samples by default (do_sample) is named at load with the values its file sets; requests sample
    by their own parameters (a greedy request stays greedy)."""
    assert unapplied_sampling_defaults(GenerationConfig()) == {}
    assert unapplied_sampling_defaults(GenerationConfig(temperature=0.7, top_p=0.8)) == {}  # generate: greedy
    cfg = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.1)
    assert unapplied_sampling_defaults(cfg) == {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
    assert unapplied_sampling_defaults(GenerationConfig(do_sample=True)) == {"do_sample": True}
