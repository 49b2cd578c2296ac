"""What every kernel family shares: the variant record, the targets' shared-memory limits, the
head-dim buckets, the sequence layouts and the tiled grid."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Variant:
    """One ``__global__`` template instantiation. ``uri`` names it in logs, the cache listing
    and the compile report; ``expression`` is the C++ name handed to NVRTC through
    ``name_expressions``; ``hot`` marks kernels whose register spills fail CI."""

    family: str  # folder of cuda_src/ and module of cuattn.kernels: forward, backward, merge
    kernel: str  # translation unit cuda_src/<family>/<kernel>.cu
    expression: str
    uri: str
    hot: bool = False
    dynamic_smem: int = 0  # bytes of dynamic shared memory every launch passes
    threads: int = 256  # threads per CTA
    block_m: int = 0  # rows per CTA (attention kernels)
    column_splits: int = 1  # CTAs per row block, each with a slice of the head-dim columns
    ordered: bool = True  # block-sparse forms: the CTAs take their cells from the launch order (cuattn/kernels/sparse.py)
    archs: tuple[str, ...] = ()  # the only targets it compiles for; empty: every target
    dependent: bool = False  # launched as a programmatic dependent of the grid before it (cuattn/launch.py)
    several_row_blocks: bool = False  # its CTAs may take several row blocks in turn (forward_tma.cu SEVERAL)
    # (C++ constant expression of the kernel's source, the value this plan uses for it): each
    # constant both sides own (shared memory, threads, tile rows), compared by a compile-time
    # static_assert (tests/test_compile.py).
    contract: tuple[tuple[str, int], ...] = ()

    @property
    def source(self) -> str:
        return f"{self.family}/{self.kernel}.cu"

    def builds_for(self, arch: str) -> bool:
        return not self.archs or arch in self.archs


# Opt-in shared memory per block (bytes) of each target cuattn builds for; at run time the
# device's own attribute decides. The 99 KB parts (sm_86 / sm_89 / sm_120: RTX 30xx / 40xx / 50xx,
# A10, L4, L40S) get smaller backward tiles.
ARCH_SMEM_OPTIN = {
    "sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376, "sm_90a": 232448,
    "sm_100": 232448, "sm_120": 101376,
}
MAX_SMEM_OPTIN = max(ARCH_SMEM_OPTIN.values())
WGMMA_ARCH = "sm_90a"  # the target of the Hopper (wgmma) kernels


def arch_smem_limit(arch: str) -> int:
    """The opt-in shared memory per block of a target (the smallest known for an unknown one)."""
    return ARCH_SMEM_OPTIN.get(arch, min(ARCH_SMEM_OPTIN.values()))


# Head dims a kernel is compiled for; a problem runs the smallest that holds its head_dim.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)


def head_dim_bucket(head_dim: int) -> int:
    return next(b for b in HEAD_DIM_BUCKETS if b >= head_dim)


# Sequence layouts an attention kernel is compiled for (cuda_src/common/seq_layout.cuh): dense
# (batch, seqlen, heads, head_dim) tensors, or packed ones with cu_seqlens (attention_varlen);
# the forward also reads keys from a KV cache, contiguous or paged (attention_with_kvcache).
SEQ_LAYOUTS = ("dense", "packed")
CACHE_LAYOUTS = ("cache", "paged_cache")
_LAYOUT_ENUMS = {"dense": "kDense", "packed": "kPacked", "cache": "kCache", "paged_cache": "kPagedCache"}


def layout_arg(layout: str) -> str:
    if layout not in _LAYOUT_ENUMS:
        raise ValueError(f"unknown sequence layout {layout!r}")
    return f"cuattn::SeqLayout::{_LAYOUT_ENUMS[layout]}"


def layout_uri(layout: str) -> str:
    return "" if layout == "dense" else f"/{layout}"


def softcap_arg(softcap: bool) -> str:
    return "true" if softcap else "false"


def softcap_uri(softcap: bool) -> str:
    return "/softcap" if softcap else ""


def dropout_arg(dropout: bool, layout: str = "dense", sparse: bool = False) -> str:
    """The trailing DROPOUT (common/dropout.cuh; dense and packed layouts) and SPARSE
    (common/block_sparse.cuh; dense layout, not with dropout) template arguments, or none."""
    if dropout and layout not in SEQ_LAYOUTS:
        raise ValueError(f"dropout is compiled for the dense and packed layouts only, not {layout!r}")
    if sparse and (layout != "dense" or dropout):
        raise ValueError(f"block-sparse kernels are compiled for the dense layout without dropout only, not {layout!r}")
    if sparse:
        return ", false, true"
    return ", true" if dropout else ""


def dropout_uri(dropout: bool, sparse: bool = False) -> str:
    return ("/dropout" if dropout else "") + ("/sparse" if sparse else "")


MAX_GRID_YZ = 65535  # gridDim.y and gridDim.z limit
MAX_GRID_X = 2**31 - 1


def tile_launches(variant: Variant, rows: int, heads: int, batch: int) -> list[tuple[tuple, tuple, int]]:
    """(grid, block, batch_offset) of each launch of a tiled attention variant: one CTA per
    (block of rows, head, batch) on (x, y, z), batches in slices of at most 65535
    (cuda_src/common/grid.cuh)."""
    blocks = -(-rows // variant.block_m)
    if blocks > MAX_GRID_X or heads > MAX_GRID_YZ:
        raise ValueError(f"problem too large for one launch: {rows} rows x {heads} heads")
    block = (variant.threads, 1, 1)
    return [((blocks, heads, min(MAX_GRID_YZ, batch - b0)), block, b0) for b0 in range(0, batch, MAX_GRID_YZ)]
