"""Length-class lanes: which stream a request goes to, by its estimated token count.

Pure functions. The gateway uses the cheap estimate (no tokenizer, no model); the worker re-checks
with the model's real tokenizer and files the request under the lane its true size belongs to.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# A byte-level or WordPiece tokenizer yields about one token per 3-5 bytes of English text; dividing
# by 3 errs towards the longer lane, which protects the short lane from misfiled long requests.
BYTES_PER_TOKEN_ESTIMATE = 3


@dataclass(frozen=True, slots=True)
class LaneSpec:
    name: str
    max_tokens: int | None  # None: unbounded (the last lane)
    window_ms: float = 10.0
    max_backlog: int = 10_000
    # the largest fraction of a worker's running rows this lane may hold (1: no limit); keeps rows for
    # the shorter lanes so their requests find one at once instead of queueing behind long work
    max_share: float = 1.0
    # lanes with the same engine share one running batch; each engine is a compute stream of its own in
    # the worker (its own thread, KV cache and, on CUDA, CUDA stream), so the short lane's tokens never
    # wait for a forward that also carries long rows or a long prompt's prefill
    engine: str = "main"


# One running batch for every lane, the lanes as scheduling policy (windows, order, the long lane's share of the
# rows): measured the best default on the 2-core CPU (docs/scheduling.md). `engine="short"` on the short lane
# gives it an engine of its own, overflowing into the main batch when the model is saturated.
DEFAULT_LANES: tuple[LaneSpec, ...] = (
    LaneSpec("short", 128, window_ms=5.0),
    LaneSpec("medium", 512, window_ms=15.0),
    LaneSpec("long", None, window_ms=30.0, max_share=0.75),
)


def assign_lane(tokens: int, lanes: Sequence[LaneSpec]) -> LaneSpec:
    """The first lane whose bound holds `tokens`; the last lane takes everything larger."""
    if not lanes:
        raise ValueError("a model needs at least one lane")
    for lane in lanes:
        if lane.max_tokens is None or tokens <= lane.max_tokens:
            return lane
    return lanes[-1]


def engine_groups(lanes: Sequence[LaneSpec]) -> list[tuple[str, tuple[LaneSpec, ...]]]:
    """The model's engines in lane order (the engine of the shortest lane first), each with its lanes."""
    groups: dict[str, list[LaneSpec]] = {}
    for lane in lanes:
        groups.setdefault(lane.engine, []).append(lane)
    return [(name, tuple(group)) for name, group in groups.items()]


def estimate_text_tokens(text: str) -> int:
    return max(1, math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN_ESTIMATE))


MESSAGE_TOKENS = 4  # what a simple chat template adds per message (role, separators)


def estimate_generate_tokens(inp: dict[str, Any], max_new_tokens: int) -> tuple[int, int]:
    """(prompt tokens, prompt + max_new_tokens) from a validated generate input."""
    if "input_ids" in inp:
        prompt = len(inp["input_ids"])
    elif "messages" in inp:  # the chat template adds a few tokens per message, and renders the tools and documents
        prompt = sum(estimate_text_tokens(m["content"]) + MESSAGE_TOKENS for m in inp["messages"]) + 1
        prompt += sum(estimate_text_tokens(json.dumps(inp[k])) for k in ("tools", "documents") if inp.get(k))
    else:
        prompt = estimate_text_tokens(inp["prompt"]) + 1
    return prompt, prompt + max_new_tokens


def estimate_embed_tokens(inp: dict[str, Any], per_text: int | None = None) -> int:
    """Input tokens of a validated embed input (+2 per text for the special tokens; at most `per_text` each, where
    texts are cut)."""
    return sum(min(estimate_text_tokens(t) + 2, per_text or 2**62) for t in inp["texts"])
