"""An encoder is pooled as its own sentence-transformers pipeline says (CLS for BGE-style models, last token for
GTE-Qwen / Qwen3-Embedding-style ones, max, mean): batchgate's vectors equal `SentenceTransformer.encode`'s, for
a batch of texts of different lengths. A pipeline with a module batchgate does not run (a Dense projection) is
refused at load. Before, every model was mean-pooled: other poolings gave other vectors (cosine 0.5-0.8), a Dense
model the wrong dimension, silently (a user's probe)."""

from __future__ import annotations

import json
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, BertConfig, BertModel

from gpu_worker.embed_runner import EmbedRunner
from gpu_worker.models import load, minilm_path
from gpu_worker.outcomes import Outcome
from gpu_worker.pooling import pooling_modes
from shared.config import ModelSpec
from shared.errors import ConfigError
from shared.messages import InferenceRequest
from shared.states import Priority, Task
from shared.token_limits import TokenLimits

TEXTS = ["a", "the quick brown fox jumps over the lazy dog", "hello world", "one two three four five six seven"]


def st_directory(root: Path, pooling: dict[str, object] | None, *, dense: bool = False,
                 sentence: dict[str, object] | None = None) -> Path:
    """A tiny seeded BERT saved as a sentence-transformers model: Transformer (`sentence`: its
    sentence_bert_config.json), Pooling (`pooling`), Normalize. Its tokenizer is cased."""
    out = root / "model"
    # MiniLM's own vocabulary, cased (`BertTokenizerFast(vocab_file=...)` builds an empty one under transformers 5:
    # every word [UNK], which the worker now refuses to load, and which these comparisons had compared)
    tok = AutoTokenizer.from_pretrained(minilm_path(), do_lower_case=False)
    assert len(tok) > 30_000 and tok("Hello world")["input_ids"] == [101, 100, 2088, 102]  # cased: "Hello" unknown
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    BertModel(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        (out / "1_Pooling").mkdir()
        (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
    if dense:
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (out / "2_Normalize").mkdir()
    modules.append({"idx": 3, "name": "3", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    if sentence is not None:
        (out / "sentence_bert_config.json").write_text(json.dumps(sentence))
    return out


def served(path: Path, cache: Path, texts: list[str] = TEXTS, truncate: bool = False) -> list[list[float]]:
    spec = ModelSpec(name="enc", task=Task.EMBED, source=str(path), device="cpu", dtype="float32")
    runner = EmbedRunner(load(spec, cache), "w")
    now = int(time.time() * 1000)
    req = InferenceRequest(id="e", tenant="t", model="enc", task=Task.EMBED, input={"texts": texts},
                           params={"normalize": True, "truncate": truncate}, lane="short",
                           priority=Priority.INTERACTIVE, created_ms=now, deadline_ms=now + 60_000, est_tokens=10)
    job = runner.prepare(req, time.time())
    (out,) = runner.start([job], time.time())  # type: ignore[list-item]
    assert isinstance(out, Outcome) and out.result.output is not None, out
    return out.result.output["embeddings"]


def reference(path: Path, texts: list[str] = TEXTS) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = SentenceTransformer(str(path), device="cpu")
    return torch.tensor(model.encode(texts, normalize_embeddings=True))


@pytest.mark.parametrize("pooling", [
    {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
    {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False},
    {"pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False},
    {"pooling_mode_mean_tokens": True},
    {"pooling_mode": "lasttoken"},
    {"pooling_mode": ["cls", "mean"]},
    {"pooling_mode_mean_sqrt_len_tokens": True, "pooling_mode_mean_tokens": False},
    {"pooling_mode": ["max", "mean_sqrt_len_tokens"]},
], ids=["cls", "lasttoken", "max", "mean", "new-style", "concatenated", "mean_sqrt_len", "max+mean_sqrt_len"])
def test_vectors_equal_the_models_own_pipeline(tmp_path: Path, pooling: dict[str, object]) -> None:
    path = st_directory(tmp_path, pooling)
    got, want = torch.tensor(served(path, tmp_path / "cache")), reference(path)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_a_directory_without_a_pipeline_is_mean_pooled(tmp_path: Path) -> None:
    path = st_directory(tmp_path, {"pooling_mode_mean_tokens": True})
    want = served(path, tmp_path / "cache")
    (path / "modules.json").unlink()
    shutil.rmtree(path / "1_Pooling")
    assert pooling_modes(path, "enc") == ("mean",)
    assert torch.allclose(torch.tensor(served(path, tmp_path / "cache")), torch.tensor(want), atol=1e-6)


@pytest.mark.parametrize(("kw", "said"), [
    ({"pooling": {"pooling_mode_mean_tokens": True}, "dense": True}, "Dense module"),
    ({"pooling": {"pooling_mode_weightedmean_tokens": True}}, "pooling 'weightedmean'"),
    ({"pooling": {"pooling_mode": "mean", "include_prompt": False}}, "include_prompt"),
])
def test_a_pipeline_batchgate_cannot_run_is_refused_at_load(tmp_path: Path, kw: dict, said: str) -> None:
    path = st_directory(tmp_path, **kw)
    with pytest.raises(ConfigError, match=said):
        served(path, tmp_path / "cache")


def test_the_pipelines_own_text_settings_hold(tmp_path: Path) -> None:
    """`sentence_bert_config.json`: a text is lower-cased first where it says `do_lower_case` (the tokenizer here is
    cased, so the vectors differ without it), and no text is taken past its `max_seq_length` (the model's own
    pipeline cuts there: a longer one is refused, or cut there when the request asks to truncate, so its vector is
    the pipeline's). The built-in MiniLM's is 256 of its 512 positions (it was served 512: texts of 257 to 512
    tokens got vectors `SentenceTransformer.encode` never gives)."""
    texts = ["Hello World", "THE Quick brown FOX", "word " * 40]
    path = st_directory(tmp_path, {"pooling_mode_mean_tokens": True},
                        sentence={"max_seq_length": 16, "do_lower_case": True})
    got, want = torch.tensor(served(path, tmp_path / "cache", texts, truncate=True)), reference(path, texts)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    spec = ModelSpec(name="enc", task=Task.EMBED, source=str(path), device="cpu", dtype="float32")
    runner = EmbedRunner(load(spec, tmp_path / "cache"), "w")
    assert runner.max_len == 16 and TokenLimits().max_text_tokens(spec) == 16  # the worker's and the gateway's
    prior = runner.warm_up()  # timed at no more than the model takes
    assert prior.prefill_fixed_s + 16 * prior.prefill_per_token_s > 0, prior
    assert TokenLimits().count(spec, ["Hello"]) == [3]  # counted lower-cased, as the worker tokenizes it
    now = int(time.time() * 1000)
    req = InferenceRequest(id="e", tenant="t", model="enc", task=Task.EMBED, input={"texts": texts},
                           params={"normalize": True, "truncate": False}, lane="short",
                           priority=Priority.INTERACTIVE, created_ms=now, deadline_ms=now + 60_000, est_tokens=10)
    refused = runner.prepare(req, time.time())
    assert isinstance(refused, Outcome) and "at most 16 per text" in refused.result.error.message
    builtin = ModelSpec(name="minilm", task=Task.EMBED, source="builtin:minilm")
    assert TokenLimits().max_text_tokens(builtin) == 256
