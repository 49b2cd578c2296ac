"""Exact attention backward from the forward's saved ``lse``."""

from __future__ import annotations

import itertools

import numpy as np

from cuattn import block_mask as block_mask_, boundary, dropout as dropout_, loader, params, replay, tensor_map, validation
from cuattn.attention import _LAYOUT, attn_params, check_qkv, check_sink, require_arrays, set_mask
from cuattn.kernels import backward
from cuattn.kernels.backward import BackwardGrid
from cuattn.kernels.sparse import GRID_WALKS
from cuattn.kernels.variant import head_dim_bucket
from cuattn.loader import device_smem_limit, small_backward_enabled, tma_enabled, wgmma_enabled
from cuattn.merge import sum_rows
from cuattn.options import AttnOptions
from cuattn.validation import check_bool

_LSE_LAYOUT = "(batch, heads_q, seqlen_q)"
# BackwardParams.sum_grads: the kernels add dQ (1) / dK and dV (2) into fp32 arrays passed in
# their place (dense layout; backward/score_grad.cuh kSumDq, kSumDkDv).
SUM_DQ, SUM_DKDV = 1, 2


def attention_backward(
    dout, q, k, v, out, lse, *, causal=False, window=None, align="bottom_right", scale=None, softcap=None, sink=None,
    sink_tokens=0, dropout_p=0.0, dropout_seed=None, block_mask=None, dlse=None, deterministic=False, dq=None, dk=None, dv=None,
):
    """Gradients of :func:`cuattn.attention` with respect to ``q``, ``k`` and ``v``.

    Probabilities are recomputed on chip from ``q``, ``k`` and the saved ``lse``; the extra
    device memory is one fp32 value per query row (``delta = rowsum(dout * out) - dlse``),
    never O(seqlen^2).

    Parameters
    ----------
    dout : gradient of the loss with respect to ``out``, shaped and typed like ``q``.
    q, k, v, out, lse : the forward's inputs and outputs (``lse`` from ``return_lse=True``).
    causal, window, align, scale, softcap, sink, sink_tokens, dropout_p, dropout_seed, block_mask :
        exactly as given to the forward (dropout's mask is drawn again from the seed; a block
        mask's skipped blocks cost nothing here either).
        With sink tokens outside the window, each of the two key ranges gets its own launches
        (dK / dV written in place, dQ added into an fp32 sum rounded once).
    dlse : optional ``(batch, heads_q, seqlen_q)`` float32, the gradient that flowed into
        ``lse`` (for example through :func:`cuattn.merge`); ``None`` means zero.
    deterministic : bool. ``True`` gives bit-identical gradients across runs: dK and dV are
        summed over a GQA group in registers and dQ is computed by its own kernel, with no
        atomics. ``False`` (default) may sum dQ with fp32 atomics in one pass over the scores
        (on Hopper, float16 / bfloat16, head_dim 33-128: one fp32 value per element
        of ``q`` of extra memory), so its last bits can differ between runs; where that pass
        has few CTAs (grouped queries, few or short sequences) it also splits each key block
        over CTAs that add dK / dV into fp32 sums by atomics (two fp32 arrays shaped like ``k``
        and ``v``), so theirs can too; elsewhere it is the deterministic path.
    dq, dk, dv : optional arrays to write the gradients into (each, any subset), shaped and
        typed like ``q``, ``k``, ``v``, in their framework (CuPy or PyTorch: written in place),
        16-byte aligned rows whose heads are contiguous (strides ``(any, any, head_dim, 1)`` in
        elements, batch and row strides and the address multiples of 16 bytes: slices of a
        packed ``dqkv`` buffer qualify). They must not overlap any input or each other.
        Returned as given; a repeated call then allocates no gradient array (scratch such as
        delta or the dQ accumulator still comes from the memory pool).

    Returns
    -------
    ``(dq, dk, dv)`` shaped and typed like ``q``, ``k`` and ``v`` (fp32 accumulation), as
    arrays of the caller's framework; with ``sink``, ``(dq, dk, dv, dsink)``, ``dsink`` float32
    ``(heads_q,)`` summed over every row of its head in a fixed order (deterministic). Rows
    that see no key get zero gradients.

    Dtypes and head dims as the forward: float16 / bfloat16 on tensor cores (above head_dim
    128 the dK/dV columns are split over two CTAs, each recomputing the scores), float32 on
    the CUDA cores with fp32 accuracy (no tf32).
    """
    given = dq is not None or dk is not None or dv is not None
    if dropout_seed is None and block_mask is None:  # the common call: its arrays are the tensors' (a shorter key)
        seed_array, mask_arrays = None, {}
        arrays = (dout, q, k, v, out, lse, dlse, sink, dq, dk, dv) if given else (dout, q, k, v, out, lse, dlse, sink)
        keyed = (causal, window, align, scale, softcap, sink_tokens, deterministic, dropout_p)
    else:
        seed_array = dropout_.seed_array_argument(dropout_seed)
        mask_arrays = block_mask_.array_arguments(block_mask)
        arrays = (dout, q, k, v, out, lse, dlse, sink, seed_array, *mask_arrays.values(), dq, dk, dv)
        keyed = (causal, window, align, scale, softcap, sink_tokens, deterministic, dropout_p, *block_mask_.replay_key(block_mask))
    if dropout_.replayable(dropout_p, dropout_seed, seed_array):
        result = replay.run(
            "attention_backward",
            lambda: attention_backward(
                dout, q, k, v, out, lse, causal=causal, window=window, align=align, scale=scale, softcap=softcap, sink=sink,
                sink_tokens=sink_tokens, dropout_p=dropout_p, dropout_seed=dropout_seed, block_mask=block_mask, dlse=dlse,
                deterministic=deterministic, dq=dq, dk=dk, dv=dv,
            ),
            arrays, keyed, written=tuple((i, None) for i in range(len(arrays) - 3, len(arrays))) if given else (),
        )
        if result is not replay.MISS:
            return result
    require_arrays({"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}, _REQUIRED)
    deterministic = check_bool("deterministic", deterministic)
    ctx, a = boundary.import_arrays(
        dout=dout, q=q, k=k, v=v, out=out, lse=lse, dlse=dlse, sink=sink, dropout_seed=seed_array, **mask_arrays, dq=dq, dk=dk, dv=dv,
    )
    if given:
        ctx.check_writes("dq= / dk= / dv= are", a["dq"], a["dk"], a["dv"])
    c_type = check_qkv(a["q"], a["k"], a["v"], a["out"])
    batch, seqlen_q, heads_q, head_dim = a["q"].shape
    check_sink(a["sink"], heads_q)
    check_dout(a["dout"], a["q"], c_type, _LAYOUT)
    if given:
        check_given_grads(a)
    for name in ("lse", "dlse"):
        x = a[name]
        if x is None:
            continue
        validation.check_rank(name, x, 3, _LSE_LAYOUT)
        validation.check_shape(name, x, (batch, heads_q, seqlen_q), _LSE_LAYOUT)
        validation.check_float32(name, x)
        validation.check_unit_last_stride(name, x)
    options = AttnOptions.from_user(causal, window, align, scale, softcap, head_dim=head_dim, sink_tokens=sink_tokens)
    dropout = dropout_.from_user(dropout_p, dropout_seed, a["dropout_seed"], options.sink_tokens)
    block_mask_.check_call(block_mask, a, batch, heads_q, seqlen_q, a["k"].shape[1], dropout, options.sink_tokens)

    ctx.stage(*a.values())
    grads = [a["d" + n] if a["d" + n] is not None else ctx.empty(a[n].shape, a[n].dtype) for n in ("q", "k", "v")]
    if sink is not None:
        grads.append(ctx.empty((heads_q,), np.float32))
    seqlen_k, heads_kv = a["k"].shape[1], a["k"].shape[2]
    pieces = options.key_pieces(seqlen_q, seqlen_k)
    if batch and heads_q and (seqlen_q or seqlen_k) and len(pieces) == 1:
        grid = BackwardGrid("dense", batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, batch * seqlen_q, batch * seqlen_k)
        # One launch without a delta pass where the host's time is the call's (a traced JAX
        # call replays the choice that sized its buffers).
        small = ctx.decide("small_backward", lambda: small_backward_enabled() and bool(ctx.arch()) and backward.small_serves(
            grid, c_type, sink is not None, dropout is not None, block_mask is not None, lambda: loader.device_sm_count(ctx.device_index())))
        delta = None if small else ctx.empty((batch, heads_q, seqlen_q), np.float32)
        attn = attn_params(a["q"], a["k"], a["v"], a["out"], a["lse"], options, sink=a["sink"], dropout=dropout,
                           block_mask=block_mask_.kernel_fields(block_mask, a))
        set_mask(attn, pieces[0].fields)
        p = backward_params(a, grads, delta, attn)
        sparse = block_mask is not None
        held = []  # the dQ accumulator, until the launches are queued (the pool would hand its memory to the sums below)
        fused = False if small else plan_backward(ctx, c_type, p, grid, deterministic, sparse=sparse, keep=held)
        # With a dQ accumulator planned (held) the split sums are sized even where this device
        # cannot run the fused kernel, as the accumulator is: a JAX call traced on another GPU
        # allocated them.
        sums = _split_key_blocks(ctx, c_type, p, grid, grads, sparse, fused) if fused or held else None
        launch_backward(ctx, c_type, p, grid, deterministic, fused=fused, small=small, sparse=sparse)
        for total, dst in zip(sums or (), grads[1:3]):
            sum_rows(ctx, None, total, dst)
    elif batch and heads_q and seqlen_q:
        delta = ctx.empty((batch, heads_q, seqlen_q), np.float32)
        _backward_pieces(ctx, c_type, a, grads, delta, options, pieces, deterministic)
    elif any(g.size for g in grads):  # nothing to launch: no query head (K and V had no influence), or no rows at all
        zero_grads(ctx, [g for g in grads if g.size])
    return returned_grads(ctx, grads, (dq, dk, dv))


def returned_grads(ctx, grads: list, given: tuple) -> tuple:
    """``grads`` as a backward returns them: each gradient the caller gave (``(dq, dk, dv)``,
    None where not) as it was passed, the others exported."""
    return tuple(x if x is not None else ctx.export(g) for x, g in itertools.zip_longest(given, grads))


def zero_grads(ctx, arrays) -> None:
    """Zeros in ``arrays``: a memset where contiguous, else (a given gradient whose rows lie
    apart) through its framework, on the call's stream (torch: not recorded by autograd)."""
    strided = [x for x in arrays if x.strides != boundary._contiguous_strides(x.shape)]
    ctx.zero(*(x for x in arrays if not any(x is y for y in strided)))
    with ctx.device, ctx.stream:
        for x in strided:
            if ctx.framework == boundary.TORCH:
                x.native.detach().zero_()
            else:
                x.native.fill(0)


def check_given_grads(a: dict, rank: int = 4, layout: str = _LAYOUT) -> None:
    """dq / dk / dv given to be written: shaped and typed like q / k / v, rows the kernels and
    sum_rows store 16 bytes at a time into (heads contiguous), apart from every input and
    from each other. ``rank`` 3: packed rows (varlen)."""
    inputs = {n: x for n, x in a.items() if n not in ("dq", "dk", "dv")}
    given = [name for name in ("dq", "dk", "dv") if a[name] is not None]
    for name in given:
        g, like = a[name], a[name[1:]]
        validation.check_rank(name, g, rank, layout)
        validation.check_shape(name, g, like.shape, f"(the shape of {name[1:]})")
        validation.check_same_dtype(name, g, name[1:], like)
        validation.check_unit_last_stride(name, g)
        vec = 16 // g.dtype.itemsize
        heads, head_dim = g.shape[-2:]
        row_strides = g.strides[:-2]
        if g.size and (heads > 1 and g.strides[-2] != head_dim or not validation.aligned([g.ptr], row_strides, g.dtype.itemsize, vec, head_dim)):
            raise ValueError(
                f"{name} strides {g.strides} (elements) or its address: rows must be 16-byte aligned with contiguous heads "
                f"(strides ({'any, ' * len(row_strides)}head_dim, 1))"
            )
    for name in given:  # after every given gradient's own checks
        others = {**inputs, **{n: a[n] for n in given if n != name}}
        validation.check_writable_output(name, a[name], others)


def _backward_pieces(ctx, c_type, a, grads, delta, options, pieces, deterministic) -> None:
    """Backward over disjoint key ranges (AttnOptions.key_pieces) with the global ``out`` and
    ``lse``: each range's dK / dV are exact and written in place; the kernels add each range's
    dQ into an fp32 sum, rounded into ``dq`` once. dsink (from the global lse) with the first.
    A range of few key blocks (the sink tokens) splits each block's query steps over CTAs
    (backward.query_splits), each adding into its own fp32 dK / dV, summed in a fixed order."""
    q = a["q"]
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv = a["k"].shape[2]
    dq_sum = ctx.empty(q.shape, np.float32)
    jobs, held = [], []  # everything allocated before the first fill or launch (plan_backward), held until then
    for i, piece in enumerate(pieces):
        keys = piece.stop - piece.start
        k, v, dk, dv = (x.span(1, piece.start, piece.stop) for x in (a["k"], a["v"], grads[1], grads[2]))
        attn = attn_params(q, k, v, a["out"], a["lse"], options, sink=a["sink"] if i == 0 else None)
        set_mask(attn, piece.fields)
        grid = BackwardGrid("dense", batch, seqlen_q, keys, heads_q, heads_kv, head_dim, batch * seqlen_q, batch * keys)
        sink_grad = grads[3:4] if i == 0 else []
        # Shapes what is allocated: a traced JAX call records it (its trace has no device object).
        splits = ctx.decide(f"query_splits_{i}", lambda: backward.query_splits(c_type, grid, loader.device_sm_count(ctx.device_index())))
        partials = None
        if splits == 1:
            p = backward_params(a, [dq_sum, dk, dv, *sink_grad], delta, attn)
            p["sum_grads"] = SUM_DQ
        else:
            partials = ctx.empty((2 * splits * batch, keys, heads_kv, head_dim), np.float32)  # dK's splits, then dV's
            dk_parts, dv_parts = (partials.span(0, first, first + batch) for first in (0, splits * batch))
            p = backward_params(a, [dq_sum, dk_parts, dv_parts, *sink_grad], delta, attn)
            p["sum_grads"], p["query_splits"], p["split_stride"] = SUM_DQ | SUM_DKDV, splits, batch * partials.strides[0]
        jobs.append((p, grid, splits, plan_backward(ctx, c_type, p, grid, deterministic, splits, keep=held), partials, dk, dv))
    ctx.zero(dq_sum, *(job[4] for job in jobs if job[4] is not None))
    for p, grid, splits, fused, partials, dk, dv in jobs:
        launch_backward(ctx, c_type, p, grid, deterministic, splits, fused)
        if partials is not None:
            for first, out in ((0, dk), (splits * batch, dv)):
                _sum_splits(ctx, partials, first, splits, batch, out)
    sum_rows(ctx, None, dq_sum, grads[0])


def _tma_serves(ctx, c_type: str, p: np.void, g: BackwardGrid, sparse: bool) -> bool:
    """Whether the TMA backward takes a fused call (its tensor maps aside: tma_backward_params).
    ``sparse``: whether p has a block mask (a traced call's null addresses cannot tell)."""
    a = p["attn"]
    tile = backward.hopper_bucket(head_dim_bucket(g.head_dim))
    return backward.tma_serves(
        c_type, tile, bool(a["softcap"] > 0), ctx.arch(), wgmma_enabled() and tma_enabled(), g.layout, bool(a["dropout_threshold"]), sparse,
    ) and backward.tma_smem_bytes(tile) <= device_smem_limit(ctx.device_index())


def tma_splits(ctx, c_type: str, p: np.void, g: BackwardGrid, sparse: bool = False) -> int:
    """CTAs per key block of the TMA backward (kernels/backward.py tma_query_splits) for a fused
    call that it serves, else 1."""
    if not _tma_serves(ctx, c_type, p, g, sparse):
        return 1
    return backward.tma_query_splits(g, loader.device_sm_count(ctx.device_index()), sparse)


def _split_key_blocks(ctx, c_type, p, g, grads, sparse: bool, fused: bool = True):
    """Where the TMA backward splits its key blocks' query steps (``tma_splits``), points p's
    dK / dV at zeroed fp32 sums that the splits add into, and returns them (to be rounded into
    dK / dV after the launch); else None. A traced call replays the choice that sized them;
    ``fused`` False (this device takes the unfused kernels) allocates them unused."""
    splits = ctx.decide("tma_query_splits", lambda: tma_splits(ctx, c_type, p, g, sparse) if fused else 1)
    if splits == 1:
        return None
    sums = [ctx.empty(x.shape, np.float32) for x in grads[1:3]]
    if not fused:
        return None
    for total in sums:  # zeros by a launch, which a replayed call repeats (a memset is not recorded)
        sum_rows(ctx, None, total, fresh=True)
    p["dk"], p["dv"], p["dk_strides"], p["dv_strides"] = sums[0].ptr, sums[1].ptr, sums[0].strides[:3], sums[1].strides[:3]
    p["sum_grads"] |= SUM_DKDV
    p["query_splits"] = splits
    return sums


def _sum_splits(ctx, partials, first: int, splits: int, batch: int, out) -> None:
    """``out`` <- the sum of ``splits`` fp32 partials of ``batch`` entries each from entry
    ``first`` of ``partials``, rounded once: halves added pairwise (log2(splits) launches)."""
    if splits < 2 or splits & (splits - 1):
        raise ValueError(f"query splits are summed pairwise: a power of two >= 2, got {splits}")
    def splits_from(split: int, count: int):
        return partials.span(0, first + split * batch, first + (split + count) * batch)

    width = splits
    while width > 2:
        width //= 2
        sum_rows(ctx, splits_from(width, width), splits_from(0, width))
    sum_rows(ctx, splits_from(1, 1), splits_from(0, 1), out)


def check_dout(dout, q, c_type: str, layout: str, name: str = "dout") -> None:
    """``dout`` (or the array ``name``, such as ``out``) shaped and typed like ``q``, loadable by
    the kernels of ``c_type`` (16-bit rows are read 16 bytes at a time)."""
    validation.check_rank(name, dout, len(q.shape), layout)
    validation.check_shape(name, dout, q.shape, "(the shape of q)")
    validation.check_same_dtype(name, dout, "q", q)
    validation.check_unit_last_stride(name, dout)
    if c_type != "float" and dout.ptr is not None and not validation.aligned([dout.ptr], dout.strides[:-1], dout.dtype.itemsize, 8, 8):
        raise ValueError(f"{name} strides {dout.strides} (elements) or its address are not multiples of 16 bytes; make it contiguous")


_REQUIRED = {
    "dout": "the gradient of the loss with respect to out", "q": "the forward's query", "k": "the forward's keys",
    "v": "the forward's values", "out": "the forward's output", "lse": "the forward's lse, from return_lse=True",
}


def backward_params(a, grads, delta, attn: np.void) -> np.void:
    """BackwardParams from the kernels' views (4-D tensors, 3-D statistics) of ``a`` (dout,
    dlse), the gradients and delta (None for backward_small, which sums its own)."""
    dq, dk, dv = grads[:3]
    dlse = a["dlse"]
    return params.pack(
        params.BACKWARD_PARAMS,
        attn=attn, dout=a["dout"].ptr, dq=dq.ptr, dk=dk.ptr, dv=dv.ptr, delta=0 if delta is None else delta.ptr,
        dlse=0 if dlse is None else dlse.ptr, dsink=grads[3].ptr if len(grads) > 3 else 0,
        dout_strides=a["dout"].strides[:3], dq_strides=dq.strides[:3], dk_strides=dk.strides[:3],
        dv_strides=dv.strides[:3], dlse_strides=(0, 0) if dlse is None else dlse.strides[:2],
        delta_strides=(0, 0) if delta is None else delta.strides[:2],
        dq_accum=0, dq_accum_tile_strides=(0, 0), dq_accum_cols=0,  # set by launch_backward when the fused kernel runs
        sum_grads=0, query_splits=1, split_stride=0,
    )


def plan_backward(
    ctx, c_type: str, p: np.void, g: BackwardGrid, deterministic: bool, query_splits: int = 1, *, keep: list,
    sparse: bool = False,
) -> bool:
    """Whether the fused kernel runs; allocates its dQ accumulator and points ``p`` at it. A
    schedule of several backward calls plans them all before its first fill or launch (a
    traced JAX call records allocations up to there). ``query_splits`` > 1 (p's query_splits
    and split_stride set, dK / dV summed into fp32 partials) takes the unfused kernels.
    ``keep``: a list that holds the accumulator until the caller's launches are queued: once
    it is dropped, the pool may hand its memory to the next allocation, which would then share
    it with the kernels. ``sparse``: p has a block mask."""
    bucket, softcap, layout = head_dim_bucket(g.head_dim), bool(p["attn"]["softcap"] > 0), g.layout
    # Whether dQ goes through an fp32 accumulator is decided once: a traced JAX call replays
    # the decision that sized its buffers, whatever CUATTN_WGMMA says by then; a device that
    # cannot run the fused kernel (not Hopper) takes the deterministic kernels and leaves the
    # accumulator unused.
    use_accum = query_splits == 1 and ctx.decide(
        "dq_accumulator",
        lambda: not deterministic and g.accumulator_fits()
        and backward.select_fused(c_type, bucket, softcap, ctx.arch(), wgmma_enabled(), layout, sparse=sparse) is not None,
    )
    fused = use_accum and backward.select_fused(c_type, bucket, softcap, ctx.arch(), layout=layout, sparse=sparse) is not None
    if use_accum and g.rows * g.heads_q:
        columns = backward.hopper_bucket(bucket)  # the fused kernel's tile
        shape, tile_strides = g.dq_accumulator(columns)
        accum = ctx.empty(shape, np.float32)
        keep.append(accum)
        if fused:
            p["dq_accum"], p["dq_accum_tile_strides"], p["dq_accum_cols"] = accum.ptr, tile_strides, columns
    return fused


_STAGES = ("all", "prep", "main", "finish")
_STAGE_OF_KERNEL = {"backward_prep": "prep", "backward_dq_finish": "finish"}  # the rest: "main"


def launch_backward(
    ctx, c_type: str, p: np.void, g: BackwardGrid, deterministic: bool, query_splits: int = 1, fused: bool | None = None,
    stage: str = "all", small: bool = False, sparse: bool | None = None,
) -> None:
    """The backward's launches, planned here unless :func:`plan_backward` gave ``fused``.
    ``stage``: "all", or one part of them for a schedule that shares the fused kernel's dQ
    accumulator between several calls: "prep" (delta, and zeros in the accumulator), "main"
    (the gradient kernels), "finish" (dQ from the accumulator). ``small``: the one launch of
    backward_small (``backward.small_serves``; p without delta), deterministic. ``sparse``:
    whether p has a block mask (where a traced call's null addresses cannot tell)."""
    if stage not in _STAGES:
        raise ValueError(f"stage must be one of {', '.join(_STAGES)}, got {stage!r}")
    if query_splits > 1 and not (p["sum_grads"] & SUM_DKDV and p["query_splits"] == query_splits):
        raise ValueError("query splits add dK / dV into fp32 partials: set sum_grads' SUM_DKDV bit and query_splits")
    if p["query_splits"] > 1 and not p["sum_grads"] & SUM_DKDV:
        raise ValueError("CTAs sharing a key block add dK / dV into fp32 sums: set sum_grads' SUM_DKDV bit")
    if small and (stage != "all" or fused):
        raise ValueError("backward_small is one launch: stage 'all', not fused")
    sparse = bool(p["attn"]["kv_block_counts"]) if sparse is None else sparse
    held = []  # an accumulator planned here, until the launches are queued
    if fused is None:
        fused = False if small else plan_backward(ctx, c_type, p, g, deterministic, query_splits, sparse=sparse, keep=held)
    softcap, arch = bool(p["attn"]["softcap"] > 0), ctx.arch()
    sink = bool(p["attn"]["sink"])
    dropout = bool(p["attn"]["dropout_threshold"])
    # Block-sparse gradient kernels take their CTAs' order from a schedule each: the fused kernel
    # walks key blocks, the two-kernel backward query blocks (dQ) and key blocks (dK / dV). Both
    # are allocated either way: a traced call records whether dQ has an accumulator, not
    # whether the device then runs the fused kernel.
    schedules = {side: block_mask_.schedule_buffer(ctx, p["attn"], side, g.batch) for side in ("q", "k")} if sparse else {}
    with ctx.device, ctx.stream:
        tp = None
        if fused and stage in ("all", "main") and _tma_serves(ctx, c_type, p, g, sparse):
            tp = tma_backward_params(c_type, p, g.head_dim)
        if tp is None and query_splits == 1:  # the TMA backward's splits (tma_splits), where another kernel runs: one CTA per key block
            p["query_splits"] = 1
        plan = backward.launches(
            g, c_type, softcap, arch, wgmma_enabled(), device_smem_limit(ctx.device.id), fused, sink, query_splits, dropout, sparse, small,
            tma=tp is not None, tma_splits=int(p["query_splits"]) if tp is not None else 1,
        )
        for variant, variant_launches in plan:
            if stage != "all" and _STAGE_OF_KERNEL.get(variant.kernel, "main") != stage:
                continue
            if sparse and variant.kernel in GRID_WALKS and variant.ordered:
                block_mask_.order_launch(ctx, schedules[GRID_WALKS[variant.kernel][0]], variant, variant_launches[0][0], p["attn"])
            for grid, block, batch_offset in variant_launches:
                if batch_offset is not None:
                    p["attn"]["batch_offset"] = batch_offset
                if variant.kernel == "backward_tma":
                    tp["bwd"] = p
                    ctx.launch(variant, grid, block, tp)
                else:
                    ctx.launch(variant, grid, block, p)


def tma_backward_params(c_type: str, p: np.void, head_dim: int) -> np.void | None:
    """``p`` with the tensor maps of q, k, v and dout (backward/backward_tma.cu), or None where
    one of them cannot be described (cuattn/tensor_map.py)."""
    tp = params.new(params.TMA_BACKWARD_PARAMS)
    a = p["attn"]
    block_m, _ = backward.TMA_TILES[backward.hopper_bucket(head_dim_bucket(head_dim))]
    q_shape, k_shape, keys = tensor_map.query_shape(a), tensor_map.key_shape(a), backward.TMA_KEYS
    tensors = (("q", a["q"], a["q_strides"], q_shape, block_m), ("k", a["k"], a["k_strides"], k_shape, keys),
               ("v", a["v"], a["v_strides"], k_shape, keys), ("dout", p["dout"], p["dout_strides"], q_shape, block_m))
    return tp if tensor_map.put_maps(c_type, tp, tensors) else None
