"""Exact attention forward."""

from __future__ import annotations

import math

import numpy as np

from cuattn import boundary, params, plans, reference, replay, validation
from cuattn.loader import device_arch, wgmma_enabled
from cuattn.variants import HEAD_DIM_BUCKETS, head_dim_bucket, select_forward_variant

_LAYOUT = "(batch, seqlen, heads, head_dim)"
LOG2E = 1.4426950408889634
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]


def attention(q, k, v, *, causal=False, window=None, align="bottom_right", scale=None, softcap=None, return_lse=False, out=None):
    """Exact softmax attention, ``softmax(scale * q k^T + mask) v``, in one tiled kernel.

    Parameters
    ----------
    q : ``(batch, seqlen_q, heads_q, head_dim)``
    k, v : ``(batch, seqlen_k, heads_kv, head_dim)``; ``heads_q % heads_kv == 0`` (MHA, GQA,
        MQA). K/V are read in place for every query head of their group, never copied.
        float16 or bfloat16 (tensor cores, fp32 accumulation) or float32 (fp32 throughout, no
        tf32; a slower path). ``head_dim``: a multiple of 8 up to 256 (computed in the kernel
        padded to the next of 32, 64, 96, ..., 256). Any strides with a unit last stride; for
        float16 / bfloat16 the other strides must be multiples of 8 elements and the data
        16-byte aligned (true of any contiguous tensor and of most views).
    causal : bool
        Query row ``i`` sees keys ``j <= i + offset`` (see ``align``).
    window : ``(left, right)`` or None
        Query row ``i`` sees keys ``i + offset - left <= j <= i + offset + right``; ``None`` or
        -1 leaves a side unbounded. With ``causal`` the right reach is at most 0.
    align : ``"bottom_right"`` (default) or ``"top_left"``
        How rows line up with columns when ``seqlen_q != seqlen_k``: ``offset = seqlen_k -
        seqlen_q`` (the last query sees the last key: KV-cache decoding, FlashAttention) or
        ``offset = 0`` (query ``i`` sees keys ``<= i``: PyTorch SDPA's ``is_causal``). Causal,
        seqlen_q = 3, seqlen_k = 5 (``x`` = visible)::

            bottom_right      top_left
            x x x . .         x . . . .
            x x x x .         x x . . .
            x x x x x         x x x . .

        A row that sees no key gets ``out = 0`` and ``lse = -inf`` (never NaN).
    scale : float, default ``1 / sqrt(head_dim)``; must be positive
    softcap : float or None
        If given, scores become ``softcap * tanh(scale * q.k / softcap)`` before the softmax.
    return_lse : bool
        Also return ``lse``, ``(batch, heads_q, seqlen_q)`` float32: the natural log of each
        row's softmax denominator including its max, ``lse = m + log(l)``; merging partial
        results with :func:`cuattn.merge` and the backward pass use it.
    out : optional array like ``q`` to write the result into (same framework, shape, dtype).

    Returns
    -------
    ``out`` shaped and typed like ``q`` (or ``(out, lse)``), as the caller's array type. Extra
    device memory is only ``out`` and ``lse``: O(seqlen), never O(seqlen^2).
    """
    if out is None:
        result = replay.run(
            "attention",
            lambda: attention(q, k, v, causal=causal, window=window, align=align, scale=scale, softcap=softcap, return_lse=return_lse),
            (q, k, v), (causal, window, align, scale, softcap, return_lse),
        )
        if result is not replay.MISS:
            return result
    require_arrays({"q": q, "k": k, "v": v})
    return_lse = check_bool("return_lse", return_lse)
    ctx, a = boundary.import_arrays(q=q, k=k, v=v, out=out)
    if out is not None and ctx.framework in (boundary.JAX, boundary.NUMPY):
        raise TypeError(f"out= is written in place, which {ctx.framework} arrays cannot be")
    c_type = check_qkv(a["q"], a["k"], a["v"], a["out"])
    if out is not None:  # out=q is safe: each CTA reads its query rows before it writes them
        validation.check_writable_output("out", a["out"], {"q": a["q"], "k": a["k"], "v": a["v"]}, same_as_ok="q")
    batch, seqlen_q, heads_q, head_dim = a["q"].shape
    mask = mask_options(causal, window, align, seqlen_q, a["k"].shape[1])
    scale, softcap = score_options(scale, softcap, head_dim)

    ctx.stage(*a.values())
    dst = a["out"] if out is not None else ctx.empty(a["q"].shape, a["q"].dtype)
    # Without return_lse the kernels skip lse (a null pointer): nothing to allocate.
    lse = ctx.empty((batch, heads_q, seqlen_q), np.float32) if return_lse else NO_LSE
    if batch and seqlen_q and heads_q:
        launch_forward(ctx, c_type, attn_params(a["q"], a["k"], a["v"], dst, lse, mask, scale, softcap), seqlen_q, heads_q, batch)
    result = out if out is not None else ctx.export(dst)
    return (result, ctx.export(lse)) if return_lse else result


MAX_HEADS_Q, MAX_HEADS_KV = 65535, 32767
NO_LSE = boundary.DeviceArray(0, (0, 0, 0), (0, 0, 0), np.dtype(np.float32), None)


def require_arrays(arrays: dict, hints: dict | None = None) -> None:
    """TypeError naming the first required array argument that is None (and what it is)."""
    for name, x in arrays.items():
        if x is None:
            hint = f" ({hints[name]})" if hints and name in hints else ""
            raise TypeError(f"{name} is required, got None{hint}")


def check_qkv(q, k, v, out) -> str:
    for name, x in (("q", q), ("k", k), ("v", v)):
        validation.check_rank(name, x, 4, _LAYOUT)
    c_type = validation.check_dtype("q", q)
    validation.check_same_dtype("k", k, "q", q)
    validation.check_same_dtype("v", v, "q", q)
    batch, seqlen_q, heads_q, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k has shape {k.shape}; expected (batch={batch}, seqlen_k, heads_kv, head_dim={head_dim})")
    validation.check_shape("v", v, k.shape, "(the shape of k)")
    heads_kv = k.shape[2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}, from q) must be a multiple of heads_kv ({heads_kv}, from k)")
    if heads_q > MAX_HEADS_Q or heads_kv > MAX_HEADS_KV:  # gridDim.y (dK/dV: two CTAs per head above d128)
        raise ValueError(f"at most {MAX_HEADS_Q} query heads and {MAX_HEADS_KV} KV heads are supported, got {heads_q} and {heads_kv}")
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is not supported: use a multiple of 8 from 8 to {MAX_HEAD_DIM}")
    if out is not None:
        validation.check_shape("out", out, q.shape, "(the shape of q)")
        validation.check_same_dtype("out", out, "q", q)
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        if x is None:
            continue
        validation.check_unit_last_stride(name, x)
        # Host arrays are uploaded contiguous, hence aligned: only device arrays are checked.
        if c_type != "float" and x.size and x.ptr is not None and not validation.aligned([x.ptr], x.strides[:3], x.dtype.itemsize, 8, 8):
            raise ValueError(
                f"{name} strides {x.strides} (elements) or its address are not multiples of 8 elements / 16 bytes, "
                "which the tensor-core kernel loads in; make it contiguous"
            )
    return c_type


def mask_options(causal, window, align, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int]:
    """(window_left, window_right, diagonal_offset) of AttnParams from the public options.

    A bound that reaches past both sequences is unbounded (-1): the kernels add bounds to row
    and column indices in int32, so nothing larger than ``seqlen_q + seqlen_k`` reaches them.
    """
    reach = seqlen_q + seqlen_k
    left, right = (-1 if w > reach else w for w in _mask_bounds(causal, window))
    return left, right, reference.diagonal_offset(seqlen_q, seqlen_k, align)


def score_options(scale, softcap, head_dim: int) -> tuple[float, float]:
    """(scale, softcap) as the kernels take them (float32; softcap 0 means none), checked in
    that precision: each, and the factors the kernels form from them, must be a normal
    positive float32 (the kernels flush denormals to zero)."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _real("scale", scale)
    _check_float32("scale", scale, scale)
    _check_float32("scale", scale * LOG2E, scale)
    if softcap is None:
        return float(np.float32(scale)), 0.0
    softcap = _real("softcap", softcap)
    _check_float32("softcap", softcap, softcap)
    _check_float32("scale / softcap", scale / softcap, (scale, softcap))
    return float(np.float32(scale)), float(np.float32(softcap))


_FLOAT32_NORMAL = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max))


def _real(name: str, x) -> float:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__} {x!r}")
    return float(x)


def _check_float32(name: str, value: float, given) -> None:
    if not (_FLOAT32_NORMAL[0] <= value <= _FLOAT32_NORMAL[1]):
        raise ValueError(
            f"{name} must be positive, finite and a normal float32 (the kernels compute in float32), got {given!r}"
        )


def _mask_bounds(causal, window) -> tuple[int, int]:
    check_bool("causal", causal)
    left, right = window_bounds(window)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def window_bounds(window) -> tuple[int, int]:
    """``window`` checked, as (left, right) with -1 for an unbounded side."""
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be (left, right), got {window!r}")
    left, right = (-1 if w is None else _window_bound(w, window) for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"window bounds must be >= 0, or -1 / None for unbounded; got {window!r}")
    return left, right


def _window_bound(w, window) -> int:
    if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)):
        raise TypeError(f"window bounds must be integers (or None), got {window!r}")
    return int(w)


def check_bool(name: str, x) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}")
    return bool(x)


def attn_params(q, k, v, out, lse, mask, scale: float, softcap: float, packed=None) -> np.void:
    """AttnParams of the forward problem (shared with the backward) from the kernels' 4-D
    views. ``packed``: a :class:`cuattn.packed.PackedSequences` (the views are then of one
    sequence of ``total`` rows, cuattn.packed.one_sequence_view), or None for dense tensors."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    left, right, offset = mask
    seqs = (0, 0, 0, 0, 0)
    if packed is not None:  # the kernels read lengths from the offsets; seqlen_* bound them
        batch, seqlen_q, seqlen_k = packed.batch, packed.max_seqlen_q, packed.max_seqlen_k
        seqs = (packed.cu_seqlens_q, packed.cu_seqlens_k, packed.total_q, packed.total_k, int(packed.bottom_right))
    return params.pack(
        params.ATTN_PARAMS,
        q=q.ptr, k=k.ptr, v=v.ptr, out=out.ptr, lse=lse.ptr,
        q_strides=q.strides[:3], k_strides=k.strides[:3], v_strides=v.strides[:3],
        out_strides=out.strides[:3], lse_strides=lse.strides[:2],
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_kv=k.shape[2], head_dim=head_dim,
        window_left=left, window_right=right, diagonal_offset=offset,
        scale=scale, softcap=softcap, exp2_scale=LOG2E * (1.0 if softcap else scale), batch_offset=0,
        cu_seqlens_q=seqs[0], cu_seqlens_k=seqs[1], total_q=seqs[2], total_k=seqs[3], bottom_right=seqs[4],
    )


def launch_forward(ctx, c_type, p, rows, heads_q, batch, layout="dense") -> None:
    """Launches the forward kernel of ``layout`` over ``rows`` query rows per sequence (for
    packed sequences a bound that sizes the grid, common/seq_layout.cuh)."""
    with ctx.device, ctx.stream:
        arch = device_arch(ctx.device.id)
        variant = select_forward_variant(c_type, head_dim_bucket(int(p["head_dim"])), p["softcap"] > 0, arch, wgmma_enabled(), layout)
        for grid, block, batch_offset in plans.tile_launches(variant, rows, heads_q, batch):
            p["batch_offset"] = batch_offset
            ctx.launch(variant, grid, block, p)
