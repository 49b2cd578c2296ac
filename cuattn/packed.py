"""Packed variable-length sequences on the host side: the ``cu_seqlens`` offsets checked, the
grid bounds resolved, and the packed arrays as the kernels' views (the device side is
``cuda_src/common/seq_layout.cuh``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from cuattn import boundary, validation

PACKED = "(total, heads, head_dim)"
PACKED_STATS = "(heads_q, total_q)"
_CU_SEQLENS = "(batch + 1,) int32"


@dataclasses.dataclass(frozen=True)
class PackedSequences:
    """What AttnParams holds for packed sequences: the offsets' device addresses, row totals,
    and bounds on the lengths that size the grids (max_seqlen_q for query blocks, max_seqlen_k
    for key blocks)."""

    cu_seqlens_q: int
    cu_seqlens_k: int
    batch: int
    total_q: int
    total_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    bottom_right: bool


def check_max_seqlen(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int (or None), got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def check_cu_seqlens(cu_q, cu_k, total_q: int, total_k: int) -> int:
    """The number of sequences, after the shape-level checks of both offset arrays."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        validation.check_rank(name, cu, 1, _CU_SEQLENS)
        if cu.dtype != np.int32:
            raise TypeError(f"{name} must be int32, got {validation.dtype_name(cu.dtype)}")
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must hold batch + 1 >= 1 offsets, got an empty array")
        validation.check_unit_last_stride(name, cu)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q has {cu_q.shape[0]} offsets and cu_seqlens_k {cu_k.shape[0]}: both are (batch + 1,)")
    batch = cu_q.shape[0] - 1
    if batch == 0 and (total_q or total_k):
        raise ValueError(f"no sequences (cu_seqlens of one offset) cannot cover {total_q} query and {total_k} key rows")
    return batch


def host_lengths(cu, total: int, name: str) -> np.ndarray | None:
    """Sequence lengths from host (NumPy) offsets, checked; None for device offsets."""
    if cu.ptr is not None:
        return None
    offsets = np.asarray(cu.native, dtype=np.int64)
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    lengths = np.diff(offsets)
    if (lengths < 0).any():
        at = int(np.argmax(lengths < 0))
        raise ValueError(f"{name} must be non-decreasing, but entry {at + 1} ({offsets[at + 1]}) < entry {at} ({offsets[at]})")
    if offsets[-1] != total:
        raise ValueError(f"{name} must end at the number of rows ({total}), got {offsets[-1]}")
    return lengths


def grid_bound(given: int | None, lengths: np.ndarray | None, total: int) -> int:
    """A bound on the lengths: the caller's, else the longest host length, else ``total``
    (device offsets are not read on the host: that would synchronize)."""
    if given is not None:
        return given
    return total if lengths is None else int(lengths.max(initial=0))


def one_sequence_view(x: boundary.DeviceArray | None) -> boundary.DeviceArray | None:
    """A packed array as the kernels' dense view of one sequence of ``total`` rows, a batch axis
    of stride 0 in front: ``(total, heads, head_dim)`` tensors and ``(heads_q, total_q)``
    statistics (lse, dlse) alike."""
    if x is None:
        return None
    return boundary.DeviceArray(x.ptr, (1, *x.shape), (0, *x.strides), x.dtype, x.native)
