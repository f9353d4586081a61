"""How an encoder's token vectors become one vector per text: the model's own sentence-transformers pipeline
(`modules.json`: a Transformer, then a Pooling module with its `config.json`, then optionally Normalize), as
`SentenceTransformer(path).encode` runs it. A directory without `modules.json` is mean-pooled. A pipeline with a
module batchgate does not run (Dense, LayerNorm, a custom one), or a pooling it does not implement, is refused at
load (`ConfigError`): served, its vectors would differ from the model's own, silently."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shared.errors import ConfigError

# sentence-transformers' modes, in the order its legacy `pooling_mode_*` flags concatenate them
MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "lasttoken")
_LEGACY = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
           "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
           "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
_RUN = {"Transformer", "Pooling", "Normalize"}  # the modules batchgate runs (the encoder itself, pooling, and the
# L2 normalisation it applies unless a request asks `normalize: false`)


def pooling_modes(path: Path | None, name: str) -> tuple[str, ...]:
    """The pooling of the model at `path` (its sentence-transformers pipeline's), or `("mean",)` without one."""
    modules_file = None if path is None else Path(path) / "modules.json"
    if modules_file is None or not modules_file.is_file():
        return ("mean",)
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        kinds = [(str(m["type"]).rsplit(".", 1)[-1], str(m.get("path", ""))) for m in modules]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"model {name}: unreadable {modules_file}: {exc}") from exc
    if other := [kind for kind, _ in kinds if kind not in _RUN]:
        raise ConfigError(f"model {name}: its sentence-transformers pipeline has a {other[0]} module, which "
                          "batchgate does not run (it runs Transformer, Pooling, Normalize): its vectors would differ")
    pooling = [sub for kind, sub in kinds if kind == "Pooling"]
    if not pooling:
        return ("mean",)
    return _modes(Path(path) / pooling[0] / "config.json", name)  # type: ignore[arg-type]


def _modes(config_file: Path, name: str) -> tuple[str, ...]:
    try:
        cfg: dict[str, Any] = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model {name}: unreadable pooling config {config_file}: {exc}") from exc
    if "pooling_mode" in cfg:
        mode = cfg["pooling_mode"]
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        modes = tuple(m for key, m in _LEGACY.items() if cfg.get(key)) or ("mean",)
    if bad := [m for m in modes if m not in MODES]:
        raise ConfigError(f"model {name}: pooling {bad[0]!r} is not one batchgate implements ({', '.join(MODES)})")
    if cfg.get("include_prompt") is False:
        raise ConfigError(f"model {name}: pooling without the prompt (include_prompt: false) is not implemented")
    return modes


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """One vector per row of right-padded token vectors `hidden` [rows, tokens, dim] (`mask` [rows, tokens]: 1 for a
    token), each mode's vector concatenated in order, as sentence-transformers' Pooling computes them."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    count = m.sum(dim=1).clamp(min=1e-9)
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(hidden[:, 0])
        elif mode == "max":
            out.append(hidden.masked_fill(m == 0, -1e9).max(dim=1).values)  # (sentence-transformers' fill)
        elif mode == "mean":
            out.append((hidden * m).sum(dim=1) / count)
        elif mode == "mean_sqrt_len_tokens":
            out.append((hidden * m).sum(dim=1) / count.sqrt())
        elif mode == "lasttoken":
            last = (mask.sum(dim=1) - 1).clamp(min=0)
            out.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return torch.cat(out, dim=-1)
