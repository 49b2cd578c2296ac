"""Launch plans: grid, block and shared memory for each kernel family."""

from __future__ import annotations

import functools


@functools.cache
def sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


MERGE_THREADS = 256


def merge_grid(rows: int, head_dim: int, vec: int, device_id: int) -> tuple[int, int, int]:
    """Enough blocks to cover every row once, capped at a few waves (the kernel grid-strides)."""
    group = 1
    while group < 32 and group * vec < head_dim:
        group *= 2
    rows_per_block = (MERGE_THREADS // 32) * (32 // group)
    blocks = -(-rows // rows_per_block)
    return (max(1, min(blocks, sm_count(device_id) * 16)), 1, 1)
