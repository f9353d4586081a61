"""How long a sequence (prompt and output) a generation model computes exactly as `generate` does, from its
config (`config.json`, or a loaded model's config as a dict). Pure.

Two limits:
- The model's context (`max_position_embeddings`, GPT-2's `n_positions`). Past it a model with learned
  positions has no embedding for the position (its forward raises, and with it the step of every row beside
  it), and any other model is outside what it was built for.
- RoPE whose frequencies depend on the longest position of the forward: `longrope` (Phi-3's long-context
  models) switches to its long factors past `original_max_position_embeddings`; `dynamic` NTK rescales past the
  context itself (the first limit). The engine runs rows of different lengths in one forward, so once any row
  passed the switch every row would be rotated as a long one, which `generate` never does to a short sequence
  alone. Below the switch the frequencies are the model's own.

A request past the limit is refused (422 at the gateway where it can count, else failed by the worker before
it is computed), as OpenAI and vLLM refuse a request over a model's context; the model itself is served.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


def exact_context(config: Mapping[str, Any]) -> int | None:
    """The longest sequence the model computes exactly, or None when its config declares no limit."""
    cfg = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    limits = [n for n in (cfg.get("max_position_embeddings"), cfg.get("n_positions")) if _positive(n)]
    for params in _rope_parameter_sets(cfg):
        if params.get("rope_type", params.get("type")) == "longrope":
            switch = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
            if _positive(switch):
                limits.append(switch)
    return min(limits) if limits else None


# The error code of a request past what a model takes (its context, or its prompt limit): OpenAI's, which clients
# built on its SDK look for to trim a conversation; the gateway's 422 and the worker's failed result both carry it.
CONTEXT_EXCEEDED = "context_length_exceeded"


def context_message(context: int, prompt_tokens: int, new_tokens: int, name: str = "max_new_tokens") -> str:
    """Why a request over the model's context is refused, and what fits (`name`: the field `new_tokens` is)."""
    room = context - prompt_tokens
    fits = (f"at most {room} new tokens fit after this prompt" if room > 0
            else "the prompt alone fills it")
    return (f"prompt ({prompt_tokens} tokens) + {name} ({new_tokens}) = {prompt_tokens + new_tokens} "
            f"exceeds this model's context of {context} tokens; {fits}")


def _positive(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def _rope_parameter_sets(cfg: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The config's RoPE parameters: one set, or one per layer type (`{"full_attention": {...}, ...}`)."""
    for key in ("rope_parameters", "rope_scaling"):
        params = cfg.get(key)
        if not isinstance(params, Mapping):
            continue
        if "rope_type" in params or "type" in params:
            yield params
        else:
            yield from (p for p in params.values() if isinstance(p, Mapping))
