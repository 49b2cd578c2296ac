"""Attention over packed variable-length sequences (varlen): the kernels read each sequence's
rows through the packed layout of ``cuda_src/common/seq_layout.cuh`` (host side:
:mod:`cuattn.packed`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from cuattn import boundary, dropout as dropout_, replay, validation
from cuattn.attention import NO_LSE, attn_params, check_qkv, check_sink, launch_forward, require_arrays
from cuattn.backward import backward_params, check_dout, check_given_grads, launch_backward, plan_backward, returned_grads, zero_grads
from cuattn.kernels.backward import BackwardGrid
from cuattn.options import AttnOptions, check_max_seqlen
from cuattn.packed import (
    NO_BOUND, PACKED, PACKED_STATS, PackedSequences, check_cu_seqlens, grid_bound, host_lengths, launch_offset_check, one_sequence_view,
    raise_reported,
)
from cuattn.validation import check_bool


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False, window=None,
    align="bottom_right", scale=None, softcap=None, sink=None, dropout_p=0.0, dropout_seed=None, return_lse=False, out=None,
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
        sequences are allowed and cost nothing. Host (NumPy) offsets are checked before any
        launch. Device offsets are not read on the host (that would synchronize): a small
        kernel checks them on the GPU, and the next varlen call (or
        :func:`check_varlen_offsets`) raises the ValueError it found; meanwhile the kernels
        clamp offsets into ``[0, total]``, so bad values never move a read or write outside
        the arrays (rows that no sequence then covers are left unwritten).
    max_seqlen_q : optional int, a bound on the query lengths that sizes the grid. Omitted, it
        is computed from NumPy offsets, and for device offsets it is ``total_q`` (read from the
        shapes: no synchronization; correct for any offsets, but most thread blocks of such a
        grid exit at once, so pass it when you know it). A bound below a NumPy offsets'
        longest sequence is a ValueError; with device offsets the GPU check reports it, and
        the rows past the bound are set to NaN (out and lse), never read or written outside
        the arrays. Each distinct value is a new replay signature (its first call runs the op's
        host code twice more, to record the plan): where the longest sequence changes every
        step, pass a bound rounded up (to a multiple of 128, say).
    max_seqlen_k : optional int, accepted for FlashAttention's signature (the forward does not
        need it; NumPy offsets are still checked against it, as ``max_seqlen_q``).
    causal, window, align, scale, softcap, sink, dropout_p, dropout_seed, out : as
        :func:`cuattn.attention` (dropout draws as for sequence ``b`` of a dense batch, rows
        and keys counted within the sequence); ``out`` is ``(total_q, heads_q, head_dim)``.
    return_lse : bool. Also return ``lse``, ``(heads_q, total_q)`` float32.

    Returns
    -------
    ``out`` ``(total_q, heads_q, head_dim)`` (or ``(out, lse)``) as the caller's array type.
    """
    raise_reported()
    seed_array = dropout_.seed_array_argument(dropout_seed)
    if dropout_.replayable(dropout_p, dropout_seed, seed_array):
        result = replay.run(
            "attention_varlen",
            lambda: attention_varlen(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                window=window, align=align, scale=scale, softcap=softcap, sink=sink, dropout_p=dropout_p, dropout_seed=dropout_seed,
                return_lse=return_lse, out=out,
            ),
            (q, k, v, cu_seqlens_q, cu_seqlens_k, sink, seed_array, out),
            (max_seqlen_q, max_seqlen_k, causal, window, align, scale, softcap, return_lse, dropout_p),
            written=((7, 0),) if out is not None else (),
        )
        if result is not replay.MISS:
            return result
    require_arrays({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k})
    return_lse = check_bool("return_lse", return_lse)
    ctx, a = boundary.import_arrays(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sink=sink, dropout_seed=seed_array, out=out,
    )
    if out is not None:
        ctx.check_writes("out= is", a["out"])
    call = _PackedCall(a, max_seqlen_q, max_seqlen_k, causal, window, align, scale, softcap, dropout_p, dropout_seed)
    if out is not None:  # out=q is safe: each CTA reads its query rows before it writes them
        validation.check_writable_output("out", a["out"], {n: x for n, x in a.items() if n != "out"}, same_as_ok="q")

    ctx.stage(*a.values())
    dst = a["out"] if out is not None else ctx.empty(a["q"].shape, a["q"].dtype)
    lse = ctx.empty((call.heads_q, call.seqs.total_q), np.float32) if return_lse else NO_LSE
    if call.offsets_on_device:
        launch_offset_check(ctx, a["cu_seqlens_q"], a["cu_seqlens_k"], call.seqs.batch, call.totals, (call.seqs.max_seqlen_q, NO_BOUND))
    if call.seqs.batch and call.seqs.total_q and call.heads_q:
        p = call.attn_params(a, dst, lse)
        launch_forward(ctx, call.c_type, p, max(call.seqs.max_seqlen_q, 1), call.heads_q, call.seqs.batch, layout="packed")
    result = out if out is not None else ctx.export(dst)
    return (result, ctx.export(lse)) if return_lse else result


def attention_varlen_backward(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False,
    window=None, align="bottom_right", scale=None, softcap=None, sink=None, dropout_p=0.0, dropout_seed=None, dlse=None,
    deterministic=False, dq=None, dk=None, dv=None,
):
    """Gradients of :func:`attention_varlen` with respect to ``q``, ``k`` and ``v`` (and
    ``sink``), as :func:`cuattn.attention_backward` computes them for each sequence.

    Parameters
    ----------
    dout : ``(total_q, heads_q, head_dim)``, the gradient with respect to ``out``.
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k : the forward's (``lse`` ``(heads_q,
        total_q)`` from ``return_lse=True``).
    max_seqlen_q, max_seqlen_k : optional ints, bounds on the lengths that size the dQ and the
        dK / dV grids; omitted, as in :func:`attention_varlen` (from NumPy offsets, else the
        totals), checked as there. The gradients of a sequence longer than a bound are not
        valid (device offsets: the GPU check reports it); the portable and deterministic
        kernels set its rows to NaN, the Hopper fused kernel may compute its dQ in full.
    causal, window, align, scale, softcap, sink, dropout_p, dropout_seed : exactly as given to
        the forward.
    dlse : optional ``(heads_q, total_q)`` float32, the gradient that flowed into ``lse``.
    deterministic : bool, as :func:`cuattn.attention_backward`. Batches of more sequences than
        64-row query blocks always take the deterministic kernels (the fused kernel's dQ
        accumulator would be mostly padding).
    dq, dk, dv : optional arrays to write the gradients into, as :func:`cuattn.attention_backward`
        takes them (``(total, heads, head_dim)``, strides ``(any, head_dim, 1)``).

    Returns
    -------
    ``(dq, dk, dv)`` shaped and typed like ``q``, ``k`` and ``v``; with ``sink``, ``(dq, dk,
    dv, dsink)`` as :func:`cuattn.attention_backward` returns them.
    """
    raise_reported()
    seed_array = dropout_.seed_array_argument(dropout_seed)
    given = dq is not None or dk is not None or dv is not None
    if dropout_.replayable(dropout_p, dropout_seed, seed_array):
        result = replay.run(
            "attention_varlen_backward",
            lambda: attention_varlen_backward(
                dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                causal=causal, window=window, align=align, scale=scale, softcap=softcap, sink=sink, dropout_p=dropout_p,
                dropout_seed=dropout_seed, dlse=dlse, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
            ),
            (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dlse, sink, seed_array, dq, dk, dv),
            (max_seqlen_q, max_seqlen_k, causal, window, align, scale, softcap, deterministic, dropout_p),
            written=((11, None), (12, None), (13, None)) if given else (),
        )
        if result is not replay.MISS:
            return result
    require_arrays(
        {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k},
        _REQUIRED,
    )
    deterministic = check_bool("deterministic", deterministic)
    ctx, a = boundary.import_arrays(
        dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, dlse=dlse, sink=sink,
        dropout_seed=seed_array, dq=dq, dk=dk, dv=dv,
    )
    if given:
        ctx.check_writes("dq= / dk= / dv= are", a["dq"], a["dk"], a["dv"])
    call = _PackedCall(a, max_seqlen_q, max_seqlen_k, causal, window, align, scale, softcap, dropout_p, dropout_seed)
    check_dout(a["dout"], a["q"], call.c_type, PACKED)
    for name in ("lse", "dlse"):
        if a[name] is not None:
            validation.check_rank(name, a[name], 2, PACKED_STATS)
            validation.check_shape(name, a[name], (call.heads_q, call.seqs.total_q), PACKED_STATS)
            validation.check_float32(name, a[name])
            validation.check_unit_last_stride(name, a[name])
    if given:
        check_given_grads(a, 3, PACKED)

    ctx.stage(*a.values())
    grads = [a["d" + n] if a["d" + n] is not None else ctx.empty(a[n].shape, a[n].dtype) for n in ("q", "k", "v")]
    if sink is not None:
        grads.append(ctx.empty((call.heads_q,), np.float32))
    delta = ctx.empty((call.heads_q, call.seqs.total_q), np.float32)
    seqs = call.seqs
    launched = seqs.batch and call.heads_q and (seqs.total_q or seqs.total_k)
    if launched:  # planned (dQ accumulator allocated) before the first launch: a traced JAX call records up to there
        views = {n: one_sequence_view(x) for n, x in a.items()}
        p = backward_params(
            views, [*map(one_sequence_view, grads[:3]), *grads[3:]], one_sequence_view(delta), call.attn_params(a, a["out"], a["lse"]),
        )
        grid = BackwardGrid(
            "packed", seqs.batch, seqs.max_seqlen_q, seqs.max_seqlen_k, call.heads_q, a["k"].shape[1], call.head_dim,
            seqs.total_q, seqs.total_k,
        )
        held = []  # the dQ accumulator, until the launch is queued (plan_backward)
        fused = plan_backward(ctx, call.c_type, p, grid, deterministic, keep=held)
    if call.offsets_on_device:
        launch_offset_check(ctx, a["cu_seqlens_q"], a["cu_seqlens_k"], seqs.batch, call.totals, (seqs.max_seqlen_q, seqs.max_seqlen_k))
    if launched:
        launch_backward(ctx, call.c_type, p, grid, deterministic, fused=fused)
    elif any(g.size for g in grads):  # no query head (K and V had no influence), or no rows at all
        zero_grads(ctx, [g for g in grads if g.size])
    return returned_grads(ctx, grads, (dq, dk, dv))


_REQUIRED = {
    "dout": "the gradient of the loss with respect to out", "out": "the forward's output",
    "lse": "the forward's lse, from return_lse=True",
}


class _PackedCall:
    """The checks and settings that the forward and backward of packed sequences share."""

    def __init__(self, a: dict, max_seqlen_q, max_seqlen_k, causal, window, align, scale, softcap, dropout_p, dropout_seed):
        max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
        max_seqlen_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
        for name in ("q", "k", "v", "out"):
            if a.get(name) is not None:
                validation.check_rank(name, a[name], 3, PACKED)
        total_q, self.heads_q, self.head_dim = a["q"].shape
        total_k = a["k"].shape[0]
        batch = check_cu_seqlens(a["cu_seqlens_q"], a["cu_seqlens_k"], total_q, total_k)
        views = {n: one_sequence_view(a.get(n)) for n in ("q", "k", "v", "out")}
        self.c_type = check_qkv(views["q"], views["k"], views["v"], views["out"])
        check_sink(a.get("sink"), self.heads_q)
        lengths_q = host_lengths(a["cu_seqlens_q"], total_q, "cu_seqlens_q")
        lengths_k = host_lengths(a["cu_seqlens_k"], total_k, "cu_seqlens_k")
        self.offsets_on_device, self.totals = lengths_q is None or lengths_k is None, (total_q, total_k)
        self.options = AttnOptions.from_user(causal, window, align, scale, softcap, head_dim=self.head_dim)
        self.dropout = dropout_.from_user(dropout_p, dropout_seed, a.get("dropout_seed"))
        self.seqs = PackedSequences(  # the offsets' addresses once staged: attn_params
            0, 0, batch, total_q, total_k,
            grid_bound("max_seqlen_q", max_seqlen_q, lengths_q, total_q), grid_bound("max_seqlen_k", max_seqlen_k, lengths_k, total_k),
        )

    def attn_params(self, a: dict, out, lse) -> np.void:
        """AttnParams over the staged arrays of ``a`` with ``out`` and ``lse`` (packed)."""
        views = [one_sequence_view(x) for x in (a["q"], a["k"], a["v"], out, lse)]
        seqs = dataclasses.replace(self.seqs, cu_seqlens_q=a["cu_seqlens_q"].ptr, cu_seqlens_k=a["cu_seqlens_k"].ptr)
        return attn_params(*views, self.options, packed=seqs, sink=a.get("sink"), dropout=self.dropout)


def check_varlen_offsets(synchronize: bool = True) -> None:
    """Raises the ValueError of bad device ``cu_seqlens`` (not starting at 0, decreasing, not
    ending at the total, or a sequence longer than its ``max_seqlen``) that the GPU found in an
    earlier :func:`attention_varlen` / :func:`attention_varlen_backward` call; the next such call
    raises it otherwise. ``synchronize``: first wait for the current device's work to finish
    (pass False after synchronizing yourself, e.g. ``torch.cuda.synchronize()``)."""
    if synchronize:
        from cuattn import requirements

        requirements.check_cupy()
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
    raise_reported()
