"""Which keys each layer of a causal LM may attend to, so the engine's masks match the model's own.

The engine hands the model explicit 4D masks (rows are right-aligned in a shared cache, so the
model's own mask builders cannot be used), which transformers applies as given. So the engine must
reproduce every layer's attention pattern itself:
- full causal attention (Llama, GPT-2, ...);
- a sliding window of the last W positions on every layer, when the model builds its mask with
  `create_sliding_window_causal_mask` from `config.sliding_window` (Mistral, Mixtral, Phi-3, ...);
- one pattern per layer type, when the model takes a dict of masks keyed by `config.layer_types`
  (Gemma 2/3, Qwen2/3, Cohere2, ... mixing `full_attention` and `sliding_attention` layers; Llama 4's
  `chunked_attention`).
A query at position q sees key position k when k <= q and, in a window of W, k > q - W (the rule of
transformers' `sliding_window_overlay`); in chunks of C, k // C == q // C. Anything else (linear or
recurrent layers, other mask builders) cannot be served exactly and is refused when the model loads.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch

from gpu_worker.kv_cache import text_config
from shared.errors import ConfigError

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"


@dataclass(frozen=True, slots=True)
class Pattern:
    window: int | None = None  # attend to the last `window` positions only
    chunk: int | None = None  # attend within the same chunk of `chunk` positions only


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    patterns: dict[str, Pattern]  # by layer type; a single entry when every layer is alike
    by_type: bool  # the model takes {layer type: mask}; otherwise one mask for every layer

    @property
    def plain(self) -> bool:
        return not self.by_type and self.patterns == {FULL: Pattern()}

    @classmethod
    def of(cls, model: Any) -> AttentionLayout:
        cfg = text_config(model)
        name = type(model).__name__
        source = _forward_source(model)
        layer_types = getattr(cfg, "layer_types", None)
        window = getattr(cfg, "sliding_window", None)
        if "causal_mask_mapping" in source and layer_types:
            patterns = {t: _pattern(t, cfg, name) for t in set(layer_types)}
            return cls(patterns, by_type=True)
        if set(layer_types or ()) - {FULL}:
            pass  # layer types the model does not take masks by: refused below
        elif "create_sliding_window_causal_mask" in source:  # every layer windowed when the config says so
            return cls({FULL: Pattern(window=window)}, by_type=False)
        elif "create_causal_mask" in source:
            return cls({FULL: Pattern()}, by_type=False)
        raise ConfigError(f"model {name}: its attention layout (layer types {sorted(set(layer_types or ()))}) is "
                          "not one the engine can reproduce exactly; refusing to serve it rather than serve it wrong")

    def attention_mask(self, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, *,
                       boolean: bool, dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
        """What to pass as `attention_mask`. `allowed`: [rows, 1, q, k] causal-and-padding mask; `q_pos`
        [rows, q] and `k_pos` [rows, k]: each query's and key's position in its own sequence. sdpa takes
        boolean masks (True: attend); eager and others *add* the mask to the scores, so they get 0 / -inf."""
        if self.plain:
            return _as(allowed, boolean, dtype)
        masks: dict[str, torch.Tensor] = {}
        for layer_type, pattern in self.patterns.items():
            mask = allowed
            if pattern.window is not None:
                mask = mask & (k_pos[:, None, None, :] > q_pos[:, None, :, None] - pattern.window)
            if pattern.chunk is not None:
                mask = mask & (k_pos[:, None, None, :] // pattern.chunk == q_pos[:, None, :, None] // pattern.chunk)
            masks[layer_type] = _as(mask, boolean, dtype)
        return masks if self.by_type else masks[FULL]


def _as(allowed: torch.Tensor, boolean: bool, dtype: torch.dtype) -> torch.Tensor:
    if boolean:
        return allowed
    additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return additive.masked_fill(~allowed, torch.finfo(dtype).min)


def _pattern(layer_type: str, cfg: Any, name: str) -> Pattern:
    if layer_type == FULL:
        return Pattern()
    if layer_type == SLIDING and getattr(cfg, "sliding_window", None):
        return Pattern(window=int(cfg.sliding_window))
    if layer_type == CHUNKED and getattr(cfg, "attention_chunk_size", None):
        return Pattern(chunk=int(cfg.attention_chunk_size))
    raise ConfigError(f"model {name}: layers of type {layer_type!r} cannot be served exactly by the engine "
                      "(it reproduces full, sliding-window and chunked attention); refusing to load it")


def _forward_source(model: Any) -> str:
    """The source of the model's modeling module (where transformers builds its masks), or '' if unreadable."""
    try:
        return inspect.getsource(sys.modules[type(model).__module__])
    except (OSError, TypeError, KeyError):
        return ""
