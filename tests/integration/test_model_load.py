"""What a user's model directory meets at load: a multimodal checkpoint (its text model's sizes in a sub-config) is
served like its text model; a directory transformers cannot load for the task is refused with one line."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from gpu_worker.generate_runner import GenerateRunner
from gpu_worker.models import LoadedModel, load
from gpu_worker.outcomes import Outcome
from shared.config import ModelSpec
from shared.errors import ConfigError
from shared.messages import InferenceRequest
from shared.states import Priority, Task
from tests.integration.test_generation_config import tiny_llama
from tests.torch_device import DEVICE

PROMPTS = {"a": [5, 17, 300, 42, 9], "b": [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], "c": [100, 200]}
NEW = 6


def tiny_gemma3(vocab: int) -> torch.nn.Module:
    """Gemma 3's checkpoint class (`Gemma3ForConditionalGeneration`: vision tower + text model), tiny: its config
    has no `vocab_size` of its own, only its text config does."""
    base = AutoConfig.for_model("gemma3")
    text = {**base.text_config.to_dict(), "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 256, "sliding_window": 8, "eos_token_id": None, "bos_token_id": None,
            "pad_token_id": None}
    text.pop("layer_types", None)
    vision = {**base.vision_config.to_dict(), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    cfg = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval().to(DEVICE)
    model.generation_config.eos_token_id = None
    return model


def request(rid: str) -> InferenceRequest:
    now = int(time.time() * 1000)
    return InferenceRequest(id=rid, tenant="t", model="m", task=Task.GENERATE, input={"input_ids": PROMPTS[rid]},
                            params={"max_new_tokens": NEW}, lane="short", priority=Priority.INTERACTIVE,
                            created_ms=now, deadline_ms=now + 600_000, est_tokens=len(PROMPTS[rid]) + NEW)


def test_a_multimodal_checkpoint_is_served_as_its_text_model() -> None:
    _, tok = tiny_llama()
    model = tiny_gemma3(len(tok))
    assert not hasattr(model.config, "vocab_size")  # what made the runner fail after the load check passed
    spec = ModelSpec(name="m", task=Task.GENERATE, source="/nowhere", device=str(DEVICE), dtype="float32")
    runner = GenerateRunner(LoadedModel(spec=spec, path=None, model=model, tokenizer=tok, device=DEVICE,
                                        dtype=torch.float32), "w", max_rows=4, max_seq_len=64)
    assert runner.vocab == len(tok)
    done = runner.start([runner.prepare(request(r), time.time()) for r in PROMPTS], time.time())  # type: ignore
    while runner.busy:
        done += runner.step()
    got = {o.result.id: o.result.output["token_ids"] for o in done if isinstance(o, Outcome)}
    for rid, prompt in PROMPTS.items():
        ids = torch.tensor([prompt], device=DEVICE)
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                              min_new_tokens=NEW)[0, len(prompt):].tolist()
        assert got[rid] == want, rid


def _directory(tmp_path: Path, config: dict[str, object]) -> Path:
    _, tok = tiny_llama()
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(("config", "said"), [
    ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "vocab_size": 64, "d_model": 16,
      "d_kv": 4, "d_ff": 32, "num_layers": 1, "num_heads": 2}, "Unrecognized configuration class"),
    ({"model_type": "mine", "architectures": ["MyForCausalLM"],
      "auto_map": {"AutoConfig": "configuration_mine.MyConfig", "AutoModelForCausalLM": "modeling_mine.MyForCausalLM"}},
     "needs its own code"),
])
def test_a_directory_transformers_cannot_load_is_refused_in_one_line(tmp_path: Path, config: dict[str, object],
                                                                      said: str) -> None:
    path = _directory(tmp_path, config)
    spec = ModelSpec(name="mine", task=Task.GENERATE, source=str(path), device="cpu", dtype="float32")
    with pytest.raises(ConfigError) as err:
        load(spec, tmp_path / "cache")
    text = str(err.value)
    assert text.startswith(f"model mine: transformers cannot load {path} as a causal LM") and said in text
    assert "\n" not in text and len(text) < 600, text


def test_a_directory_without_a_tokenizer_is_refused_saying_so(tmp_path: Path) -> None:
    """Weights that load beside no tokenizer: the refusal says the tokenizer is missing (it said transformers
    cannot load the directory "as a causal LM", then the first line of the tokenizer's error, cut mid-sentence)."""
    model, _ = tiny_llama()
    model.save_pretrained(tmp_path / "m")
    spec = ModelSpec(name="mine", task=Task.GENERATE, source=str(tmp_path / "m"), device="cpu", dtype="float32")
    with pytest.raises(ConfigError) as err:
        load(spec, tmp_path / "cache")
    text = str(err.value)
    assert text.startswith(f"model mine: {tmp_path / 'm'} has the model's weights, but it holds no tokenizer"), text
    assert "causal LM" not in text and "\n" not in text


@pytest.mark.parametrize(("model_type", "task"), [("gpt2", Task.GENERATE), ("qwen2", Task.GENERATE),
                                                   ("phi", Task.GENERATE), ("bert", Task.EMBED)])
def test_a_directory_whose_tokenizer_loads_empty_is_refused_saying_so(tmp_path: Path, model_type: str,
                                                                      task: Task) -> None:
    """Where there are no tokenizer files, transformers builds an empty tokenizer of some model types' classes
    instead of raising (GPT-2's and Qwen2's with one token, BERT's with its five special ones): a generation
    worker died at start in a traceback, an embedding model answered every word as [UNK]. Now the same one line as
    a directory whose tokenizer does not load; with a tokenizer_config.json alone, it names the file."""
    from transformers import AutoModel

    sizes = {"gpt2": dict(n_layer=1, n_embd=16, n_head=2), "bert": dict(intermediate_size=32),
             "qwen2": dict(intermediate_size=32, num_key_value_heads=1), "phi": dict(intermediate_size=32)}[model_type]
    if model_type != "gpt2":
        sizes |= dict(num_hidden_layers=1, hidden_size=16, num_attention_heads=2)
    config = AutoConfig.for_model(model_type, vocab_size=100, **sizes)
    torch.manual_seed(0)
    (AutoModel if task is Task.EMBED else AutoModelForCausalLM).from_config(config).save_pretrained(tmp_path / "m")
    spec = ModelSpec(name="mine", task=task, source=str(tmp_path / "m"), device="cpu", dtype="float32")
    with pytest.raises(ConfigError) as err:
        load(spec, tmp_path / "cache")
    text = str(err.value)
    assert text.startswith(f"model mine: {tmp_path / 'm'} has the model's weights, but it holds no tokenizer"), text
    assert "\n" not in text
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    with pytest.raises(ConfigError, match=r"its tokenizer files \(tokenizer_config.json\) do not load: they hold no"):
        load(spec, tmp_path / "cache")


def test_a_failing_disk_is_not_taken_for_a_bad_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error while reading the weights (EIO, a full disk) is the machine's, not the model file's: it is
    raised as it is (the worker exits 1 and is restarted), not turned into a ConfigError (exit 2: fix the
    configuration), which a directory missing a file still is."""
    import errno

    from transformers import AutoModelForCausalLM

    path = _directory(tmp_path, {"model_type": "llama", "vocab_size": 64, "hidden_size": 16,
                                 "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2})
    spec = ModelSpec(name="mine", task=Task.GENERATE, source=str(path), device="cpu", dtype="float32")

    def failing_disk(*args: object, **kw: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", failing_disk)
    with pytest.raises(OSError) as err:
        load(spec, tmp_path / "cache")
    assert not isinstance(err.value, ConfigError) and err.value.errno == errno.EIO
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="transformers cannot load"):  # no weights in it: the directory's fault
        load(spec, tmp_path / "cache")


@pytest.mark.parametrize("max_seq_len", [64, 8])
def test_the_warm_up_times_the_costs_that_stand_in_until_requests_are_measured(max_seq_len: int) -> None:
    """A real model's warm-up gives the scheduler and admission its costs from the first request (a worker that had
    measured nothing estimated every request at 0 s); it leaves no row behind, even where the engine's longest
    sequence is shorter than the timed prompt."""
    model, tok = tiny_llama()
    spec = ModelSpec(name="m", task=Task.GENERATE, source="/nowhere", device=str(DEVICE), dtype="float32")
    runner = GenerateRunner(LoadedModel(spec=spec, path=None, model=model, tokenizer=tok, device=DEVICE,
                                        dtype=torch.float32), "w", max_rows=4, max_seq_len=max_seq_len)
    prior = runner.warm_up()
    # the one-row step and a prefill cost something (how a step splits into a fixed part and a part per row is
    # timing, which a loaded machine skews: CI's other pass made the fixed part 0, the one-row step still 1-5 ms)
    assert prior.step_s + prior.step_per_row_s > 0 and prior.prefill_fixed_s + 64 * prior.prefill_per_token_s > 0, \
        prior
    assert runner.free_rows == 4 and not runner.busy and runner.engine_stats().decode_tokens == 0
    done = runner.start([runner.prepare(request("a"), time.time())], time.time())  # type: ignore[list-item]
    while runner.busy:
        done += runner.step()
    assert len(done) == 1  # it serves as before
