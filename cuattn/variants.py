"""The table of kernel variants: every template instantiation cuattn can launch.

A variant is one ``__global__`` template instantiation. Its ``uri`` names it in logs, the
cache listing and the compile report; its ``expression`` is the C++ name handed to NVRTC
through ``name_expressions``. ``hot`` marks kernels whose register spills fail CI.
"""

from __future__ import annotations

import dataclasses
import functools
import numpy as np

try:  # bfloat16 as a NumPy dtype; optional at import so that validation can name it
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a runtime dependency
    BFLOAT16 = None

C_TYPES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "float"}
if BFLOAT16 is not None:
    C_TYPES[BFLOAT16] = "bf16"
C_TYPE_NAMES = {"f16": "float16", "bf16": "bfloat16", "float": "float32"}


@dataclasses.dataclass(frozen=True)
class Variant:
    family: str  # translation unit in cuda_src/, without ".cu"
    expression: str  # C++ name expression of the instantiation
    uri: str
    hot: bool = False
    dynamic_smem: int = 0  # bytes of dynamic shared memory every launch passes
    threads: int = 256  # threads per CTA
    block_m: int = 0  # rows per CTA (attention kernels)
    column_splits: int = 1  # CTAs per row block, each with a slice of the head-dim columns
    archs: tuple[str, ...] = ()  # the only targets it compiles for; empty: every target

    def builds_for(self, arch: str) -> bool:
        return not self.archs or arch in self.archs


def cxx_type(c_type: str) -> str:
    return "float" if c_type == "float" else f"cuattn::{c_type}"


def merge_variant(c_type: str, vec: int) -> Variant:
    return Variant(
        family="merge",
        expression=f"cuattn::merge_kernel<{cxx_type(c_type)}, {vec}>",
        uri=f"merge/{c_type}/vec{vec}",
        hot=True,
    )


# 16-byte accesses, or one element at a time when a pointer or stride is not aligned to that.
MERGE_VEC_WIDTHS = {"f16": (8, 1), "bf16": (8, 1), "float": (4, 1)}


# Opt-in shared memory per block (bytes) of each target cuattn builds for; at run time the
# device's own attribute decides. The 99 KB parts (sm_86 / sm_89 / sm_120: RTX 30xx / 40xx / 50xx,
# A10, L4, L40S) get smaller backward tiles.
ARCH_SMEM_OPTIN = {
    "sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376, "sm_90a": 232448,
    "sm_100": 232448, "sm_120": 101376,
}
MAX_SMEM_OPTIN = max(ARCH_SMEM_OPTIN.values())


def arch_smem_limit(arch: str) -> int:
    """The opt-in shared memory per block of a target (the smallest known for an unknown one)."""
    return ARCH_SMEM_OPTIN.get(arch, min(ARCH_SMEM_OPTIN.values()))


# Tensor-core forward tiles per head-dim bucket: (BLOCK_M, BLOCK_N, WARPS). Mirrors the
# contract of cuda_src/forward/traits.cuh (the kernel traps if launched with less shared memory).
FORWARD_STAGES = 2  # K/V tiles in flight (ForwardTraits::kStages)
FORWARD_TILES = {
    32: (128, 64, 4),
    64: (128, 64, 4),
    96: (128, 32, 4),
    128: (128, 32, 4),
    160: (64, 32, 4),
    192: (64, 32, 4),
    224: (64, 32, 4),
    256: (64, 32, 4),
}
HEAD_DIM_BUCKETS = tuple(sorted(FORWARD_TILES))
FP32_BLOCK_M = 16  # forward_fp32.cu: 4 warps x 4 rows


def head_dim_bucket(head_dim: int) -> int:
    """The padded head dim a kernel is compiled for: the smallest bucket that holds it."""
    return next(b for b in HEAD_DIM_BUCKETS if b >= head_dim)


def forward_smem_bytes(bucket: int) -> int:
    block_m, block_n, _ = FORWARD_TILES[bucket]
    return (block_m + 2 * FORWARD_STAGES * block_n) * (bucket + 8) * 2


# Sequence layouts an attention kernel is compiled for (cuda_src/common/seq_layout.cuh): dense
# (batch, seqlen, heads, head_dim) tensors, or packed ones with cu_seqlens (attention_varlen).
SEQ_LAYOUTS = ("dense", "packed")


def _layout_arg(layout: str) -> str:
    if layout not in SEQ_LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}")
    return "cuattn::SeqLayout::kPacked" if layout == "packed" else "cuattn::SeqLayout::kDense"


def _layout_uri(layout: str) -> str:
    return "/packed" if layout == "packed" else ""


@functools.cache
def forward_variant(c_type: str, bucket: int, softcap: bool, layout: str = "dense") -> Variant:
    cap = "true" if softcap else "false"
    if c_type == "float":
        return Variant(
            family="forward_fp32",
            expression=f"cuattn::forward_fp32_kernel<{bucket}, {cap}, {_layout_arg(layout)}>",
            uri=f"forward_fp32/d{bucket}" + ("/softcap" if softcap else "") + _layout_uri(layout),
            threads=128,
            block_m=FP32_BLOCK_M,
        )
    block_m, block_n, warps = FORWARD_TILES[bucket]
    return Variant(
        family="forward",
        expression=f"cuattn::forward_kernel<{cxx_type(c_type)}, {bucket}, {block_m}, {block_n}, {warps}, {cap}, {_layout_arg(layout)}>",
        uri=f"forward/{c_type}/d{bucket}/m{block_m}n{block_n}w{warps}" + ("/softcap" if softcap else "") + _layout_uri(layout),
        hot=True,
        dynamic_smem=forward_smem_bytes(bucket),
        threads=warps * 32,
        block_m=block_m,
    )


# Hopper forward (forward_wgmma.cu, sm_90a only) per head-dim bucket: (BLOCK_N, WARPGROUPS,
# CTAS_PER_SM); every warpgroup owns 64 query rows. Mirrors cuda_src/forward/wgmma_traits.cuh.
WGMMA_FORWARD_TILES = {64: (64, 2, 2), 128: (128, 2, 1), 256: (64, 2, 1)}  # scripts/tune_wgmma.py
WGMMA_ARCH = "sm_90a"


def wgmma_forward_smem_bytes(bucket: int) -> int:
    block_n, warpgroups, _ = WGMMA_FORWARD_TILES[bucket]
    stages, swizzle_alignment = 2, 1024
    return (64 * warpgroups + 2 * stages * block_n) * bucket * 2 + swizzle_alignment


def _wgmma_variant(family: str, template_args: str, softcap: bool, uri: str, smem: int, warpgroups: int, layout: str | None = None) -> Variant:
    cap = "true" if softcap else "false"
    layout_arg = "" if layout is None else f", {_layout_arg(layout)}"
    return Variant(
        family=family,
        expression=f"cuattn::{family}_kernel<{template_args}, {cap}{layout_arg}>",
        uri=f"{family}/{uri}" + ("/softcap" if softcap else "") + ("" if layout is None else _layout_uri(layout)),
        hot=True,
        dynamic_smem=smem,
        threads=128 * warpgroups,
        block_m=64 * warpgroups,
        archs=(WGMMA_ARCH,),
    )


@functools.cache
def wgmma_forward_variant(c_type: str, bucket: int, softcap: bool, layout: str = "dense") -> Variant:
    block_n, warpgroups, ctas = WGMMA_FORWARD_TILES[bucket]
    return _wgmma_variant(
        "forward_wgmma", f"{cxx_type(c_type)}, {bucket}, {block_n}, {warpgroups}, {ctas}", softcap,
        f"{c_type}/d{bucket}/n{block_n}wg{warpgroups}c{ctas}", wgmma_forward_smem_bytes(bucket), warpgroups, layout,
    )


def select_forward_variant(c_type: str, bucket: int, softcap: bool, arch: str, allow_wgmma: bool = True, layout: str = "dense") -> Variant:
    """The forward kernel for a problem on a target: the Hopper kernel where one exists for it,
    else the portable tensor-core (or float32) kernel."""
    if allow_wgmma and arch == WGMMA_ARCH and c_type != "float" and bucket in WGMMA_FORWARD_TILES:
        return wgmma_forward_variant(c_type, bucket, softcap, layout)
    return forward_variant(c_type, bucket, softcap, layout)


# Tensor-core backward: its shared-memory contract (cuda_src/backward/traits.cuh). Every CTA
# has 4 warps of 16 resident rows.
BACKWARD_BLOCK = 64  # resident rows per CTA
# backward_prep and backward_dq_finish: warps per CTA, and lanes per query row
# (cuda_src/backward/head_rows.cuh kRowLanes), so 32 rows per CTA.
BACKWARD_ROW_WARPS, BACKWARD_ROW_LANES = 8, 8
BACKWARD_ROWS_PER_CTA = BACKWARD_ROW_WARPS * 32 // BACKWARD_ROW_LANES
FP32_BACKWARD_TILE = 32  # backward/fp32_tiles.cuh: streamed rows per step (two padded tiles)


def backward_stream_rows(family: str, bucket: int) -> int:
    """Rows per streamed block where shared memory allows: queries in backward_dkdv (32 above
    d64, where dK and dV take head_dim registers), keys in backward_dq (32 above d128, where the
    dQ accumulator alone takes 128 registers)."""
    return 32 if bucket > (64 if family == "backward_dkdv" else 128) else 64


def backward_smem_bytes(family: str, bucket: int, stream: int, stats_in_smem: bool) -> int:
    stages, row = 2, bucket + 8
    stats = 2 * stages * stream * 4 if stats_in_smem else 0
    return (2 * BACKWARD_BLOCK * row + 2 * stages * stream * row) * 2 + stats


def backward_tile(family: str, bucket: int, smem_limit: int) -> tuple[int, bool]:
    """(rows per streamed block, lse / delta staged in shared memory) of a tensor-core backward
    kernel under a per-block shared-memory limit: the preferred tile, else halved down to 16
    rows, else (backward_dkdv, head_dim 256 on a 99 KB device) the row stats left in global
    memory. backward_dq reads its rows' statistics once, never through shared memory."""
    for stats in (True, False) if family == "backward_dkdv" else (False,):
        stream = backward_stream_rows(family, bucket)
        while stream >= 16:
            if backward_smem_bytes(family, bucket, stream, stats) <= smem_limit:
                return stream, stats
            stream //= 2
    raise ValueError(f"{family} at head_dim bucket {bucket} needs more than {smem_limit} bytes of shared memory per block")


@functools.cache
def backward_row_variant(family: str, c_type: str, bucket: int, layout: str = "dense") -> Variant:
    """``backward_prep`` or ``backward_dq_finish``: BACKWARD_ROW_LANES lanes per query row,
    BACKWARD_ROWS_PER_CTA rows per CTA, each lane's loads of a row issued at once."""
    return Variant(
        family=family,
        expression=f"cuattn::{family}_kernel<{cxx_type(c_type)}, {bucket}, {_layout_arg(layout)}>",
        uri=f"{family}/{c_type}/d{bucket}" + _layout_uri(layout),
        hot=True,
        block_m=BACKWARD_ROWS_PER_CTA,
    )


@functools.cache
def backward_variant(family: str, c_type: str, bucket: int, softcap: bool, smem_limit: int = MAX_SMEM_OPTIN, layout: str = "dense") -> Variant:
    """``family`` is backward_dkdv or backward_dq, tiled for ``smem_limit`` bytes of shared
    memory per block; float32 runs their CUDA-core twins (backward_fp32_dkdv, backward_fp32_dq)."""
    cap = "true" if softcap else "false"
    if c_type == "float":
        fp32_family = family.replace("backward_", "backward_fp32_")
        return Variant(
            family=fp32_family,
            expression=f"cuattn::{fp32_family}_kernel<{bucket}, {cap}, {_layout_arg(layout)}>",
            uri=f"{fp32_family}/d{bucket}" + ("/softcap" if softcap else "") + _layout_uri(layout),
            dynamic_smem=2 * FP32_BACKWARD_TILE * (bucket + 1) * 4,
            threads=128,
            block_m=FP32_BLOCK_M,
        )
    stream, stats = backward_tile(family, bucket, smem_limit)
    tile = f"{stream}, {'true' if stats else 'false'}" if family == "backward_dkdv" else f"{stream}"
    return Variant(
        family=family,
        expression=f"cuattn::{family}_kernel<{cxx_type(c_type)}, {bucket}, {tile}, {cap}, {_layout_arg(layout)}>",
        uri=f"{family}/{c_type}/d{bucket}/s{stream}" + ("" if stats or family == "backward_dq" else "g") + ("/softcap" if softcap else "")
        + _layout_uri(layout),
        hot=True,
        dynamic_smem=backward_smem_bytes(family, bucket, stream, stats),
        threads=128,
        block_m=BACKWARD_BLOCK,
        column_splits=2 if family == "backward_dkdv" and bucket > 128 else 1,  # kDkdvSplits
    )


# Hopper backward (backward_wgmma_*.cu, sm_90a only) per head-dim bucket: (rows per streamed
# block, WARPGROUPS, CTAS_PER_SM); keys stream for dQ, queries for dK/dV, and every warpgroup
# owns 64 resident rows. Mirrors cuda_src/backward/wgmma_traits.cuh.
WGMMA_BACKWARD_TILES = {  # scripts/tune_wgmma.py
    "backward_dq": {64: (64, 2, 2), 128: (64, 1, 2)},
    "backward_dkdv": {64: (64, 1, 2), 128: (64, 1, 2)},
}


def wgmma_backward_smem_bytes(family: str, bucket: int) -> int:
    stream, warpgroups, _ = WGMMA_BACKWARD_TILES[family][bucket]
    resident, stages, swizzle_alignment = 64 * warpgroups, 2, 1024
    return (2 * resident + 2 * stages * stream) * bucket * 2 + 2 * stages * stream * 4 + swizzle_alignment


@functools.cache
def wgmma_backward_variant(family: str, c_type: str, bucket: int, softcap: bool, layout: str = "dense") -> Variant:
    """``family`` is backward_dq or backward_dkdv; the kernel is its backward_wgmma_* twin."""
    stream, warpgroups, ctas = WGMMA_BACKWARD_TILES[family][bucket]
    return _wgmma_variant(
        family.replace("backward_", "backward_wgmma_"), f"{cxx_type(c_type)}, {bucket}, {stream}, {warpgroups}, {ctas}", softcap,
        f"{c_type}/d{bucket}/s{stream}wg{warpgroups}c{ctas}", wgmma_backward_smem_bytes(family, bucket), warpgroups, layout,
    )


# Hopper fused backward (backward_wgmma_fused.cu, sm_90a only): dK/dV plus dQ by fp32 atomics, the
# non-deterministic default. Per head-dim bucket: (query rows per streamed block, WARPGROUPS,
# CTAS_PER_SM). Mirrors WgmmaFusedTraits in cuda_src/backward/wgmma_traits.cuh.
WGMMA_FUSED_TILES = {64: (64, 1, 3), 128: (64, 2, 1)}  # scripts/tune_wgmma.py


def wgmma_fused_smem_bytes(bucket: int) -> int:
    stream, warpgroups, _ = WGMMA_FUSED_TILES[bucket]
    resident, stages, swizzle_alignment = 64 * warpgroups, 2, 1024
    ds_tile = resident * stream * 2
    dq_cols = bucket if stream // 64 >= warpgroups else bucket * (stream // 64) // warpgroups
    dq_stages = warpgroups * 64 * dq_cols * 4
    return (2 * resident + 2 * stages * stream) * bucket * 2 + 2 * stages * stream * 4 + ds_tile + dq_stages + swizzle_alignment


@functools.cache
def wgmma_fused_variant(c_type: str, bucket: int, softcap: bool, layout: str = "dense") -> Variant:
    stream, warpgroups, ctas = WGMMA_FUSED_TILES[bucket]
    return _wgmma_variant(
        "backward_wgmma_fused", f"{cxx_type(c_type)}, {bucket}, {stream}, {warpgroups}, {ctas}", softcap,
        f"{c_type}/d{bucket}/s{stream}wg{warpgroups}c{ctas}", wgmma_fused_smem_bytes(bucket), warpgroups, layout,
    )


def select_fused_backward_variant(
    c_type: str, bucket: int, softcap: bool, arch: str, allow_wgmma: bool = True, layout: str = "dense",
) -> Variant | None:
    """The one-pass backward (dQ by atomics) where it serves the problem on the target, else None."""
    if allow_wgmma and arch == WGMMA_ARCH and c_type != "float" and bucket in WGMMA_FUSED_TILES:
        return wgmma_fused_variant(c_type, bucket, softcap, layout)
    return None


def select_backward_variant(
    family: str, c_type: str, bucket: int, softcap: bool, arch: str, allow_wgmma: bool = True, smem_limit: int | None = None,
    layout: str = "dense",
) -> Variant:
    """As :func:`select_forward_variant`, for backward_dq and backward_dkdv; portable tiles fit
    ``smem_limit`` (default: the target's, :data:`ARCH_SMEM_OPTIN`)."""
    if allow_wgmma and arch == WGMMA_ARCH and c_type != "float" and bucket in WGMMA_BACKWARD_TILES[family]:
        return wgmma_backward_variant(family, c_type, bucket, softcap, layout)
    return backward_variant(family, c_type, bucket, softcap, arch_smem_limit(arch) if smem_limit is None else smem_limit, layout)


def all_variants(arch: str | None = None) -> list[Variant]:
    """Every variant, in a stable order; the offline compile and ``warmup --all`` use it. With
    ``arch``, the backward tiles are those chosen under that target's shared-memory limit."""
    smem_limit = MAX_SMEM_OPTIN if arch is None else arch_smem_limit(arch)
    out = []
    for c_type, vecs in MERGE_VEC_WIDTHS.items():
        for vec in vecs:
            out.append(merge_variant(c_type, vec))
    for layout in SEQ_LAYOUTS:
        for c_type in ("f16", "bf16", "float"):
            for bucket in HEAD_DIM_BUCKETS:
                for softcap in (False, True):
                    out.append(forward_variant(c_type, bucket, softcap, layout))
        for c_type in ("f16", "bf16"):
            for bucket in WGMMA_FORWARD_TILES:
                for softcap in (False, True):
                    out.append(wgmma_forward_variant(c_type, bucket, softcap, layout))
    for layout in SEQ_LAYOUTS:
        for c_type in ("f16", "bf16", "float"):
            for bucket in HEAD_DIM_BUCKETS:
                out.append(backward_row_variant("backward_prep", c_type, bucket, layout))
            for family in ("backward_dkdv", "backward_dq"):
                for bucket in HEAD_DIM_BUCKETS:
                    for softcap in (False, True):
                        out.append(backward_variant(family, c_type, bucket, softcap, smem_limit, layout))
        for c_type in ("f16", "bf16"):
            for family, buckets in WGMMA_BACKWARD_TILES.items():
                for bucket in buckets:
                    for softcap in (False, True):
                        out.append(wgmma_backward_variant(family, c_type, bucket, softcap, layout))
            for bucket in WGMMA_FUSED_TILES:
                out.append(backward_row_variant("backward_dq_finish", c_type, bucket, layout))
                for softcap in (False, True):
                    out.append(wgmma_fused_variant(c_type, bucket, softcap, layout))
    return out


def common_variants() -> list[Variant]:
    """The set ``python -m cuattn warmup`` compiles by default."""
    merges = [merge_variant(c, MERGE_VEC_WIDTHS[c][0]) for c in MERGE_VEC_WIDTHS]
    forwards = [make(c, d, False) for make in (forward_variant, wgmma_forward_variant) for c in ("f16", "bf16") for d in (64, 128)]
    return merges + forwards
