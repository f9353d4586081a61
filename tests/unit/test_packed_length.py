"""A fused step's packed sequence cut to a multiple of an alignment (pure)."""

from __future__ import annotations

from gpu_worker.packed_length import aligned_chunk


def test_a_fused_chunk_is_cut_so_the_packed_sequence_is_a_multiple_of_the_alignment():
    assert aligned_chunk(8, 200, 32) == 184  # 8 rows + 184 tokens = 192
    assert aligned_chunk(8, 24, 32) == 24  # already 32
    assert aligned_chunk(8, 20, 32) == 20  # 28 -> 0 would take it all: the budget stands
    assert aligned_chunk(3, 70, 32) == 61 and aligned_chunk(3, 60, 32) == 60  # 29 would be under half of 60
    assert aligned_chunk(8, 200, 1) == 200 and aligned_chunk(8, 0, 32) == 0
    for align in (1, 8, 32, 64):
        for rows in range(0, 70):
            for budget in range(1, 700):
                got = aligned_chunk(rows, budget, align)
                assert 1 <= got <= budget
                assert got == budget or ((rows + got) % align == 0 and got >= (budget + 1) // 2)
                if budget >= 2 * align:  # room to round down: the packed sequence is always aligned
                    assert (rows + got) % align == 0 and budget - got < align
