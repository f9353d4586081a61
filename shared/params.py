"""Validation of a request's `input` and `params` per task. Pure; raises `ValidationError` with the field.

The gateway validates once at submit; the worker re-reads the normalised dicts with the same code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, cast

from shared.errors import ValidationError

MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 64
MAX_SEED = 2**63 - 1


def finite_number(value: Any) -> float | None:
    """The value as a finite float, or None if it is not a number, a bool, infinite, NaN or too large."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _int(raw: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int, path: str) -> int | None:
    value = raw.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{path}.{name}", f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValidationError(f"{path}.{name}", f"must be between {lo} and {hi}, got {value}")
    return value


def _float(raw: Mapping[str, Any], name: str, default: float, lo: float, hi: float, path: str) -> float:
    value = finite_number(raw.get(name, default))
    if value is None:
        raise ValidationError(f"{path}.{name}", "must be a finite number")
    if not lo <= value <= hi:
        raise ValidationError(f"{path}.{name}", f"must be between {lo} and {hi}, got {value}")
    return value


def _bool(raw: Mapping[str, Any], name: str, default: bool, path: str) -> bool:
    value = raw.get(name, default)
    if not isinstance(value, bool):
        raise ValidationError(f"{path}.{name}", "must be true or false")
    return value


def _reject_unknown(raw: Mapping[str, Any], known: set[str], path: str) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValidationError(f"{path}.{unknown[0]}", f"unknown field (allowed: {', '.join(sorted(known))})")


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValidationError(path, "must be an object")
    return value


@dataclass(frozen=True, slots=True)
class GenerateParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["stop"] = list(self.stop)
        return out

    @classmethod
    def parse(cls, raw: Any, *, limit: int, default_max_new_tokens: int) -> GenerateParams:
        raw = _mapping(raw, "params")
        _reject_unknown(raw, {"max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"},
                        "params")
        stop = raw.get("stop", [])
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise ValidationError("params.stop", "must be a string or a list of non-empty strings")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in stop):
            raise ValidationError("params.stop",
                                  f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters")
        max_new = _int(raw, "max_new_tokens", min(default_max_new_tokens, limit), 1, limit, "params")
        return cls(
            max_new_tokens=cast(int, max_new),
            temperature=_float(raw, "temperature", 0.0, 0.0, 10.0, "params"),
            top_p=_float(raw, "top_p", 1.0, 1e-6, 1.0, "params"),
            top_k=_int(raw, "top_k", 0, 0, 1_000_000, "params") or 0,
            seed=_int(raw, "seed", None, 0, MAX_SEED, "params"),
            stop=tuple(stop),
            ignore_eos=_bool(raw, "ignore_eos", False, "params"),
        )


@dataclass(frozen=True, slots=True)
class EmbedParams:
    normalize: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def parse(cls, raw: Any) -> EmbedParams:
        raw = _mapping(raw, "params")
        _reject_unknown(raw, {"normalize"}, "params")
        return cls(normalize=_bool(raw, "normalize", True, "params"))


def parse_generate_input(raw: Any, *, max_prompt_chars: int, max_input_tokens: int) -> dict[str, Any]:
    """Exactly one of `prompt` (text) or `input_ids` (token ids)."""
    if not isinstance(raw, Mapping):
        raise ValidationError("input", "must be an object with `prompt` (string) or `input_ids` (integers)")
    _reject_unknown(raw, {"prompt", "input_ids"}, "input")
    if ("prompt" in raw) == ("input_ids" in raw):
        raise ValidationError("input", "give exactly one of `prompt` or `input_ids`")
    if "prompt" in raw:
        prompt = raw["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValidationError("input.prompt", "must be a non-empty string")
        if len(prompt) > max_prompt_chars:
            raise ValidationError("input.prompt", f"longer than {max_prompt_chars} characters")
        return {"prompt": prompt}
    ids = raw["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise ValidationError("input.input_ids", "must be a non-empty list of integers")
    if len(ids) > max_input_tokens:
        raise ValidationError("input.input_ids", f"more than {max_input_tokens} tokens")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31 for i in ids):
        raise ValidationError("input.input_ids", "must hold non-negative integers")
    return {"input_ids": list(ids)}


def parse_embed_input(raw: Any, *, max_texts: int, max_text_chars: int) -> dict[str, Any]:
    """`texts` (list of strings) or `text` (one string); normalised to `texts`."""
    if not isinstance(raw, Mapping):
        raise ValidationError("input", "must be an object with `texts` (list of strings) or `text`")
    _reject_unknown(raw, {"texts", "text"}, "input")
    if ("texts" in raw) == ("text" in raw):
        raise ValidationError("input", "give exactly one of `texts` or `text`")
    texts = [raw["text"]] if "text" in raw else raw["texts"]
    field = "input.text" if "text" in raw else "input.texts"
    if not isinstance(texts, list) or not texts:
        raise ValidationError(field, "must be a non-empty list of strings")
    if len(texts) > max_texts:
        raise ValidationError(field, f"at most {max_texts} texts per request")
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            raise ValidationError(f"{field}[{i}]", "must be a non-empty string")
        if len(text) > max_text_chars:
            raise ValidationError(f"{field}[{i}]", f"longer than {max_text_chars} characters")
    return {"texts": list(texts)}
