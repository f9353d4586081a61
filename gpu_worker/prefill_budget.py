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
# What a fused chunk adds is a fixed part (the chunk's own attention calls, masks, launches) plus a part per token.
# Until the chunk sizes seen spread this far around their mean (standard deviation / mean), the two cannot be told
# apart, and the next chunk doubles the last to find out. Read as a cost per token through zero, a fixed part
# kept the chunks at the minimum for good: an H100 took ~4 ms a fused step whatever the chunk, against a 6 ms
# decode step, read that as 1 ms a token, and prefilled a 2,048-token prompt 4 tokens a step.
FUSED_SEPARABLE_SPREAD = 0.2
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


def fused_chunk(chunk_tokens: int | None, *, protect: bool, fixed_s: float, per_token_s: float, measured: bool,
                separable: bool, warm: bool, last: tuple[int, float], bare_step_s: float, interval_s: float,
                chunk_left: int, deadline_left_s: float | None, new_tokens: int, previous: int = 0) -> int:
    """Prompt tokens the next fused step carries, between FUSED_MIN_CHUNK and `chunk_tokens`:
    - the most whose cost (`fixed_s` a step plus `per_token_s` a token, once `separable`) adds at most
      `FUSED_STEP_SHARE` of a bare decode step (`bare_step_s`), so the rows' gap between tokens stays under 2x a step;
    - where the fixed part alone takes that share (or all but a minimum chunk of it, or no cost per token shows),
      every fused step costs the rows it
      whatever its chunk, and the fewest such steps are the largest chunks whose tokens fill the share. Such a
      size rests on the slope alone, which noise reads low: it is taken only once the fit is `warm` (the chunk holds
      its size before), and the chunk halves when the `last` fused chunk's tokens (what it added, less the fixed
      part) overran the share. Below it, the cost per token is never read under what the last chunk's tokens
      cost (noise reads the fit's slope low, down to none);
    - FUSED_MIN_CHUNK before anything is `measured`; twice the `previous` chunk while the costs are not yet
      `separable` (the sizes seen are too alike to tell the fixed part from the per-token one);
    - at most twice the `previous` fused chunk (the costs are learned from the chunks themselves, and one
      cheap-looking small chunk must not make the next one huge);
    - more if the chunked prompt needs them to meet its deadline (`chunk_left` prompt tokens to go, then
      `new_tokens` at `interval_s` each, all within `deadline_left_s`);
    - the most allowed when no interactive row decodes beside it (`protect` false)."""
    cap = max(chunk_tokens or FUSED_MIN_CHUNK, FUSED_MIN_CHUNK)
    if not protect:
        return cap
    share_s = FUSED_STEP_SHARE * bare_step_s
    last_tokens, last_extra_s = last
    if not measured or bare_step_s <= 0:
        size = FUSED_MIN_CHUNK
    elif not separable:
        size = 2 * previous
    elif (per_token := max(per_token_s, _last_per_token(last_extra_s, fixed_s, last_tokens))) > 0 \
            and share_s - fixed_s >= FUSED_MIN_CHUNK * per_token:
        size = int((share_s - fixed_s) / per_token)
    elif last_extra_s - fixed_s > share_s:
        size = previous // 2
    elif not warm:
        size = previous
    else:
        size = int(share_s / per_token_s) if per_token_s > 0 else cap
    size = min(size, max(FUSED_MIN_CHUNK, 2 * previous))
    if deadline_left_s is not None and chunk_left > 0 and bare_step_s > 0:
        time_left = deadline_left_s - FUSED_DEADLINE_MARGIN * new_tokens * interval_s
        steps = int(time_left / (FUSED_DEADLINE_MARGIN * 2 * bare_step_s))  # a fused step costs about two bare ones
        size = max(size, cap if steps < 1 else -(-chunk_left // steps))
    return max(FUSED_MIN_CHUNK, min(cap, size))


def _last_per_token(last_extra_s: float, fixed_s: float, last_tokens: int) -> float:
    """What each of the last fused chunk's tokens cost, its fixed part aside (0 when unknown)."""
    return max(0.0, last_extra_s - fixed_s) / last_tokens if last_tokens > 0 else 0.0
