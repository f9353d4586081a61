"""Continuous batching for any Hugging Face causal LM (torch only; scheduling decisions live elsewhere).

The engine holds the running batch. `prefill(specs)` runs new prompts, right-aligned, straight into
free rows of the preallocated `SlotKVCache`; `step()` advances every running row by one token (and a
chunked prompt by a chunk); a row leaves the moment it is done (length, EOS, stop string) or removed
(`remove`, with a reason), and its outcome is returned at once. The caller (`gpu_worker.scheduler`)
decides what to prefill, when, and which rows leave early. The engine never allocates beyond
`max_rows` x `max_width` cache positions, and a row never attends to another row's tokens or its padding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from gpu_worker import fused_step as fusion
from gpu_worker.attention import AttentionLayout
from gpu_worker.chunked_prefill import ChunkedPrefill
from gpu_worker.kv_cache import SlotKVCache, cache_kwarg, kv_shape, text_config
from gpu_worker.parked_rows import ParkedRows
from gpu_worker.prompt_logprobs import PromptLogprobs
from gpu_worker.sampling import Penalties, keep_logprobs, make_generator, select_tokens
from gpu_worker.sequences import EngineFull, EngineStats, GenResult, GenSpec, Row, finish_reason, group_by_length
from gpu_worker.window_kv import Rings
from shared.states import FinishReason

# Prefill sub-batches: rows are grouped by prompt length so that padding stays under this fraction.
PREFILL_PAD_TOLERANCE = 0.25


class GenerationEngine:
    def __init__(self, model: torch.nn.Module, *, max_rows: int, max_seq_len: int,
                 decode_tail: Callable[[list[int]], str] | None = None, clock: Callable[[], float] = time.time,
                 keep_logits: bool = False, fused: bool = False) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.max_rows, self.max_seq_len = max_rows, max_seq_len
        self.layout = AttentionLayout.of(model)  # which keys each layer type may see (windows, chunks)
        self.layer_types: list[str] | None = getattr(text_config(model), "layer_types", None)
        self.rings = Rings.of(self.layout, self.layer_types, kv_shape(model)[0], max_seq_len)  # windowed layers' KV
        # twice as wide as a sequence can be: room to run max_seq_len steps between compactions
        self.cache = SlotKVCache.for_model(model, max_rows=max_rows, max_width=2 * max_seq_len,
                                           rings=self.rings.per_layer)
        self.cache.allocate()
        self._bool_mask = getattr(model.config, "_attn_implementation", "sdpa") == "sdpa"
        self.cache_arg = cache_kwarg(model)
        self._decode_tail, self._clock = decode_tail, clock
        self.rows: list[Row] = []
        self.end = 0  # the column after every row's last cached token
        self.stats = EngineStats()
        self.last_logits: dict[str, torch.Tensor] | None = {} if keep_logits else None  # by row, last forward
        self.chunked = ChunkedPrefill(self)  # at most one long prompt prefilled a chunk per step
        self.parked = ParkedRows(self)  # running rows sitting out the steps (`hold_back`)
        self.prompt_logprobs = PromptLogprobs()  # kept from the prefill for the rows that ask, until they leave
        self.fused = fused  # a chunk rides in the decode step's forward (see gpu_worker.fused_step)
        if fused:
            fusion.install()

    # --- capacity ------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self.rows) + self.chunked.active + len(self.parked)

    @property
    def free_rows(self) -> int:
        return self.max_rows - self.running

    def fits(self, spec: GenSpec) -> bool:
        return spec.total_tokens <= self.max_seq_len and len(spec.prompt_ids) >= 1

    # --- prefill -------------------------------------------------------------------------------
    def _check(self, specs: list[GenSpec]) -> None:
        if len(specs) > self.free_rows:
            raise EngineFull(f"{len(specs)} new rows but {self.free_rows} free")
        if (spec := next((s for s in specs if not self.fits(s)), None)) is not None:
            raise EngineFull(f"{spec.id}: {spec.total_tokens} tokens exceed max_seq_len {self.max_seq_len}")

    def prefill_in_chunks(self, spec: GenSpec) -> None:
        """Start prefilling a long prompt a chunk per `step` (see `gpu_worker.chunked_prefill`)."""
        self._check([spec])
        if self.chunked.active:
            raise EngineFull("a chunked prefill is already in progress")
        self.chunked.begin(spec)

    @torch.inference_mode()
    def prefill(self, specs: Iterable[GenSpec]) -> list[GenResult]:
        """Prefill new sequences and merge them into the running batch. Returns the ones already done."""
        specs = list(specs)
        self._check(specs)
        if self.last_logits is not None:
            self.last_logits.clear()
        groups = group_by_length([len(s.prompt_ids) for s in specs], PREFILL_PAD_TOLERANCE,  # a row whose every
                                 [PromptLogprobs.wanted([s]) for s in specs])  # position's logits are kept: alone
        return [r for group in groups for r in self._prefill_group([specs[i] for i in group])]

    def _prefill_group(self, specs: list[GenSpec]) -> list[GenResult]:
        t0 = self._clock()
        lens = [len(s.prompt_ids) for s in specs]
        width, n = max(lens), len(specs)
        self._make_room_left(width)
        first = len(self.rows)

        ids = torch.zeros((n, width), dtype=torch.long)
        pads = [width - ln for ln in lens]
        for i, spec in enumerate(specs):
            ids[i, pads[i]:] = torch.tensor(spec.prompt_ids, dtype=torch.long)
        pad_t = torch.tensor(pads, dtype=torch.long, device=self.device)
        cols = torch.arange(width, device=self.device)
        seq_pos = cols[None, :] - pad_t[:, None]  # each column's position in its own sequence
        positions = seq_pos.clamp(min=0)
        causal = cols[None, :, None] >= cols[None, None, :]  # [1, q, k]
        mask = causal & (cols[None, None, :] >= pad_t[:, None, None])
        mask |= torch.eye(width, dtype=torch.bool, device=self.device)[None]  # padded queries see themselves
        window = self.cache.window(slice(first, first + n), self.end - width, self.end, self.end - width)
        f0 = time.perf_counter()
        out = self.model(input_ids=ids.to(self.device), attention_mask=self._mask(mask[:, None], seq_pos, seq_pos),
                         position_ids=positions, **{self.cache_arg: window}, use_cache=True,
                         logits_to_keep=0 if PromptLogprobs.wanted(specs) else 1)  # 0: every position's
        self.prompt_logprobs.whole(specs, out.logits, pads)
        self.stats.forward_s += time.perf_counter() - f0
        self.stats.prefill_tokens += sum(lens)
        self.stats.prefill_padded_tokens += n * width
        return self._admit(specs, out.logits[:, -1, :], t0)

    def _admit(self, specs: list[GenSpec], logits: torch.Tensor, t0: float) -> list[GenResult]:
        """Prompts whose last prefill forward gave `logits` (their caches already in rows `len(rows)` on, right-
        aligned at `end`) join the running batch with their first token; those already done leave at once."""
        self._keep([s.id for s in specs], logits)
        gens = [make_generator(s.sampling, self.device) for s in specs]
        states = [Penalties.of(s, logits) for s in specs]
        tokens = select_tokens(logits, [s.sampling for s in specs], gens, states.__getitem__,  # type: ignore[arg-type]
                               [s.constraint for s in specs])
        now = self._clock()
        self.stats.prefill_s += now - t0
        first = len(self.rows)
        for spec, token, gen, state in zip(specs, tokens, gens, states, strict=True):
            self.rows.append(Row(
                spec=spec, start=self.end - len(spec.prompt_ids), tokens=[token], generator=gen,
                admitted_at=t0, prefill_s=now - t0, first_token_at=now, penalties=state,
            ))
        keep_logprobs(logits, tokens, self.rows[first:])
        return self._retire([r for r in range(first, len(self.rows))
                             if finish_reason(self.rows[r], self._decode_tail) is not None],
                            now)

    def _mask(self, allowed: torch.Tensor, q_pos: torch.Tensor,
              k_pos: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        return self.layout.attention_mask(allowed, q_pos, k_pos, boolean=self._bool_mask, dtype=self.cache.dtype)

    def _keep(self, ids: list[str], logits: torch.Tensor, fresh: bool = False) -> None:
        if self.last_logits is not None:
            if fresh:
                self.last_logits.clear()
            self.last_logits.update(zip(ids, logits, strict=True))

    def _make_room_left(self, width: int) -> None:
        """Ensure `width` free columns left of `end` for a right-aligned prefill."""
        if not self.rows:
            self.end = width
        if self.end >= width:
            return
        shift = width - self.end
        lo = min(r.start for r in self.rows)
        self.cache.shift_columns(len(self.rows), lo, self.end, shift)
        for row in self.rows:
            row.start += shift
        self.end += shift

    # --- decode --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, chunk_tokens: int = 0) -> list[GenResult]:
        """Prefill up to `chunk_tokens` of a chunked prompt (in the same forward when `fused`), then advance
        every running row by one token; return the rows that finished."""
        if self.fused and self.rows and self.chunked.current is not None and chunk_tokens > 0:
            return fusion.fused_step(self, chunk_tokens)
        done = self.chunked.advance(chunk_tokens)
        return done + self._decode() if self.rows else done

    def _decode(self) -> list[GenResult]:
        t0 = self._clock()
        self._make_room_right()
        lo = min(r.start for r in self.rows)
        masks, positions = self._decode_masks(lo)
        ids = torch.tensor([[r.tokens[-1]] for r in self.rows], dtype=torch.long, device=self.device)
        window = self.cache.window(slice(0, len(self.rows)), self.end, self.end + 1, lo, ring_order=True)
        f0 = time.perf_counter()
        out = self.model(input_ids=ids, attention_mask=masks, position_ids=positions, **{self.cache_arg: window},
                         use_cache=True)
        return self._retire(*self._advance(out.logits[:, -1, :], lo, time.perf_counter() - f0, t0))

    def _decode_masks(self, read_lo: int) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
        """Every running row's masks for its query at column `end` over columns [read_lo, end] (over the ring, for
        ring layers: `gpu_worker.window_kv`), and the rows' positions ([rows, 1])."""
        starts = torch.tensor([r.start for r in self.rows], dtype=torch.long, device=self.device)
        cols = torch.arange(read_lo, self.end + 1, device=self.device)
        positions = (self.end - starts)[:, None]
        seen = (cols[None, :] >= starts[:, None])[:, None, None, :]
        masks = self._mask(seen, positions, cols[None, :] - starts[:, None])
        return self.rings.decode_masks(masks, self._mask, self.end, read_lo, starts, positions), positions

    def _advance(self, logits: torch.Tensor, read_lo: int, forward_s: float, t0: float) -> tuple[list[int], float]:
        """Every running row takes its next token from `logits` ([rows, vocab]: the step's forward, which read
        columns from `read_lo`); the step's accounting. Returns the rows now finished, and the time."""
        self._keep([r.spec.id for r in self.rows], logits, fresh=True)
        rows = self.rows
        tokens = select_tokens(logits, [r.spec.sampling for r in rows], [r.generator for r in rows],
                               lambda i: rows[i].penalties.caught_up(rows[i].tokens), [r.spec.constraint for r in rows])
        keep_logprobs(logits, tokens, rows)
        n = len(self.rows)
        self.stats.forward_s += forward_s
        self.stats.kv_padded += n * (self.end + 1 - read_lo)
        self.stats.kv_real += sum(self.end + 1 - r.start for r in self.rows)
        self.end += 1
        for row, tok in zip(self.rows, tokens, strict=True):
            row.tokens.append(tok)
        finished = [i for i, row in enumerate(self.rows) if finish_reason(row, self._decode_tail) is not None]
        now = self._clock()
        self.stats.decode_s += now - t0
        self.stats.steps += 1
        self.stats.decode_tokens += n
        return finished, now

    def _make_room_right(self) -> None:
        """Ensure column `end` exists by compacting left (a row is at most `max_seq_len` long, the cache twice
        that wide: a compaction always frees at least `max_seq_len` columns)."""
        if self.end < self.cache.width:
            return
        lo = min(r.start for r in self.rows)
        self.cache.shift_columns(len(self.rows), lo, self.end, -lo)
        for row in self.rows:
            row.start -= lo
        self.end -= lo

    # --- leaving the batch ---------------------------------------------------------------------
    def _retire(self, indices: list[int], now: float,
                reason: FinishReason | None = None) -> list[GenResult]:
        results = []
        for i in sorted(indices, reverse=True):
            row = self.rows[i]
            why = reason or finish_reason(row, self._decode_tail) or FinishReason.LENGTH
            results.append(GenResult(
                id=row.spec.id, token_ids=row.tokens, finish_reason=why,
                prompt_tokens=len(row.spec.prompt_ids), prefill_s=row.prefill_s,
                ttft_s=row.first_token_at - row.admitted_at, decode_s=now - row.first_token_at,
                admitted_at=row.admitted_at, owner=row.spec.owner, logprobs=row.logprobs,
                prompt_logprobs=self.prompt_logprobs.take(row.spec.id)))
            last = len(self.rows) - 1
            if i != last:
                moved = self.rows[last]
                self.cache.move_row(last, i, moved.start, self.end)
                self.rows[i] = moved
            self.rows.pop()
        results.reverse()
        return results

    @torch.inference_mode()
    def remove(self, ids: Iterable[str], reason: FinishReason) -> list[GenResult]:
        """The one way a row leaves before it is done (cancelled, out of time, preempted, handed back):
        it leaves at once with the tokens it has, `reason` as its finish reason."""
        wanted = set(ids)
        self.parked.release(wanted)  # a parked row leaves from the running batch like any other
        hits = [i for i, r in enumerate(self.rows) if r.spec.id in wanted]
        return self.chunked.cancel(wanted, reason) + self._retire(hits, self._clock(), reason)

    def hold_back(self, ids: Iterable[str]) -> None:
        """Exactly the running rows `ids` sit out the next steps (see `gpu_worker.parked_rows`)."""
        self.parked.hold(ids)

    def running_ids(self) -> list[str]:
        chunked = [self.chunked.current.spec.id] if self.chunked.current else []
        return [r.spec.id for r in self.rows] + chunked + self.parked.ids()

    def remaining_tokens(self) -> dict[str, int]:
        left = {r.spec.id: r.spec.max_new_tokens - len(r.tokens) for r in self.rows} | self.parked.remaining()
        if (cur := self.chunked.current) is not None:
            left[cur.spec.id] = cur.spec.max_new_tokens
        return left
