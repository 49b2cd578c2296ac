"""Exact attention forward."""

from __future__ import annotations

import numpy as np

from cuattn import block_mask as block_mask_, boundary, dropout as dropout_, params, replay, tensor_map, validation
from cuattn.kernels import forward
from cuattn.kernels.variant import HEAD_DIM_BUCKETS, head_dim_bucket
from cuattn.loader import device_arch, device_sm_count, device_smem_limit, tma_enabled, wgmma_enabled
from cuattn.options import MAX_PACKED_ROWS, AttnOptions
from cuattn.validation import check_bool

_LAYOUT = "(batch, seqlen, heads, head_dim)"
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]


def attention(
    q, k, v, *, causal=False, window=None, align="bottom_right", scale=None, softcap=None, sink=None, sink_tokens=0,
    dropout_p=0.0, dropout_seed=None, block_mask=None, return_lse=False, out=None,
):
    """Exact softmax attention, ``softmax(scale * q k^T + mask) v``, in one tiled kernel.

    Parameters
    ----------
    q : ``(batch, seqlen_q, heads_q, head_dim)``
    k, v : ``(batch, seqlen_k, heads_kv, head_dim)``; ``heads_q % heads_kv == 0`` (MHA, GQA,
        MQA). K/V are read in place for every query head of their group, never copied.
        float16 or bfloat16 (tensor cores, fp32 accumulation) or float32 (CUDA cores, dot
        products, output and denominator accumulated in fp64, no tf32; a slower path).
        ``head_dim``: a multiple of 8 up to 256 (computed in the kernel padded to the next of
        32, 64, 96, ..., 256). Any strides with a unit last stride; for
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
        If given, scores become ``softcap * tanh(scale * q.k / softcap)`` before the softmax
        (0, FlashAttention's default, is none).
    sink : optional ``(heads_q,)`` float32 array (the caller's framework, on q's device)
        Attention sinks: head ``h``'s logit ``sink[h]`` joins the denominator of every row's
        softmax as one more score (after scale and softcap) that has no value, so a row's
        weights sum to ``1 - exp(sink[h] - lse)``; ``lse`` includes it. A row that sees no key
        then gets ``out = 0`` and ``lse = sink[h]``. :func:`cuattn.attention_backward` returns
        its gradient.
    sink_tokens : int, default 0
        The StreamingLLM form: keys ``0 .. sink_tokens - 1`` stay visible to every row beside
        ``window``'s left bound (the right bound and ``causal`` still apply). Computed as two
        passes over disjoint key ranges, the sink tokens and the rest, the first folded into
        an fp32 accumulator that the second merges by lse and rounds once (one more launch
        and one fp32 read and write of the output's size). No effect without a left bound.
    dropout_p : float in [0, 1), default 0
        Dropout on the attention probabilities (after the softmax; ``lse`` is that of the
        softmax without dropout), as in the FlashAttention paper: each kept probability is
        divided by the kept fraction, and the mask is never stored: the backward draws it
        again from ``dropout_seed``. Applied as an 8-bit threshold, as in FlashAttention:
        ``threshold = min(round(256 p), 255)`` (Python rounding), kept fraction ``1 - threshold
        / 256``. Element (i, j) of head h of sequence b depends only on the seed and (b, h, i, j)
        (Philox4x32-10; :func:`cuattn.reference.dropout_keep` draws the same mask on the host).
        Not with ``sink_tokens``.
    dropout_seed : int in [0, 2**64), or an array on q's device: ``(2,)`` uint32 (low word
        first) or ``(1,)`` int64 / uint64
        Required when ``dropout_p > 0``; the backward must get the same one. An array is read
        by the kernels when they run, so a captured CUDA graph can change it between replays,
        and calls take the replayed host path; with an int seed every call takes the full host
        path (the seed is baked into its launch).
    block_mask : optional :class:`cuattn.block_mask.BlockMask`
        Block-sparse attention: only the 128 x 128 blocks of the score matrix the mask keeps
        are computed (skipped blocks cost nothing); ``causal`` / ``window`` still mask inside
        kept blocks. Its arrays on q's device, in q's framework. Not with ``dropout_p`` or
        ``sink_tokens``. A row whose kept blocks hold no visible key gets ``out = 0``, ``lse =
        -inf``, as any row that sees no key.
    return_lse : bool
        Also return ``lse``, ``(batch, heads_q, seqlen_q)`` float32: the natural log of each
        row's softmax denominator including its max, ``lse = m + log(l)``; merging partial
        results with :func:`cuattn.merge` and the backward pass use it.
    out : optional array like ``q`` to write the result into (same framework, shape, dtype;
        CuPy or PyTorch). It may be ``q`` itself, and must not overlap any other argument.
        Returned as given; a repeated call with it allocates no output.

    Returns
    -------
    ``out`` shaped and typed like ``q`` (or ``(out, lse)``), as the caller's array type. Extra
    device memory is only ``out`` and ``lse``: O(seqlen), never O(seqlen^2).
    """
    seed_array = dropout_.seed_array_argument(dropout_seed)
    mask_arrays = block_mask_.array_arguments(block_mask)
    if dropout_.replayable(dropout_p, dropout_seed, seed_array):
        result = replay.run(
            "attention",
            lambda: attention(
                q, k, v, causal=causal, window=window, align=align, scale=scale, softcap=softcap, sink=sink, sink_tokens=sink_tokens,
                dropout_p=dropout_p, dropout_seed=dropout_seed, block_mask=block_mask, return_lse=return_lse, out=out,
            ),
            (q, k, v, sink, seed_array, out, *mask_arrays.values()),
            (causal, window, align, scale, softcap, sink_tokens, return_lse, dropout_p, *block_mask_.replay_key(block_mask)),
            written=((5, 0),) if out is not None else (),
        )
        if result is not replay.MISS:
            return result
    require_arrays({"q": q, "k": k, "v": v})
    return_lse = check_bool("return_lse", return_lse)
    ctx, a = boundary.import_arrays(q=q, k=k, v=v, sink=sink, dropout_seed=seed_array, out=out, **mask_arrays)
    if out is not None:
        ctx.check_writes("out= is", a["out"])
    c_type = check_qkv(a["q"], a["k"], a["v"], a["out"])
    check_sink(a["sink"], a["q"].shape[2])
    if out is not None:  # out=q is safe: each CTA reads its query rows before it writes them
        validation.check_writable_output("out", a["out"], {n: x for n, x in a.items() if n != "out"}, same_as_ok="q")
    batch, seqlen_q, heads_q, head_dim = a["q"].shape
    options = AttnOptions.from_user(causal, window, align, scale, softcap, head_dim=head_dim, sink_tokens=sink_tokens)
    pieces = options.key_pieces(seqlen_q, a["k"].shape[1])
    dropout = dropout_.from_user(dropout_p, dropout_seed, a["dropout_seed"], options.sink_tokens)
    block_mask_.check_call(block_mask, a, batch, heads_q, seqlen_q, a["k"].shape[1], dropout, options.sink_tokens)

    ctx.stage(*a.values())
    dst = a["out"] if out is not None else ctx.empty(a["q"].shape, a["q"].dtype)
    # Without return_lse the kernels skip lse (a null pointer): nothing to allocate, unless
    # pieces are folded (the fold reads the accumulated lse).
    lse = ctx.empty((batch, heads_q, seqlen_q), np.float32) if return_lse or len(pieces) > 1 else NO_LSE
    if batch and seqlen_q and heads_q:
        if len(pieces) == 1:
            p = attn_params(a["q"], a["k"], a["v"], dst, lse, options, sink=a["sink"], dropout=dropout,
                            block_mask=block_mask_.kernel_fields(block_mask, a))
            set_mask(p, pieces[0].fields)
            launch_forward(ctx, c_type, p, seqlen_q, heads_q, batch, sparse=block_mask is not None)
        else:
            _forward_pieces(ctx, c_type, a, dst, lse, options, pieces)
    result = out if out is not None else ctx.export(dst)
    return (result, ctx.export(lse)) if return_lse else result


def _forward_pieces(ctx, c_type, a, dst, lse, options, pieces) -> None:
    """Forward over disjoint key ranges: each launch folds its partial result into an fp32
    accumulator (forward/accumulate.cuh), the last one writes ``dst``. The sink logit, if
    any, joins the first piece's denominator only."""
    q = a["q"]
    acc = ctx.empty(q.shape, np.float32)
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        k, v = a["k"].span(1, piece.start, piece.stop), a["v"].span(1, piece.start, piece.stop)
        p = attn_params(q, k, v, dst if last else dst.unwritten(), lse, options, sink=a["sink"] if i == 0 else None)
        set_mask(p, piece.fields)
        p["accum"], p["accum_strides"], p["accum_fresh"] = acc.ptr, acc.strides[:3], int(i == 0)
        launch_forward(ctx, c_type, p, q.shape[1], q.shape[2], q.shape[0])


def set_mask(p: np.void, fields: dict) -> None:
    """The mask fields of AttnParams (window bounds, diagonal offset) from ``fields``."""
    for name in ("window_left", "window_right", "diagonal_offset"):
        p[name] = fields[name]


MAX_HEADS_Q, MAX_HEADS_KV = 65535, 32767
NO_LSE = boundary.DeviceArray(0, (0, 0, 0), (0, 0, 0), np.dtype(np.float32), None)


def require_arrays(arrays: dict, hints: dict | None = None) -> None:
    """TypeError naming the first required array argument that is None (and what it is)."""
    for name, x in arrays.items():
        if x is None:
            hint = f" ({hints[name]})" if hints and name in hints else ""
            raise TypeError(f"{name} is required, got None{hint}")


def check_sink(sink, heads_q: int) -> None:
    """``sink``: None, or ``(heads_q,)`` float32 with unit stride."""
    if sink is None:
        return
    validation.check_rank("sink", sink, 1, "(heads_q,)")
    validation.check_shape("sink", sink, (heads_q,), "(heads_q,)")
    validation.check_float32("sink", sink)
    validation.check_unit_last_stride("sink", sink)


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
    for name, rows, what in (("q", seqlen_q, "seqlen_q"), ("k", k.shape[1], "seqlen_k")):
        if rows > MAX_PACKED_ROWS:  # row and key indices are int32 in the kernels, a tile past the last
            raise ValueError(f"{name} has {what} = {rows}; at most 2**31 - 256 rows per sequence are supported")
    if batch >= 2**31:
        raise ValueError(f"q has batch = {batch}; at most 2**31 - 1 sequences are supported")
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


def attn_params(q, k, v, out, lse, options: AttnOptions, packed=None, sink=None, dropout=None, block_mask=None) -> np.void:
    """AttnParams of the forward problem (shared with the backward) from the kernels' 4-D
    views. ``packed``: a :class:`cuattn.packed.PackedSequences` (the views are then of one
    sequence of ``total`` rows, cuattn.packed.one_sequence_view), or None for dense tensors;
    ``sink``: the sinks' array, or None; ``block_mask``: the block mask's fields
    (:func:`cuattn.block_mask.kernel_fields`), or None."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    seqs = (0, 0, 0, 0, 0)
    if packed is None:
        mask = options.kernel_fields(seqlen_q, seqlen_k)
    else:  # the kernels read lengths from the offsets; seqlen_* bound them
        mask = options.kernel_fields(packed.total_q, packed.total_k, packed=True)
        batch, seqlen_q, seqlen_k = packed.batch, packed.max_seqlen_q, packed.max_seqlen_k
        seqs = (packed.cu_seqlens_q, packed.cu_seqlens_k, packed.total_q, packed.total_k, int(options.bottom_right))
    return params.pack(
        params.ATTN_PARAMS,
        q=q.ptr, k=k.ptr, v=v.ptr, out=out.ptr, lse=lse.ptr, sink=0 if sink is None else sink.ptr,
        q_strides=q.strides[:3], k_strides=k.strides[:3], v_strides=v.strides[:3],
        out_strides=out.strides[:3], lse_strides=lse.strides[:2],
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_kv=k.shape[2], head_dim=head_dim,
        **mask, batch_offset=0,
        cu_seqlens_q=seqs[0], cu_seqlens_k=seqs[1], total_q=seqs[2], total_k=seqs[3], bottom_right=seqs[4],
        cache_seqlens=0, block_table=0, cache_batch_idx=0, block_table_stride=0, capacity=0, cache_rows=0, page_size=0, seqlen_new=0,
        accum=0, accum_strides=(0, 0, 0), accum_fresh=0,
        **(dropout_.NO_DROPOUT_FIELDS if dropout is None else dropout.fields()),
        **(block_mask or block_mask_.NO_BLOCK_MASK_FIELDS),
    )


def launch_forward(ctx, c_type, p, rows, heads_q, batch, layout="dense", sparse=None) -> None:
    """Launches the forward kernel of ``layout`` over ``rows`` query rows per sequence (for
    packed sequences a bound that sizes the grid, common/seq_layout.cuh); the accumulating form
    when ``p`` names an accumulator, the dropout form when it has a dropout threshold, the
    block-sparse form when it has a block mask (``sparse``: whether it has one, where a traced
    call's null addresses cannot tell)."""
    fold, dropout = bool(p["accum"]), bool(p["dropout_threshold"])
    sparse = bool(p["kv_block_counts"]) if sparse is None else sparse
    schedule = block_mask_.schedule_buffer(ctx, p, "q", batch) if sparse else None
    with ctx.device, ctx.stream:
        arch = device_arch(ctx.device.id)
        head_dim = int(p["head_dim"])
        tp = None
        if forward.tma_serves(c_type, head_dim, arch, wgmma_enabled() and tma_enabled(), layout, fold, dropout, sparse):
            planned = tma_plan(c_type, p, rows, heads_q, batch, sparse, layout, ctx.device.id, fold)
            if planned[0].dynamic_smem <= device_smem_limit(ctx.device.id):
                variant, plan, several, page_copy = planned
                tp = tma_params(c_type, p, sparse, several, page_copy)
        if tp is not None:
            args, attn = tp, tp["attn"]
        else:
            variant = forward.select(c_type, head_dim_bucket(head_dim), p["softcap"] > 0, arch, wgmma_enabled(), layout, fold, dropout, sparse)
            plan = forward.launches(variant, rows, heads_q, batch)
            args, attn = p, p
        if sparse:
            block_mask_.order_launch(ctx, schedule, variant, plan[0][0], attn)
        for grid, block, batch_offset in plan:
            attn["batch_offset"] = batch_offset
            ctx.launch(variant, grid, block, args)


def tma_plan(c_type: str, p: np.void, rows: int, heads_q: int, batch: int, sparse: bool, layout: str, device_id: int, fold: bool = False):
    """The TMA forward's variant, its launches, whether it is the SEVERAL form (CTAs taking
    two row blocks each where :func:`cuattn.kernels.forward.tma_row_blocks_per_cta` says so),
    else one CTA per row block (always when it ``fold``s into an accumulator), and whether a
    paged cache's K and V come by the producer's copies (:func:`cuattn.kernels.forward.tma_page_copy`)
    rather than TMA boxes."""
    tile, softcap = forward.tma_tile(int(p["head_dim"])), p["softcap"] > 0
    page_copy = layout == "paged_cache" and forward.tma_page_copy(tile, softcap, int(p["page_size"]))  # else by boxes
    if layout != "dense" or fold:
        variant = forward.tma_variant(c_type, tile, softcap, layout=layout, fold=fold, page_copy=page_copy)
        return variant, forward.tma_launches(variant, rows, heads_q, batch, 1), False, page_copy
    per_cta = 1
    if forward.tma_takes_several(tile, softcap, sparse):
        block_m = 64 * forward.tma_tiling(tile, softcap, several=True)[2]  # the SEVERAL form's rows per tile
        kv_bytes = 4 * int(p["seqlen_k"]) * int(p["head_dim"]) * int(p["heads_kv"]) // heads_q  # K and V per query head
        banded = p["window_left"] >= 0 or p["window_right"] >= 0
        per_cta = forward.tma_row_blocks_per_cta(rows, block_m, heads_q * batch, device_sm_count(device_id), kv_bytes, banded, tile)
    several = per_cta > 1
    variant = forward.tma_variant(c_type, tile, softcap, sparse, several)
    return variant, forward.tma_launches(variant, rows, heads_q, batch, per_cta), several, False


def tma_params(c_type: str, p: np.void, sparse: bool = False, several: bool = False, page_copy: bool = False) -> np.void | None:
    """``p`` with the tensor maps of q, k and v (forward/forward_tma.cu), or None where one of
    them cannot be described (cuattn/tensor_map.py). A paged cache whose producer copies
    (``page_copy``, :func:`tma_plan`'s choice) has q's map alone (its 16-byte copies need the
    alignment attention_with_kvcache checks)."""
    tp = params.new(params.TMA_ATTN_PARAMS)
    tp["attn"] = p
    tile = forward.tma_tile(int(p["head_dim"]))
    block_n, _, consumers = forward.tma_tiling(tile, p["softcap"] > 0, sparse, several)
    q_shape, k_shape = tensor_map.query_shape(p), tensor_map.key_shape(p)
    q_entry = ("q", p["q"], p["q_strides"], q_shape, 64 * consumers)
    if page_copy:
        return tp if tensor_map.put_maps(c_type, tp, (q_entry,)) else None
    kv_rows = forward.tma_page_boxes(int(p["page_size"]), block_n) if p["block_table"] else block_n
    if kv_rows is None:
        return None
    return tp if tensor_map.put_maps(c_type, tp, (q_entry, ("k", p["k"], p["k_strides"], k_shape, kv_rows),
                                                  ("v", p["v"], p["v_strides"], k_shape, kv_rows))) else None
