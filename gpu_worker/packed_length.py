"""How long a fused step's packed sequence is on CUDA (`gpu_worker.fused_step`). Pure: numbers in, a token count out.

A fused step's input is one packed sequence: one token per running row, then the chunk's tokens. On CUDA its
length is cut to a multiple of FUSED_PACK_ALIGN: the matrix products' kernels are chosen per shape, and a shape met
for the first time cost an H200 ~6 ms a step more (bench-llama, 8 rows: a fused step of 256 tokens 23.6 ms the
first time, 16.6-17.8 ms after; of random sizes 16-400, 22.7 ms at the median against 16.3-17.2 ms for one size
repeated; a bare step 10.8 ms). With chunk sizes that the scheduler's sizing moves every step, nearly every fused
step met a new shape; cut, at most 128 lengths exist up to 4,096, each met once per process.
"""

from __future__ import annotations

FUSED_PACK_ALIGN = 32


def aligned_chunk(rows: int, budget: int, align: int) -> int:
    """The tokens to take of a fused step's chunk `budget` so that `rows` + the chunk is a multiple of `align`: the
    budget rounded down, unless that would take it under half, when the budget stands (a small chunk's few shapes
    are soon all met)."""
    if align <= 1 or budget <= 0:
        return budget
    down = (rows + budget) // align * align - rows
    return down if down >= max(1, (budget + 1) // 2) else budget
