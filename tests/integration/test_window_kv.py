"""A sliding-window layer's ring of KV columns (`gpu_worker.window_kv`, `kv_cache` ring operations).

Each cached value is the absolute column it belongs to (as a float), so every read and every move can be
checked against the column it must hold: a ring of W columns keeps a row's last W columns where a full
layer keeps them all, through writes, compaction, row moves, swaps and span copies.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention import FULL, SLIDING, AttentionLayout, Pattern
from gpu_worker.kv_cache import SlotKVCache, ring_read, ring_update, whole_ring
from gpu_worker.window_kv import Rings

W = 5


def cache(rows: int = 3, width: int = 40) -> SlotKVCache:
    c = SlotKVCache(layers=2, kv_heads=1, head_dim=1, dtype=torch.float32, device=torch.device("cpu"), max_rows=rows,
                    max_width=width, rings=[0, W])
    c.allocate()
    return c


def labels(lo: int, hi: int, rows: int = 1) -> torch.Tensor:
    """Keys whose value is their absolute column, [rows, heads=1, hi - lo, dim=1]."""
    return torch.arange(lo, hi, dtype=torch.float32).reshape(1, 1, -1, 1).repeat(rows, 1, 1, 1)


def held(c: SlotKVCache, row: int, lo: int, hi: int) -> list[float]:
    """What the ring layer holds for absolute columns [lo, hi) of `row` (hi - lo <= W)."""
    return c.keys[1][row, 0, c.ring_columns(lo, hi, W), 0].tolist()


def write(c: SlotKVCache, rows: slice, lo: int, hi: int) -> None:
    n = rows.stop - rows.start
    for layer, ring in enumerate(c.rings):
        if ring:
            ring_update(c, c.keys[layer], c.values[layer], rows, labels(lo, hi, n), labels(lo, hi, n), lo, hi, lo,
                        ring, ring_order=False)
        else:
            c.keys[layer][rows, :, lo:hi] = labels(lo, hi, n)


def test_a_ring_layer_allocates_its_window_and_a_full_layer_every_column():
    c = cache()
    assert [k.shape[2] for k in c.keys] == [40, W]
    full = SlotKVCache(layers=2, kv_heads=1, head_dim=1, dtype=torch.float32, device=torch.device("cpu"),
                       max_rows=3, max_width=40)
    assert full.rings == [0, 0]
    with pytest.raises(ValueError):
        SlotKVCache(layers=2, kv_heads=1, head_dim=1, dtype=torch.float32, device=torch.device("cpu"), max_rows=3,
                    max_width=40, rings=[W])


def test_a_prefill_wider_than_the_ring_keeps_its_last_columns_and_attends_to_all():
    c = cache()
    k, _ = ring_update(c, c.keys[1], c.values[1], slice(0, 1), labels(3, 15), labels(3, 15), 3, 15, 3, W,
                       ring_order=False)
    assert k.flatten().tolist() == list(range(3, 15))  # the forward attends over the whole prompt
    assert held(c, 0, 10, 15) == [10, 11, 12, 13, 14]


def test_a_chunk_reads_the_held_keys_before_it_then_its_own():
    c = cache()
    write(c, slice(2, 3), 0, 12)  # earlier chunks of a prompt in row 2
    k, _ = ring_update(c, c.keys[1], c.values[1], 2, labels(12, 15), labels(12, 15), 12, 15, 0, W, ring_order=False)
    assert k.flatten().tolist() == [7, 8, 9, 10, 11, 12, 13, 14]  # W held before the chunk, then the chunk
    assert held(c, 2, 10, 15) == [10, 11, 12, 13, 14]
    assert Rings.keys_seen(12, 15, 0, W) == 8


@pytest.mark.parametrize(("read_lo", "end"), [(8, 10), (9, 12), (13, 16), (7, 11), (4, 11), (0, 20)])
def test_a_decode_step_reads_its_span_in_order_or_the_whole_ring(read_lo, end):
    c = cache()
    write(c, slice(0, 3), max(0, end - W), end)  # the rows' last W columns
    k, _ = ring_update(c, c.keys[1], c.values[1], slice(0, 3), labels(end, end + 1, 3), labels(end, end + 1, 3),
                       end, end + 1, read_lo, W, ring_order=True)
    span = end + 1 - read_lo
    if whole_ring(span, W):
        assert sorted(k[0].flatten().tolist()) == list(range(end + 1 - W, end + 1))
        assert k[0].flatten().tolist() == [end - (end - j) % W for j in range(W)]  # as stored: what the mask says
    else:
        assert k[1].flatten().tolist() == list(range(read_lo, end + 1))
    assert torch.equal(ring_read(c.keys[1], slice(0, 3), read_lo, end + 1, W), k)


def test_shifting_columns_turns_the_ring_with_them():
    c = cache()
    write(c, slice(0, 2), 10, 22)
    c.shift_columns(2, 10, 22, -9)  # a compaction: column c is now c - 9
    assert held(c, 0, 8, 13) == [17, 18, 19, 20, 21]
    assert c.keys[0][1, 0, 1:13, 0].tolist() == list(range(10, 22))
    c.shift_columns(2, 1, 13, 6)  # room on the left for a longer prompt: c + 6
    assert held(c, 1, 14, 19) == [17, 18, 19, 20, 21]


def test_row_moves_swaps_and_span_copies_keep_every_held_column():
    c = cache()
    write(c, slice(0, 1), 3, 14)
    c.move_row(0, 2, 3, 14)
    assert held(c, 2, 9, 14) == [9, 10, 11, 12, 13]
    write(c, slice(1, 2), 30, 33)
    c.swap_rows(1, 2, 3, 33)
    assert held(c, 1, 9, 14) == [9, 10, 11, 12, 13] and held(c, 2, 30, 33) == [30, 31, 32]
    c.copy_span(1, 3, 0, 20, 11)  # a chunked prompt's 11 columns joining at 20..31: its last W arrive
    assert held(c, 0, 26, 31) == [9, 10, 11, 12, 13]
    c.copy_span(0, 26, 0, 28, 5)  # the same row, forward by two (a parked row coming back)
    assert held(c, 0, 28, 33) == [9, 10, 11, 12, 13]
    c.copy_span(2, 30, 2, 31, 3)
    assert held(c, 2, 31, 34) == [30, 31, 32]


def test_rings_follow_the_windowed_layer_types_shorter_than_a_sequence():
    hybrid = AttentionLayout({FULL: Pattern(), SLIDING: Pattern(window=8)}, by_type=True)
    rings = Rings.of(hybrid, [SLIDING, SLIDING, FULL], 3, max_seq_len=64)
    assert rings.per_layer == [8, 8, 0] and rings.by_type == {SLIDING: 8} and not rings.single
    assert Rings.of(hybrid, [SLIDING, FULL], 2, max_seq_len=8).per_layer == [0, 0]  # the window saves nothing
    every = AttentionLayout({FULL: Pattern(window=8)}, by_type=False)  # Mistral: one mask, every layer windowed
    assert Rings.of(every, None, 2, 64).per_layer == [8, 8] and Rings.of(every, None, 2, 64).single
    plain = AttentionLayout({FULL: Pattern()}, by_type=False)
    assert not Rings.of(plain, None, 2, 64).any
    chunked = AttentionLayout({FULL: Pattern(), "chunked_attention": Pattern(chunk=8)}, by_type=True)
    assert Rings.of(chunked, ["chunked_attention", FULL], 2, 64).per_layer == [0, 0]


def test_decode_masks_over_the_ring_say_which_column_is_which():
    layout = AttentionLayout({FULL: Pattern(), SLIDING: Pattern(window=4)}, by_type=True)
    rings = Rings.of(layout, [SLIDING, FULL], 2, 64)

    def build(allowed, q_pos, k_pos):
        return layout.attention_mask(allowed, q_pos, k_pos, boolean=True, dtype=torch.float32)

    end, starts = 9, torch.tensor([2, 8])
    cols = torch.arange(2, end + 1)
    q_pos = (end - starts)[:, None]
    usual = build((cols[None, :] >= starts[:, None])[:, None, None, :], q_pos, cols[None, :] - starts[:, None])
    masks = rings.decode_masks(usual, build, end, 2, starts, q_pos)
    assert torch.equal(masks[FULL], usual[FULL])
    # ring slots 0..3 hold columns 8, 9, 6, 7: row 0 (from column 2) sees all four; row 1 (from 8) only 8 and 9
    assert masks[SLIDING][:, 0, 0].tolist() == [[True, True, True, True], [True, True, False, False]]
    assert rings.decode_masks(usual, build, end, 7, starts, q_pos)[SLIDING] is usual[SLIDING]  # span 3: in order
    tail = rings.tail(usual, 7, 10, 2)
    assert tail[SLIDING].shape[-1] == 7 and tail[FULL].shape[-1] == 8
