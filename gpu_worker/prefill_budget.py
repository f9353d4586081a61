"""How many prompt tokens a step may prefill while rows decode. Pure: numbers in, a token count out.

A prefill beside decoding rows is time every running row waits between two of its tokens, so the
scheduler bounds it per step:
- a lone engine: `prefill_chunk_tokens` of the model's config while rows decode (a longer prompt is
  prefilled in chunks), no bound with none decoding;
- a background engine taking turns with a foreground one on one compute thread (`gpu_worker.turns`):
  `BACKGROUND_CHUNK_TOKENS` while the foreground has rows running, `BACKGROUND_IDLE_CHUNK_TOKENS` in the
  lulls between them;
- a chunk fused into the decode step (`gpu_worker.fused_step`): sized per step by `fused_chunk`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from gpu_worker.robust_line import Line

# A background engine's turn beside a busy foreground engine prefills at most this many prompt tokens (a 64-token
# forward costs about a decode step here), new prompts and long ones in chunks alike, with or without rows of its
# own decoding: a short row then waits at most one decode step and one such chunk of long work between two of its
# tokens, and long work still starts at once.
BACKGROUND_CHUNK_TOKENS = 64
# ... and while the foreground engine is idle, at most this many: a short request arriving then waits out no
# more than that (a batch of four 256-token prompts at once is ~350 ms here), and long work still moves fast.
BACKGROUND_IDLE_CHUNK_TOKENS = 128
# A chunk fused into the decode step is sized to add at most FUSED_STEP_SHARE of a bare decode step, so a running
# row's gap between tokens stays under twice a step: on a GPU, where a step costs about the same for a few more
# tokens, that is hundreds of tokens; on a small CPU, where every token costs, a handful. Never fewer than this,
# and more when the prompt's deadline needs them.
FUSED_MIN_CHUNK = 4
FUSED_STEP_SHARE = 0.5  # of a bare decode step, what the chunk may add (the round's other work and noise fit the rest)
# What a fused chunk adds is a fixed part (the chunk's own attention calls, masks, launches) plus a part per token,
# read off a line through the recent chunks (`ServiceTracker.fused_line`). Where the fixed part alone takes the
# share (an H100: ~4 ms a fused step whatever the chunk, against a 6.5 ms decode step), every fused step costs the
# rows it, and the fewest such steps are chunks whose tokens add FUSED_TOKEN_SHARE of the share on top. Without
# that floor, the room left for tokens jumped between none and the whole share as noise moved the fixed part
# across it, and a noisy step read the fixed part low, left a sliver of room, and shrank the chunks to a handful
# of tokens (an H100's 2,048-token prompt took 50-150 fused steps).
FUSED_TOKEN_SHARE = 0.5
FUSED_RECENT = 4  # the last chunks whose median cost per token the line's slope is never read under
FUSED_FIRST_CHUNKS = 3  # chunks that double from the minimum before a line can be drawn through them
FUSED_DEADLINE_MARGIN = 1.5  # the chunked prompt's remaining work, estimated, times this must fit its deadline


def step_budget(chunk_tokens: int | None, decoding: int, *, background: bool = False,
                yielding: bool = False) -> int | None:
    """Prompt tokens one step may prefill while `decoding` rows decode, or at all on a `background` engine (fewer
    while `yielding` to a busy foreground engine); None: no bound (no row waits on this engine's forwards), or
    chunked prefill is off (`chunk_tokens` None or 0)."""
    if not chunk_tokens:
        return None
    if yielding:
        return min(chunk_tokens, BACKGROUND_CHUNK_TOKENS)
    if background:
        return min(chunk_tokens, BACKGROUND_IDLE_CHUNK_TOKENS)
    return chunk_tokens if decoding > 0 else None


def fused_chunk(chunk_tokens: int | None, *, protect: bool, line: Line | None, recent: Sequence[tuple[int, float]],
                bare_step_s: float, interval_s: float, chunk_left: int, deadline_left_s: float | None,
                new_tokens: int, previous: int = 0) -> int:
    """Prompt tokens the next fused step carries, between FUSED_MIN_CHUNK and `chunk_tokens`:
    - the most whose tokens, at the `line`'s cost per token (through the recent chunks: their fixed part and cost
      per token), fit the room the fixed part leaves of `FUSED_STEP_SHARE` of a bare decode step (`bare_step_s`),
      and never less room than `FUSED_TOKEN_SHARE` of that share, so the rows' gap stays under 2x a step;
    - the cost per token is never read under the median of what the last `recent` chunks' tokens cost ((tokens,
      what the chunk added to its step), newest last): noise reads a slope low, down to none;
    - at most half the last chunk when its tokens put the rows' gap past 2x a step (or added more than a share,
      where the fixed part alone takes it), or when it and the one before both added more than a share of tokens;
    - FUSED_MIN_CHUNK before any chunk is measured; twice the `previous` chunk for the first chunks, before a
      line can be drawn, and at the minimum while the line's slope cannot be told from noise (a few tokens' noise
      reads as a dear token, and would hold the chunks at the minimum); a quarter less than the `previous` one when
      the recent sizes are too alike to draw a line through;
    - at most twice the `previous` fused chunk (one cheap-looking chunk must not make the next one huge);
    - more if the chunked prompt needs them to meet its deadline (`chunk_left` prompt tokens to go, then
      `new_tokens` at `interval_s` each, all within `deadline_left_s`);
    - the most allowed when no interactive row decodes beside it (`protect` false)."""
    cap = max(chunk_tokens or FUSED_MIN_CHUNK, FUSED_MIN_CHUNK)
    if not protect:
        return cap
    share_s = FUSED_STEP_SHARE * bare_step_s
    if not recent or bare_step_s <= 0:
        size = FUSED_MIN_CHUNK
    elif line is None and len(recent) >= FUSED_FIRST_CHUNKS and previous > FUSED_MIN_CHUNK:
        # recent sizes too alike to tell the fixed part from the per-token one: a quarter smaller, which the next
        # line can be drawn through and which costs the rows less, not more
        size = previous * 3 // 4
        if _past_2x(recent, bare_step_s, share_s, line):
            size = min(size, recent[-1][0] // 2)
    elif line is None or (previous <= FUSED_MIN_CHUNK and line.slope_low <= 0):
        size = 2 * previous
    else:
        fixed_s, last = line.intercept, recent[-FUSED_RECENT:]
        per_token_s = max(line.slope, statistics.median(max(0.0, e - fixed_s) for _, e in last) * len(last)
                          / max(1, sum(n for n, _ in last)))
        room_s = max(share_s - fixed_s, FUSED_TOKEN_SHARE * share_s)
        size = int(min(cap, room_s / per_token_s)) if per_token_s > 0 else cap
        twice_past_share = len(recent) >= 2 and all(extra - fixed_s > share_s for _, extra in recent[-2:])
        if twice_past_share or _past_2x(recent, bare_step_s, share_s, line):
            size = min(size, recent[-1][0] // 2)
    size = min(size, max(FUSED_MIN_CHUNK, 2 * previous))
    if deadline_left_s is not None and chunk_left > 0 and bare_step_s > 0:
        time_left = deadline_left_s - FUSED_DEADLINE_MARGIN * new_tokens * interval_s
        steps = int(time_left / (FUSED_DEADLINE_MARGIN * 2 * bare_step_s))  # a fused step costs about two bare ones
        size = max(size, cap if steps < 1 else -(-chunk_left // steps))
    return max(FUSED_MIN_CHUNK, min(cap, size))


def _past_2x(recent: Sequence[tuple[int, float]], bare_step_s: float, share_s: float, line: Line | None) -> bool:
    """Whether the last chunk's tokens put the rows' gap past 2x a step: what it added passed a bare step, and a share
    past the fixed part read low (where the fixed part alone is over a step, every chunk passes 2x)."""
    fixed_s = min(line.intercept if line else 0.0, sorted(e for _, e in recent)[len(recent) // 4])
    return recent[-1][1] > max(bare_step_s, fixed_s + share_s)
