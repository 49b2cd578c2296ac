"""Decoding against a KV cache: the new query rows of each sequence attend to its cached keys,
the keys split over CTAs and merged by lse (``cuda_src/decode/``, plan in
:mod:`cuattn.kernels.decode`)."""

from __future__ import annotations

import numpy as np

from cuattn import boundary, launch, params, replay, validation
from cuattn.attention import NO_LSE, attn_params, check_sink, launch_forward, require_arrays, set_mask
from cuattn.kernels import decode as plan
from cuattn.kernels import forward
from cuattn.kernels.variant import head_dim_bucket
from cuattn.loader import device_arch, device_sm_count, device_smem_limit, resident_ctas, wgmma_enabled
from cuattn.options import MAX_PACKED_ROWS, AttnOptions
from cuattn.validation import check_bool

_Q = "(batch, seqlen_q, heads_q, head_dim)"
_CACHE = "(batch_cache, max_seqlen, heads_kv, head_dim), or (num_pages, page_size, heads_kv, head_dim) with block_table"
_DTYPES = ("float16", "bfloat16")


def attention_with_kvcache(
    q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None, cache_batch_idx=None, causal=True,
    window=None, scale=None, softcap=None, sink=None, num_splits=None, return_lse=False, out=None,
):
    """Attention of new query rows over each sequence's KV cache (decoding, speculative
    decoding, chunked prefill), without copying the cache.

    Parameters
    ----------
    q : ``(batch, seqlen_q, heads_q, head_dim)`` float16 / bfloat16: the new tokens of each
        sequence, bottom-right aligned to its cache (token ``t`` sits at position
        ``cache_seqlens[b] + seqlen_new - seqlen_q + t``, ``seqlen_new`` 0 without ``k_new``).
    k_cache, v_cache : a contiguous cache ``(batch_cache, max_seqlen, heads_kv, head_dim)``
        (sequence ``b`` in row ``cache_batch_idx[b]``, or ``b``), or with ``block_table`` a paged
        cache ``(num_pages, page_size, heads_kv, head_dim)`` of any page size. ``q``'s dtype;
        ``heads_q`` a multiple of ``heads_kv`` (the query heads of a KV head are computed
        together from one read of its keys and values).
    cache_seqlens : ``(batch,)`` int32: the keys of sequence ``b`` are its first
        ``cache_seqlens[b]`` positions (0 allowed), plus the appended rows.
    k_new, v_new : optional ``(batch, seqlen_new, heads_kv, head_dim)``: written into the cache
        in place at positions ``cache_seqlens[b] + t`` first (as :func:`append_kv`; ``k_cache``
        and ``v_cache`` must then share no memory with each other or with any other argument,
        a ValueError otherwise; interleaved in one buffer is fine), then attended to.
        ``cache_seqlens`` itself is not changed: add ``seqlen_new`` to it for the next step.
    block_table : optional ``(batch, max_pages)`` int32: page ``i`` of sequence ``b`` is
        ``k_cache[block_table[b, i]]``. A NumPy table is checked on the host whole: every
        entry a page of the cache, those past a sequence's length included.
    cache_batch_idx : optional ``(batch,)`` int32, contiguous caches only.
    causal, window, scale, softcap, sink : as :func:`cuattn.attention` (``causal`` defaults to
        True: a new token sees the cache and the new tokens before it). A window's hidden keys
        below ``cache_seqlens`` may still be read with the visible keys of their key block
        (64 or 128 keys) and weighed 0, as in FlashAttention: pages a serving pool frees
        outside the window must stay mapped to finite values (0 x NaN is NaN).
    num_splits : optional int >= 1: CTAs over each sequence's keys. None chooses from the
        shapes and the SM count only, so a CUDA graph of the call serves any lengths and page
        tables. Calls with at least 64 new tokens per sequence (chunked prefill) take the tiled
        forward kernel with the cache's addressing instead, one CTA per 128 query rows and
        head, and do not split the keys (``num_splits`` is then not used).
    return_lse : bool. Also return ``lse`` ``(batch, heads_q, seqlen_q)`` float32.
    out : optional array like ``q``, written in place (it may be ``q`` itself and must not
        overlap any other argument); returned as given.

    NumPy ``cache_seqlens`` / ``block_table`` / ``cache_batch_idx`` are checked on the host.
    Device values are not read there; the kernels clamp them: reads take lengths within
    ``[0, capacity]`` (the cache's ``max_seqlen``, or ``max_pages * page_size``) and page
    numbers and cache rows within the cache; appends skip positions past the capacity, pages
    outside the cache and (``cache_batch_idx``) rows outside it. No value reads or writes
    outside the cache; an append writes only the rows or pages its index arrays name (a table
    entry naming another sequence's page writes there), and rows of two sequences appended at
    the same position (a repeated ``cache_batch_idx``, a shared page) race. A sequence whose
    ``cache_seqlens[b] + seqlen_new`` passes the capacity keeps its first ``capacity`` keys,
    and its new tokens are aligned to that end (token ``t`` then sits ``capacity - seqlen_q +
    t``, not where the rows dropped would have put it): keep lengths within the capacity.

    Returns ``out`` (or ``(out, lse)``) as the caller's array type.
    """
    written = ((1, None), (2, None)) if k_new is not None else ()  # the append writes k_cache and v_cache
    result = replay.run(
        "attention_with_kvcache",
        lambda: attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new, block_table=block_table,
            cache_batch_idx=cache_batch_idx, causal=causal, window=window, scale=scale, softcap=softcap, sink=sink,
            num_splits=num_splits, return_lse=return_lse, out=out,
        ),
        (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, cache_batch_idx, sink, out),
        (causal, window, scale, softcap, num_splits, return_lse),
        written=written + (((9, 0),) if out is not None else ()),
    )
    if result is not replay.MISS:
        return result
    require_arrays({"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens})
    return_lse = check_bool("return_lse", return_lse)
    ctx, a = boundary.import_arrays(
        q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new, block_table=block_table,
        cache_batch_idx=cache_batch_idx, sink=sink, out=out,
    )
    if out is not None:
        ctx.check_writes("out= is", a["out"])
    _check_q(a)
    batch, seqlen_q, heads_q, head_dim = a["q"].shape
    cache = _check_cache(a, batch, head_dim)
    _check_new(ctx, a, cache)
    heads_kv = a["k_cache"].shape[2]
    check_sink(a["sink"], heads_q)
    options = AttnOptions.from_user(causal, window, "bottom_right", scale, softcap, head_dim=head_dim)
    splits = check_num_splits(num_splits)
    if out is not None:
        validation.check_writable_output("out", a["out"], {n: x for n, x in a.items() if n != "out"}, same_as_ok="q")

    ctx.stage(*a.values())
    dst = a["out"] if out is not None else ctx.empty(a["q"].shape, a["q"].dtype)
    lse = ctx.empty((batch, heads_q, seqlen_q), np.float32) if return_lse else NO_LSE
    if cache["seqlen_new"] and not (seqlen_q and heads_q):  # nothing to attend: the append alone
        _append_only(ctx, a, cache, batch, heads_kv, head_dim)
    if batch and seqlen_q and heads_q:
        c_type = validation.check_dtype("q", a["q"], _DTYPES)
        paged = a["block_table"] is not None
        if plan.prefill_by_forward(seqlen_q):
            layout = "paged_cache" if paged else "cache"
            tiles = forward.select(  # the kernel launch_forward takes, checked before the append
                c_type, head_dim_bucket(head_dim), options.softcap > 0, device_arch(ctx.device_index()), wgmma_enabled(), layout)
            if tiles.dynamic_smem > device_smem_limit(ctx.device_index()):
                raise ValueError(
                    f"attention_with_kvcache of {seqlen_q} new tokens at head_dim {head_dim} needs {tiles.dynamic_smem} bytes of shared "
                    f"memory per block; this GPU has {device_smem_limit(ctx.device_index())}"
                )
            forward.launches(tiles, seqlen_q, heads_q, batch)  # may raise: before the append
            p = _forward_params(a, dst, lse, options, cache)
            if cache["seqlen_new"]:
                _append_only(ctx, a, cache, batch, heads_kv, head_dim)
            launch_forward(ctx, c_type, p, seqlen_q, heads_q, batch, layout=layout)
        else:
            _launch_decode(ctx, c_type, a, dst, lse, options, cache, splits)
    result = out if out is not None else ctx.export(dst)
    return (result, ctx.export(lse)) if return_lse else result


def _launch_decode(ctx, c_type: str, a: dict, dst, lse, options: AttnOptions, cache: dict, splits: int | None) -> None:
    """The split decode kernel (and the merge of its splits), after the append if any."""
    batch, seqlen_q, heads_q, head_dim = a["q"].shape
    heads_kv = a["k_cache"].shape[2]
    row_blocks = -(-(heads_q // heads_kv) * seqlen_q // plan.ROWS)
    bucket, paged = head_dim_bucket(head_dim), a["block_table"] is not None
    device = ctx.device_index()  # a traced call (JAX) sizes the splits for the current device
    smem_limit, sm_count = device_smem_limit(device), device_sm_count(device)
    if plan.stages(bucket, paged, smem_limit) is None:
        raise ValueError(
            f"attention_with_kvcache at head_dim {head_dim} needs {plan.smem_bytes_for(bucket, 2)} bytes of shared memory "
            f"per block; this GPU has {smem_limit}"
        )
    wide = plan.wide_grid(batch, heads_kv, row_blocks, sm_count)
    runs = plan.takes_runs(bucket, cache["page_size"] if paged else None)
    warps = plan.decode_warps(bucket, paged, batch, heads_kv, row_blocks, cache["capacity"], sm_count, smem_limit, splits)
    attend = plan.variant(c_type, bucket, paged, options.softcap > 0, smem_limit, wide, runs, warps)
    splits = ctx.decide("decode_splits", lambda: splits or plan.num_splits(
        bucket, paged, batch, heads_kv, row_blocks, cache["capacity"], sm_count, smem_limit, wide, resident_ctas(attend, device), warps))
    grid = plan.grid(splits, heads_kv, row_blocks, batch)  # may raise: before the cache is written
    partial_out = partial_lse = NO_LSE
    if splits > 1:
        partial_out = ctx.empty((splits, batch, seqlen_q, heads_q, head_dim), np.float32)
        partial_lse = ctx.empty((splits, batch, heads_q, seqlen_q), np.float32)
    fields = options.kernel_fields(seqlen_q, cache["capacity"])
    split_blocks = plan.split_blocks(cache["capacity"], splits)
    dependent = plan.dependent_launch(paged, warps, splits, cache["capacity"])
    prefetch = ctx.decide("decode_prefetch", lambda: plan.prefetch_blocks(
        paged, dependent and attend.dependent and launch.enabled() and launch.supported(device), split_blocks, wide))
    p = params.pack(
        params.DECODE_PARAMS,
        q=a["q"].ptr, k=a["k_cache"].ptr, v=a["v_cache"].ptr, out=dst.ptr, lse=lse.ptr, sink=_ptr(a["sink"]),
        partial_out=partial_out.ptr, partial_lse=partial_lse.ptr, cache_seqlens=a["cache_seqlens"].ptr,
        block_table=_ptr(a["block_table"]), cache_batch_idx=_ptr(a["cache_batch_idx"]),
        k_new=_ptr(a["k_new"]), v_new=_ptr(a["v_new"]),
        q_strides=a["q"].strides[:3], k_strides=a["k_cache"].strides[:3], v_strides=a["v_cache"].strides[:3],
        out_strides=dst.strides[:3], lse_strides=lse.strides[:2],
        k_new_strides=_strides(a["k_new"]), v_new_strides=_strides(a["v_new"]),
        block_table_stride=0 if a["block_table"] is None else a["block_table"].strides[0],
        batch=batch, seqlen_q=seqlen_q, seqlen_new=cache["seqlen_new"], heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
        capacity=cache["capacity"], cache_rows=a["k_cache"].shape[0], page_size=cache["page_size"], num_splits=splits,
        window_left=fields["window_left"], window_right=fields["window_right"], prefetch_blocks=prefetch, scale=fields["scale"],
        softcap=fields["softcap"], exp2_scale=fields["exp2_scale"],
    )
    with ctx.device, ctx.stream:
        if cache["seqlen_new"]:
            _launch_append(ctx, c_type, a, p, batch * cache["seqlen_new"] * heads_kv)
        ctx.launch(attend, grid, (attend.threads, 1, 1), p, dependent)
        if splits > 1:
            combine = plan.combine_variant(c_type, bucket)
            ctx.launch(combine, plan.combine_grid(batch * seqlen_q * heads_q), (combine.threads, 1, 1), p)


def _forward_params(a: dict, dst, lse, options: AttnOptions, cache: dict) -> np.void:
    """AttnParams of the tiled forward over the cache layouts (chunked prefill)."""
    p = attn_params(a["q"], a["k_cache"], a["v_cache"], dst, lse, options, sink=a["sink"])
    fields = options.kernel_fields(a["q"].shape[1], cache["capacity"])
    # The bounds the capacity gives (a paged cache's shape[1] is the page size, which attn_params
    # saw): the kernels read each sequence's length.
    p["seqlen_k"] = cache["capacity"]
    set_mask(p, fields)
    p["cache_seqlens"], p["block_table"], p["cache_batch_idx"] = a["cache_seqlens"].ptr, _ptr(a["block_table"]), _ptr(a["cache_batch_idx"])
    p["block_table_stride"] = 0 if a["block_table"] is None else a["block_table"].strides[0]
    p["capacity"], p["cache_rows"], p["page_size"], p["seqlen_new"] = cache["capacity"], a["k_cache"].shape[0], cache["page_size"], cache["seqlen_new"]
    return p


def append_kv(k_new, v_new, k_cache, v_cache, *, cache_seqlens, block_table=None, cache_batch_idx=None):
    """Writes ``k_new`` / ``v_new`` ``(batch, seqlen_new, heads_kv, head_dim)`` into the KV cache
    in place, row ``t`` of sequence ``b`` at position ``cache_seqlens[b] + t`` (crossing pages as
    needed); the cache, ``block_table`` and ``cache_batch_idx`` as in
    :func:`attention_with_kvcache`, ``k_cache`` and ``v_cache`` sharing no memory with each other
    or with any other argument (ValueError). ``cache_seqlens`` is not changed. Rows whose
    position passes the capacity, rows of pages outside the cache and sequences whose
    ``cache_batch_idx`` lies outside it are skipped, never written."""
    require_arrays({"k_new": k_new, "v_new": v_new, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens})
    ctx, a = boundary.import_arrays(
        k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
        cache_batch_idx=cache_batch_idx,
    )
    validation.check_rank("k_new", a["k_new"], 4, _NEW)
    validation.check_dtype("k_new", a["k_new"], _DTYPES)
    batch, _, heads_kv, head_dim = a["k_new"].shape
    cache = _check_cache(a, batch, head_dim, dtype_of="k_new")
    _check_new(ctx, a, cache)
    ctx.stage(*a.values())
    _append_only(ctx, a, cache, batch, heads_kv, head_dim)


_NEW = "(batch, seqlen_new, heads_kv, head_dim)"


def _ptr(x) -> int:
    return 0 if x is None else x.ptr


def _strides(x) -> tuple:
    return (0, 0, 0) if x is None else x.strides[:3]


def _launch_append(ctx, c_type: str, a: dict, p: np.void, rows: int) -> None:
    variant = plan.append_variant(c_type, a["block_table"] is not None)
    ctx.launch(variant, plan.append_grid(rows), (variant.threads, 1, 1), p)


def _append_params(a: dict, cache: dict, batch: int, heads_kv: int, head_dim: int) -> np.void:
    """DecodeParams with what append_kv.cu reads."""
    p = params.new(params.DECODE_PARAMS)
    p["k"], p["v"], p["k_new"], p["v_new"] = a["k_cache"].ptr, a["v_cache"].ptr, a["k_new"].ptr, a["v_new"].ptr
    p["cache_seqlens"] = a["cache_seqlens"].ptr
    p["block_table"], p["cache_batch_idx"] = _ptr(a["block_table"]), _ptr(a["cache_batch_idx"])
    p["k_strides"], p["v_strides"] = a["k_cache"].strides[:3], a["v_cache"].strides[:3]
    p["k_new_strides"], p["v_new_strides"] = a["k_new"].strides[:3], a["v_new"].strides[:3]
    p["block_table_stride"] = 0 if a["block_table"] is None else a["block_table"].strides[0]
    p["batch"], p["seqlen_new"], p["heads_kv"], p["head_dim"] = batch, cache["seqlen_new"], heads_kv, head_dim
    p["capacity"], p["cache_rows"], p["page_size"] = cache["capacity"], a["k_cache"].shape[0], cache["page_size"]
    return p


def _append_only(ctx, a: dict, cache: dict, batch: int, heads_kv: int, head_dim: int) -> None:
    if not (batch and cache["seqlen_new"] and heads_kv):
        return
    with ctx.device, ctx.stream:
        _launch_append(ctx, validation.check_dtype("k_new", a["k_new"], _DTYPES), a, _append_params(a, cache, batch, heads_kv, head_dim),
                       batch * cache["seqlen_new"] * heads_kv)


def _check_q(a: dict) -> None:
    validation.check_rank("q", a["q"], 4, _Q)
    validation.check_dtype("q", a["q"], _DTYPES)
    head_dim = a["q"].shape[3]
    if head_dim % 8 or not 8 <= head_dim <= 256:
        raise ValueError(f"head_dim {head_dim} is not supported: use a multiple of 8 from 8 to 256")
    if a["out"] is not None:
        validation.check_shape("out", a["out"], a["q"].shape, "(the shape of q)")
        validation.check_same_dtype("out", a["out"], "q", a["q"])


def _check_cache(a: dict, batch: int, head_dim: int, dtype_of: str = "q") -> dict:
    """The cache and its index arrays against ``batch`` sequences of ``head_dim``; host index
    values. Returns the cache's capacity (keys per sequence) and page size."""
    k, v = a["k_cache"], a["v_cache"]
    validation.check_rank("k_cache", k, 4, _CACHE)
    validation.check_same_dtype("k_cache", k, dtype_of, a[dtype_of])
    validation.check_same_dtype("v_cache", v, dtype_of, a[dtype_of])
    validation.check_shape("v_cache", v, k.shape, "(the shape of k_cache)")
    rows, positions, heads_kv = k.shape[0], k.shape[1], k.shape[2]
    if head_dim % 8 or not 8 <= head_dim <= 256:  # 16-byte rows: the kernels copy whole chunks
        raise ValueError(f"head_dim {head_dim} is not supported: use a multiple of 8 from 8 to 256")
    if rows == 0 and batch:
        raise ValueError("k_cache holds no rows (pages) for the sequences to use")
    if rows >= 2**31:  # int32 cache rows and block-table entries
        raise ValueError(f"k_cache holds {rows} rows (pages); at most 2**31 - 1 are supported")
    if k.shape[3] != head_dim:
        raise ValueError(f"k_cache has head_dim {k.shape[3]} but {dtype_of} has {head_dim}")
    if "q" in a and (heads_kv == 0 or a["q"].shape[2] % heads_kv):
        raise ValueError(f"heads_q ({a['q'].shape[2]}, from q) must be a multiple of heads_kv ({heads_kv}, from k_cache)")
    _check_index("cache_seqlens", a["cache_seqlens"], (batch,), "(batch,) int32")
    table, idx = a["block_table"], a["cache_batch_idx"]
    if table is not None:
        if idx is not None:
            raise ValueError("cache_batch_idx is for contiguous caches; a paged cache is addressed by block_table")
        validation.check_rank("block_table", table, 2, "(batch, max_pages) int32")
        _check_index("block_table", table, (batch, table.shape[1]), "(batch, max_pages) int32")
        capacity, page_size = table.shape[1] * positions, positions
        if positions == 0:
            raise ValueError("k_cache has pages of 0 positions")
        _host_range("block_table", table, 0, rows - 1)
    else:
        capacity, page_size = positions, 1
        if idx is not None:
            _check_index("cache_batch_idx", idx, (batch,), "(batch,) int32")
            _host_range("cache_batch_idx", idx, 0, rows - 1)
        elif rows != batch:
            raise ValueError(f"k_cache holds {rows} sequences but {dtype_of} {batch}; pass cache_batch_idx to pick rows of a larger cache")
    if capacity > MAX_PACKED_ROWS:  # the chunked prefill's tiled forward takes it as seqlen_k
        raise ValueError(f"a cache of {capacity} positions per sequence is not supported (at most 2**31 - 256)")
    _host_range("cache_seqlens", a["cache_seqlens"], 0, capacity)
    for name in ("k_new", "v_new"):  # ranked before their strides are read
        if a.get(name) is not None:
            validation.check_rank(name, a[name], 4, _NEW)
    for name in ("q", "k_cache", "v_cache", "out", "k_new", "v_new"):
        x = a.get(name)
        if x is None:
            continue
        validation.check_unit_last_stride(name, x)
        if x.size and x.ptr is not None and not validation.aligned([x.ptr], x.strides[:3], x.dtype.itemsize, 8, 8):
            raise ValueError(f"{name} strides {x.strides} (elements) or its address are not multiples of 8 elements / 16 bytes; make it contiguous")
    return {"capacity": capacity, "page_size": page_size, "seqlen_new": 0}


def _check_new(ctx, a: dict, cache: dict) -> None:
    """k_new / v_new, both or neither, shaped (batch, seqlen_new, heads_kv, head_dim) like the
    cache, on the device (the cache is written in place, so its lengths are device arrays too:
    rows past the capacity are skipped there). Sets cache["seqlen_new"]."""
    k_new, v_new = a["k_new"], a["v_new"]
    if (k_new is None) != (v_new is None):
        raise TypeError("k_new and v_new go together: pass both or neither")
    if k_new is None:
        return
    ctx.check_writes("k_cache and v_cache are", a["k_cache"], a["v_cache"])
    k = a["k_cache"]
    batch = a["cache_seqlens"].shape[0]  # k_new / v_new were ranked by _check_cache
    validation.check_same_dtype("k_new", k_new, "k_cache", k)
    validation.check_same_dtype("v_new", v_new, "k_cache", k)
    if k_new.shape[0] != batch or k_new.shape[2:] != k.shape[2:]:
        raise ValueError(f"k_new has shape {k_new.shape}; expected (batch={batch}, seqlen_new, heads_kv={k.shape[2]}, head_dim={k.shape[3]})")
    validation.check_shape("v_new", v_new, k_new.shape, "(the shape of k_new)")
    if k_new.shape[1] > cache["capacity"]:
        raise ValueError(f"k_new has {k_new.shape[1]} new rows per sequence but the cache holds at most {cache['capacity']} positions per sequence")
    for name in ("k_cache", "v_cache"):  # written: apart from each other and from everything the call reads
        validation.check_writable_output(name, a[name], {n: x for n, x in a.items() if n != name and n != "out"})
    cache["seqlen_new"] = k_new.shape[1]


def _check_index(name: str, x, shape: tuple, layout: str) -> None:
    validation.check_rank(name, x, len(shape), layout)
    if x.dtype != np.int32:
        raise ValueError(f"{name} must be int32, got {validation.dtype_name(x.dtype)}")
    validation.check_shape(name, x, shape, layout)
    validation.check_unit_last_stride(name, x)


def _host_range(name: str, x, low: int, high: int) -> None:
    """NumPy index values are checked here; device ones are clamped by the kernels."""
    if x.ptr is not None or x.size == 0:
        return
    values = np.asarray(x.native)
    bad = (values < low) | (values > high)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}{list(at)} is {int(values[at])}, outside [{low}, {high}]")


def check_num_splits(num_splits) -> int | None:
    if num_splits is None:
        return None
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be an int (or None), got {type(num_splits).__name__} {num_splits!r}")
    if not 1 <= num_splits <= plan.MAX_SPLITS:
        raise ValueError(f"num_splits must be from 1 to {plan.MAX_SPLITS}, got {num_splits}")
    return int(num_splits)
