"""Launch plans: grid, block and shared memory for each kernel family."""

from __future__ import annotations

MERGE_THREADS = 256


def merge_grid(rows: int, head_dim: int, vec: int, device_id: int) -> tuple[int, int, int]:
    """One pass: enough blocks to cover every row once (the kernel grid-strides past 2^31 rows)."""
    group = 1
    while group < 32 and group * vec < head_dim:
        group *= 2
    rows_per_block = (MERGE_THREADS // 32) * (32 // group)
    blocks = -(-rows // rows_per_block)
    return (max(1, min(blocks, 2**31 - 1)), 1, 1)


def forward_launch(variant, rows: int, heads: int, batch: int):
    """(grid, block) of a tiled attention variant: one CTA per (block of rows, head, batch)."""
    return (-(-rows // variant.block_m), heads, batch), (variant.threads, 1, 1)
