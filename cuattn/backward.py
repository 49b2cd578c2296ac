"""Exact attention backward from the forward's saved ``lse``."""

from __future__ import annotations

import numpy as np

from cuattn import boundary, params, plans, replay, validation
from cuattn.attention import _LAYOUT, attn_params, check_bool, check_qkv, mask_options, require_arrays, score_options
from cuattn.loader import device_smem_limit, wgmma_enabled
from cuattn.variants import (
    BACKWARD_ROW_WARPS, BACKWARD_ROWS_PER_CTA, backward_row_variant, head_dim_bucket, select_backward_variant,
    select_fused_backward_variant,
)

_LSE_LAYOUT = "(batch, heads_q, seqlen_q)"


def attention_backward(
    dout, q, k, v, out, lse, *, causal=False, window=None, align="bottom_right", scale=None, softcap=None,
    dlse=None, deterministic=False,
):
    """Gradients of :func:`cuattn.attention` with respect to ``q``, ``k`` and ``v``.

    Probabilities are recomputed on chip from ``q``, ``k`` and the saved ``lse``; the extra
    device memory is one fp32 value per query row (``delta = rowsum(dout * out) - dlse``),
    never O(seqlen^2).

    Parameters
    ----------
    dout : gradient of the loss with respect to ``out``, shaped and typed like ``q``.
    q, k, v, out, lse : the forward's inputs and outputs (``lse`` from ``return_lse=True``).
    causal, window, align, scale, softcap : exactly as given to the forward.
    dlse : optional ``(batch, heads_q, seqlen_q)`` float32, the gradient that flowed into
        ``lse`` (for example through :func:`cuattn.merge`); ``None`` means zero.
    deterministic : bool. ``True`` gives bit-identical gradients across runs: dK and dV are
        summed over a GQA group in registers and dQ is computed by its own kernel, with no
        atomics. ``False`` (default) may sum dQ with fp32 atomics in one pass over the scores
        (on Hopper, float16 / bfloat16, head_dim 33-64 and 97-128: one fp32 value per element
        of ``q`` of extra memory), so its last bits can differ between runs; elsewhere it is
        the deterministic path.

    Returns
    -------
    ``(dq, dk, dv)`` shaped and typed like ``q``, ``k`` and ``v`` (fp32 accumulation), as
    arrays of the caller's framework. Rows that see no key get zero gradients.

    Dtypes and head dims as the forward: float16 / bfloat16 on tensor cores (above head_dim
    128 the dK/dV columns are split over two CTAs, each recomputing the scores), float32 on
    the CUDA cores with fp32 accuracy (no tf32).
    """
    result = replay.run(
        "attention_backward",
        lambda: attention_backward(
            dout, q, k, v, out, lse, causal=causal, window=window, align=align, scale=scale, softcap=softcap,
            dlse=dlse, deterministic=deterministic,
        ),
        (dout, q, k, v, out, lse, dlse), (causal, window, align, scale, softcap, deterministic),
    )
    if result is not replay.MISS:
        return result
    require_arrays({"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}, _REQUIRED)
    deterministic = check_bool("deterministic", deterministic)
    ctx, a = boundary.import_arrays(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dlse=dlse)
    c_type = check_qkv(a["q"], a["k"], a["v"], a["out"])
    batch, seqlen_q, heads_q, head_dim = a["q"].shape
    validation.check_rank("dout", a["dout"], 4, _LAYOUT)
    validation.check_shape("dout", a["dout"], a["q"].shape, "(the shape of q)")
    validation.check_same_dtype("dout", a["dout"], "q", a["q"])
    validation.check_unit_last_stride("dout", a["dout"])
    if c_type != "float" and a["dout"].ptr is not None and not validation.aligned([a["dout"].ptr], a["dout"].strides[:3], a["dout"].dtype.itemsize, 8, 8):
        raise ValueError(f"dout strides {a['dout'].strides} (elements) or its address are not multiples of 16 bytes; make it contiguous")
    for name in ("lse", "dlse"):
        x = a[name]
        if x is None:
            continue
        validation.check_rank(name, x, 3, _LSE_LAYOUT)
        validation.check_shape(name, x, (batch, heads_q, seqlen_q), _LSE_LAYOUT)
        validation.check_float32(name, x)
        validation.check_unit_last_stride(name, x)
    mask = mask_options(causal, window, align, seqlen_q, a["k"].shape[1])
    scale, softcap = score_options(scale, softcap, head_dim)

    ctx.stage(*a.values())
    grads = [ctx.empty(a[n].shape, a[n].dtype) for n in ("q", "k", "v")]
    delta = ctx.empty((batch, heads_q, seqlen_q), np.float32)
    if batch and heads_q and (seqlen_q or a["k"].shape[1]):
        p = _backward_params(a, grads, delta, attn_params(a["q"], a["k"], a["v"], a["out"], a["lse"], mask, scale, softcap))
        _launch(ctx, c_type, p, a["q"].shape, a["k"].shape, deterministic)
    elif grads[1].size:  # no query head (heads_q = 0): K and V had no influence
        ctx.zero(grads[1], grads[2])
    return tuple(ctx.export(g) for g in grads)


_REQUIRED = {
    "dout": "the gradient of the loss with respect to out", "q": "the forward's query", "k": "the forward's keys",
    "v": "the forward's values", "out": "the forward's output", "lse": "the forward's lse, from return_lse=True",
}


def _backward_params(a, grads, delta, attn: np.void) -> np.void:
    dq, dk, dv = grads
    dlse = a["dlse"]
    return params.pack(
        params.BACKWARD_PARAMS,
        attn=attn, dout=a["dout"].ptr, dq=dq.ptr, dk=dk.ptr, dv=dv.ptr, delta=delta.ptr,
        dlse=0 if dlse is None else dlse.ptr,
        dout_strides=a["dout"].strides[:3], dq_strides=dq.strides[:3], dk_strides=dk.strides[:3],
        dv_strides=dv.strides[:3], dlse_strides=(0, 0) if dlse is None else dlse.strides[:2],
        dq_accum=0, dq_accum_cols=0,  # set by _launch when the fused kernel runs
    )


def _launch(ctx, c_type: str, p: np.void, q_shape, k_shape, deterministic: bool) -> None:
    batch, seqlen_q, heads_q, head_dim = q_shape
    seqlen_k, heads_kv = k_shape[1], k_shape[2]
    bucket, softcap = head_dim_bucket(head_dim), bool(p["attn"]["softcap"] > 0)
    rows = batch * seqlen_q * heads_q
    row_launch = ((-(-rows // BACKWARD_ROWS_PER_CTA), 1, 1), (32 * BACKWARD_ROW_WARPS, 1, 1))
    # Whether dQ goes through an fp32 accumulator is decided once: a traced JAX call replays
    # the decision that sized its buffers, whatever CUATTN_WGMMA says by then; a device that
    # cannot run the fused kernel (not Hopper) takes the deterministic kernels and leaves the
    # accumulator unused.
    use_accum = ctx.decide(
        "dq_accumulator",
        lambda: not deterministic and select_fused_backward_variant(c_type, bucket, softcap, ctx.arch(), wgmma_enabled()) is not None,
    )
    arch, wgmma = ctx.arch(), wgmma_enabled()
    fused = select_fused_backward_variant(c_type, bucket, softcap, arch) if use_accum else None
    if use_accum and rows:
        # Tiles of 64 rows (cuda_src/backward/dq_accum.cuh), zeroed by backward_prep.
        accum = ctx.empty((batch, heads_q, -(-seqlen_q // 64) * 64, bucket), np.float32)
        if fused is not None:
            p["dq_accum"], p["dq_accum_cols"] = accum.ptr, bucket
    with ctx.device, ctx.stream:
        rows_launch = [(*row_launch, None)]
        launches = []
        if rows:
            launches.append((backward_row_variant("backward_prep", c_type, bucket), rows_launch))
        # dK and dV are written (zeros included) even when no query sees a key.
        if fused is not None:
            if seqlen_k:
                launches.append((fused, plans.tile_launches(fused, seqlen_k, heads_kv, batch)))
            if rows:
                launches.append((backward_row_variant("backward_dq_finish", c_type, bucket), rows_launch))
        else:
            smem_limit = device_smem_limit(ctx.device.id)
            if rows:
                dq = select_backward_variant("backward_dq", c_type, bucket, softcap, arch, wgmma, smem_limit)
                launches.append((dq, plans.tile_launches(dq, seqlen_q, heads_q, batch)))
            if seqlen_k:
                dkdv = select_backward_variant("backward_dkdv", c_type, bucket, softcap, arch, wgmma, smem_limit)
                launches.append((dkdv, plans.tile_launches(dkdv, seqlen_k, heads_kv * dkdv.column_splits, batch)))
        for variant, variant_launches in launches:
            for grid, block, batch_offset in variant_launches:
                if batch_offset is not None:
                    p["attn"]["batch_offset"] = batch_offset
                ctx.launch(variant, grid, block, p)
