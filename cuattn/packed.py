"""Packed variable-length sequences on the host side: the ``cu_seqlens`` offsets checked, the
grid bounds resolved, and the packed arrays as the kernels' views (the device side is
``cuda_src/common/seq_layout.cuh``)."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from cuattn import boundary, params, validation
from cuattn.kernels import packed as packed_plan
from cuattn.options import MAX_PACKED_ROWS

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


def check_cu_seqlens(cu_q, cu_k, total_q: int, total_k: int) -> int:
    """The number of sequences, after the shape-level checks of both offset arrays."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        validation.check_rank(name, cu, 1, _CU_SEQLENS)
        if cu.dtype != np.int32:
            raise ValueError(f"{name} must be int32, got {validation.dtype_name(cu.dtype)}")
        if cu.shape[0] < 1:
            raise ValueError(f"{name} must hold batch + 1 >= 1 offsets, got an empty array")
        validation.check_unit_last_stride(name, cu)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q has {cu_q.shape[0]} offsets and cu_seqlens_k {cu_k.shape[0]}: both are (batch + 1,)")
    batch = cu_q.shape[0] - 1
    for name, total in (("q", total_q), ("k", total_k)):
        if total > MAX_PACKED_ROWS:  # int32 offsets, totals and row bounds (options.MAX_PACKED_ROWS)
            raise ValueError(f"{name} holds {total} rows (total_{name}); at most 2**31 - 256 are supported (int32 cu_seqlens)")
    if batch > MAX_PACKED_ROWS:  # the kernels' sequence indices are int32 (empty sequences let batch pass the totals)
        raise ValueError(f"cu_seqlens_q holds {batch} sequences; at most 2**31 - 256 are supported")
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


def grid_bound(name: str, given: int | None, lengths: np.ndarray | None, total: int) -> int:
    """A bound on the lengths: the caller's (checked against host lengths), else the longest
    host length, else ``total`` (device offsets are not read on the host: that would
    synchronize; the device check reports a sequence longer than the bound)."""
    longest = None if lengths is None else int(lengths.max(initial=0))
    if given is not None:
        if longest is not None and given < longest:
            raise ValueError(f"{name} ({given}) is below the longest sequence ({longest})")
        return given
    return total if longest is None else longest


def one_sequence_view(x: boundary.DeviceArray | None) -> boundary.DeviceArray | None:
    """A packed array as the kernels' dense view of one sequence of ``total`` rows, a batch axis
    of stride 0 in front: ``(total, heads, head_dim)`` tensors and ``(heads_q, total_q)``
    statistics (lse, dlse) alike."""
    if x is None:
        return None
    return boundary.DeviceArray(x.ptr, (1, *x.shape), (0, *x.strides), x.dtype, x.native)


# Offsets on the device are checked there (cuda_src/packed/check_offsets.cu): the first bad
# entry is written into one word of pinned host memory, which every later varlen call reads
# before anything else (no synchronization) and check_varlen_offsets reads after one.
_report: np.ndarray | None = None
_report_memory = None  # kept for the process: its address lives on in replay plans and graphs
_report_lock = threading.Lock()
NO_BOUND = 2**31 - 1


def launch_offset_check(ctx, cu_q, cu_k, batch: int, totals: tuple[int, int], bounds: tuple[int, int]) -> None:
    """Checks device offsets on the call's stream: starting at 0, non-decreasing, ending at the
    totals, no sequence longer than its bound (the grid's ``max_seqlen``)."""
    with ctx.device, ctx.stream:
        p = params.pack(
            params.OFFSET_CHECK_PARAMS, cu_seqlens=(cu_q.ptr, cu_k.ptr), report=_report_address(), batch=batch,
            totals=totals, bounds=bounds,
        )
        variant = packed_plan.check_variant()
        ctx.launch(variant, packed_plan.check_grid(batch), (variant.threads, 1, 1), p)


def _report_address() -> int:
    global _report, _report_memory
    with _report_lock:
        if _report is None:
            import cupy
            from cupy.cuda import runtime

            # Mapped and portable: with unified addressing every device writes it at its host address.
            flags = runtime.hostAllocPortable | runtime.hostAllocMapped
            memory = cupy.cuda.PinnedMemoryPointer(cupy.cuda.pinned_memory.PinnedMemory(8, flags), 0)
            word = np.frombuffer(memory, np.uint64, 1)
            word[0] = 0
            _report_memory, _report = memory, word
    return _report_memory.ptr


def raise_reported() -> None:
    """Raises (once) the ValueError of bad device offsets that an earlier call's check found."""
    word = _report
    if word is None or not word[0]:
        return
    found = int(word[0])
    word[0] = 0
    raise ValueError(describe_report(found))


def describe_report(found: int) -> str:
    code, entry = found >> 32, found & 0xFFFFFFFF
    which, rule = divmod(code - 1, 4)
    name, bound = ("cu_seqlens_q", "max_seqlen_q") if which == 0 else ("cu_seqlens_k", "max_seqlen_k")
    what = {
        "kFirstNotZero": "does not start at 0",
        "kDecreasing": f"decreases at entry {entry}",
        "kLastNotTotal": f"does not end at the number of rows (entry {entry}, its last, differs)",
        "kLongerThanBound": f"has sequence {entry - 1} longer than {bound} (the bound its grid covered)",
    }[packed_plan.RULES[rule]]
    return (
        f"{name} {what}: found on the GPU by an earlier attention_varlen / attention_varlen_backward call, whose results "
        "are not valid (the kernels clamp offsets into the arrays, so nothing outside them was read or written)"
    )
