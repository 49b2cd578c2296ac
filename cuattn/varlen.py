"""Attention over packed variable-length sequences (varlen): the forward kernels read each
sequence's rows through the packed layout of ``cuda_src/common/seq_layout.cuh``."""

from __future__ import annotations

import numpy as np

from cuattn import boundary, replay, validation
from cuattn.attention import (
    _NO_LSE, attn_params, check_bool, check_qkv, launch_forward, mask_options, require_arrays, score_options,
)

_PACKED = "(total, heads, head_dim)"
_CU_SEQLENS = "(batch + 1,) int32"


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False, window=None,
    align="bottom_right", scale=None, softcap=None, return_lse=False, out=None,
):
    """:func:`cuattn.attention` of a batch of sequences of different lengths, packed without
    padding: sequence ``b`` is rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` of ``q``
    and rows ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1`` of ``k`` and ``v``, and attends to
    its own keys only. Masks, ``align`` and windows apply within each sequence, as if it were
    passed to :func:`cuattn.attention` alone (whose result it equals).

    Parameters
    ----------
    q : ``(total_q, heads_q, head_dim)``
    k, v : ``(total_k, heads_kv, head_dim)``; dtypes, head dims, GQA and strides as in
        :func:`cuattn.attention`.
    cu_seqlens_q, cu_seqlens_k : ``(batch + 1,)`` int32 arrays of the same framework as ``q``:
        0, then the running totals of the lengths (non-decreasing, last entry ``total``). Empty
        sequences are allowed and cost nothing. Host (NumPy) offsets are checked; device
        offsets are not read on the host (that would synchronize): the kernels clamp them into
        ``[0, total]``, so bad values never move a read or write outside the arrays, and rows
        outside every sequence are left unwritten.
    max_seqlen_q : optional int, a bound on the query lengths that sizes the grid. Omitted, it
        is computed from NumPy offsets, and for device offsets it is ``total_q`` (read from the
        shapes: no synchronization; correct for any offsets, but most thread blocks of such a
        grid exit at once, so pass it when you know it). Rows of a sequence longer than the
        bound are set to NaN (out and lse): too small a bound shows, and never reads or
        writes outside the arrays.
    max_seqlen_k : optional int, accepted for FlashAttention's signature (the forward does not
        need it).
    causal, window, align, scale, softcap, out : as :func:`cuattn.attention`; ``out`` is
        ``(total_q, heads_q, head_dim)``.
    return_lse : bool. Also return ``lse``, ``(heads_q, total_q)`` float32.

    Returns
    -------
    ``out`` ``(total_q, heads_q, head_dim)`` (or ``(out, lse)``) as the caller's array type.
    """
    if out is None:
        result = replay.run(
            "attention_varlen",
            lambda: attention_varlen(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                window=window, align=align, scale=scale, softcap=softcap, return_lse=return_lse,
            ),
            (q, k, v, cu_seqlens_q, cu_seqlens_k),
            (max_seqlen_q, max_seqlen_k, causal, window, align, scale, softcap, return_lse),
        )
        if result is not replay.MISS:
            return result
    require_arrays({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k})
    return_lse = check_bool("return_lse", return_lse)
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    ctx, a = boundary.import_arrays(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, out=out)
    if out is not None and ctx.framework in (boundary.JAX, boundary.NUMPY):
        raise TypeError(f"out= is written in place, which {ctx.framework} arrays cannot be")
    for name in ("q", "k", "v", "out"):
        if a[name] is not None:
            validation.check_rank(name, a[name], 3, _PACKED)
    total_q, heads_q, head_dim = a["q"].shape
    total_k = a["k"].shape[0]
    batch = _check_cu_seqlens(a["cu_seqlens_q"], a["cu_seqlens_k"], total_q, total_k)
    dense = {name: None if x is None else _as_one_sequence(x) for name, x in a.items() if not name.startswith("cu_")}
    c_type = check_qkv(dense["q"], dense["k"], dense["v"], dense["out"])
    if out is not None:  # out=q is safe: each CTA reads its query rows before it writes them
        validation.check_writable_output("out", a["out"], {"q": a["q"], "k": a["k"], "v": a["v"]}, same_as_ok="q")
    host_lengths = _host_lengths(a["cu_seqlens_q"], total_q, "cu_seqlens_q"), _host_lengths(a["cu_seqlens_k"], total_k, "cu_seqlens_k")
    if max_seqlen_q is None:
        max_seqlen_q = total_q if host_lengths[0] is None else int(host_lengths[0].max(initial=0))
    left, right, _ = mask_options(causal, window, align, total_q, total_k)
    bottom_right = align == "bottom_right"  # checked by mask_options
    scale, softcap = score_options(scale, softcap, head_dim)

    ctx.stage(*a.values())
    dense = {name: None if x is None else _as_one_sequence(x) for name, x in a.items() if not name.startswith("cu_")}  # staged
    dst = a["out"] if out is not None else ctx.empty(a["q"].shape, a["q"].dtype)
    lse = ctx.empty((heads_q, total_q), np.float32) if return_lse else _NO_LSE
    if batch and total_q and heads_q:
        lse_rows = boundary.DeviceArray(lse.ptr, (1, heads_q, total_q), (0, *lse.strides), lse.dtype, lse.native)
        p = attn_params(
            dense["q"], dense["k"], dense["v"], _as_one_sequence(dst), lse_rows, (left, right, 0), scale, softcap,
            packed=(a["cu_seqlens_q"].ptr, a["cu_seqlens_k"].ptr, total_q, total_k, bottom_right),
        )
        p["batch"], p["seqlen_q"], p["seqlen_k"] = batch, max_seqlen_q, total_k  # packed kernels read lengths from the offsets
        launch_forward(ctx, c_type, p, max(max_seqlen_q, 1), heads_q, batch, layout="packed")
    result = out if out is not None else ctx.export(dst)
    return (result, ctx.export(lse)) if return_lse else result


def _check_max_seqlen(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int (or None), got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _check_cu_seqlens(cu_q, cu_k, total_q: int, total_k: int) -> int:
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


def _host_lengths(cu, total: int, name: str) -> np.ndarray | None:
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


def _as_one_sequence(x: boundary.DeviceArray) -> boundary.DeviceArray:
    """A packed ``(total, heads, head_dim)`` array as the kernels' 4-D view, batch stride 0."""
    return boundary.DeviceArray(x.ptr, (1, *x.shape), (0, *x.strides), x.dtype, x.native)
