"""Merging partial attention results computed over disjoint key sets."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cuattn import boundary, loader, params, replay, validation
from cuattn.attention import require_arrays
from cuattn.kernels import merge as merge_plan

_OUT_LAYOUT = "(batch, seqlen, heads, head_dim)"
_LSE_LAYOUT = "(batch, heads, seqlen)"


def merge(outs, lses):
    """Combine partial attention results over disjoint key sets into the result over their union.

    For partials ``(out_i, lse_i)`` of the same queries::

        lse = log(sum_i exp(lse_i))
        out = sum_i exp(lse_i - lse) * out_i

    Parameters
    ----------
    outs : sequence of N arrays ``(batch, seqlen, heads, head_dim)``, or one array
        ``(N, batch, seqlen, heads, head_dim)``; float16, bfloat16 or float32, all one dtype.
    lses : the matching log-sum-exps: N arrays ``(batch, heads, seqlen)`` or one
        ``(N, batch, heads, seqlen)``, float32 (natural log).

    Returns
    -------
    (out, lse) : ``out`` like one partial (its dtype), ``lse`` ``(batch, heads, seqlen)`` float32,
        as arrays of the caller's framework. Arithmetic is fp32. A partial with ``lse = -inf``
        (it saw no key) contributes nothing, whatever its ``out`` holds (NaN included); rows where every partial
        is ``-inf`` get ``out = 0`` and ``lse = -inf``. A partial of ``lse = +inf`` (overflowed
        scores) makes its row ``out`` NaN and ``lse = +inf``; one of ``lse`` NaN makes both NaN
        (never a row that looks empty). More than 16 partials are merged 16 at a
        time into float32 scratch, whose results are merged in turn: ``out`` is rounded once.
    """
    if type(outs) in (list, tuple) and type(lses) in (list, tuple):
        result = replay.run("merge", lambda: merge(outs, lses), (*outs, *lses), (len(outs), len(lses)))
    else:
        result = replay.run("merge", lambda: merge(outs, lses), (outs, lses), (-1, -1))
    if result is not replay.MISS:
        return result
    stacked = not isinstance(outs, Sequence)
    if stacked != (not isinstance(lses, Sequence)):
        raise TypeError("outs and lses must both be sequences of arrays or both be stacked arrays")
    names = {"outs": outs, "lses": lses} if stacked else {
        **{f"outs[{i}]": o for i, o in enumerate(outs)}, **{f"lses[{i}]": l for i, l in enumerate(lses)}
    }
    if not stacked and (len(outs) == 0 or len(outs) != len(lses)):
        raise ValueError(f"outs and lses must be non-empty and of equal length, got {len(outs)} and {len(lses)}")
    require_arrays(names)
    ctx, arrays = boundary.import_arrays(**names)
    count = None if stacked else len(outs)
    out_names, part_outs, lse_names, part_lses = _partials(arrays, count)
    batch, seqlen, heads, head_dim = _check_partials(out_names, part_outs, lse_names, part_lses)
    ctx.stage(*arrays.values())
    _, part_outs, _, part_lses = _partials(arrays, count)

    dst = ctx.empty((batch, seqlen, heads, head_dim), part_outs[0].dtype)
    dst_lse = ctx.empty((batch, heads, seqlen), np.float32)
    if dst.size or dst_lse.size:
        _launch(ctx, part_outs, part_lses, dst, dst_lse)
    return ctx.export(dst), ctx.export(dst_lse)


def merge_(out, lse, out_b, lse_b):
    """In-place two-way merge: ``(out, lse) <- merge([out, out_b], [lse, lse_b])``.

    For loops that accumulate partial results (KV chunks, ring steps). Shapes and dtypes as in
    :func:`merge`; ``out`` and ``lse`` are overwritten and returned, and must share no memory
    with each other or with ``out_b`` / ``lse_b`` (ValueError). Not for JAX or NumPy arrays,
    which cannot be updated in place.
    """
    result = replay.run("merge_", lambda: merge_(out, lse, out_b, lse_b), (out, lse, out_b, lse_b), (), written=((0, None), (1, None)))
    if result is not replay.MISS:
        return result
    require_arrays({"out": out, "lse": lse, "out_b": out_b, "lse_b": lse_b})
    ctx, a = boundary.import_arrays(out=out, lse=lse, out_b=out_b, lse_b=lse_b)
    if ctx.framework in (boundary.JAX, boundary.NUMPY):
        raise TypeError(f"merge_ updates out and lse in place, which {ctx.framework} arrays cannot be; use merge")
    ctx.check_writes("out and lse are", a["out"], a["lse"])
    _check_partials(["out", "out_b"], [a["out"], a["out_b"]], ["lse", "lse_b"], [a["lse"], a["lse_b"]])
    for name in ("out", "lse"):  # rows are read by other warps than write them: no view may shift onto another
        validation.check_writable_output(name, a[name], {n: x for n, x in a.items() if n != name})
    if a["out"].size or a["lse"].size:
        _launch(ctx, [a["out"], a["out_b"]], [a["lse"], a["lse_b"]], a["out"], a["lse"])
    return out, lse


def _partials(arrays: dict, count: int | None):
    """Names and per-partial arrays of merge's arguments: ``count`` listed partials, or the
    slices of the stacked ``outs`` / ``lses`` when count is None."""
    if count is not None:
        out_names, lse_names = [f"outs[{i}]" for i in range(count)], [f"lses[{i}]" for i in range(count)]
        return out_names, [arrays[n] for n in out_names], lse_names, [arrays[n] for n in lse_names]
    outs, lses = _unstack("outs", arrays["outs"], 5), _unstack("lses", arrays["lses"], 4)
    if len(outs) != len(lses):
        raise ValueError(f"outs holds {len(outs)} partials but lses holds {len(lses)}")
    if not outs:
        raise ValueError("outs holds no partials")
    return ["outs"] * len(outs), outs, ["lses"] * len(lses), lses


def _unstack(name: str, a: boundary.DeviceArray, ndim: int) -> list[boundary.DeviceArray]:
    validation.check_rank(name, a, ndim, "(N, ...) for stacked partials")
    return _slices(a)


def _slices(a: boundary.DeviceArray) -> list[boundary.DeviceArray]:
    """``a[0], a[1], ...`` as device views."""
    step = a.strides[0] * a.dtype.itemsize
    return [
        boundary.DeviceArray(None if a.ptr is None else a.ptr + i * step, a.shape[1:], a.strides[1:], a.dtype, a.native)
        for i in range(a.shape[0])
    ]


def _check_partials(out_names, outs, lse_names, lses) -> tuple[int, int, int, int]:
    for name, o in zip(out_names, outs):
        validation.check_rank(name, o, 4, _OUT_LAYOUT)
        validation.check_dtype(name, o)
        validation.check_same_dtype(name, o, out_names[0], outs[0])
        validation.check_shape(name, o, outs[0].shape, _OUT_LAYOUT)
        validation.check_unit_last_stride(name, o)
    batch, seqlen, heads, head_dim = outs[0].shape
    for name, l in zip(lse_names, lses):
        validation.check_rank(name, l, 3, _LSE_LAYOUT)
        validation.check_float32(name, l)
        validation.check_shape(name, l, (batch, heads, seqlen), _LSE_LAYOUT)
    return batch, seqlen, heads, head_dim


def _launch(ctx, outs, lses, dst, dst_lse) -> None:
    """Merges the partials into (dst, dst_lse). More than MAX_MERGE_PARTIALS are merged in
    groups into float32 results, which are merged again (in groups while there are too many),
    so ``dst`` is rounded once. Every scratch array is allocated before the first launch."""
    batch, seqlen, heads, head_dim = dst.shape
    levels = []  # per level of groups: (stacked float32 outs, stacked lses)
    count = len(outs)
    while count > params.MAX_MERGE_PARTIALS:
        count = -(-count // params.MAX_MERGE_PARTIALS)
        levels.append((ctx.empty((count, batch, seqlen, heads, head_dim), np.float32), ctx.empty((count, batch, heads, seqlen), np.float32)))
    with ctx.device, ctx.stream:
        sms = loader.device_sm_count(ctx.device.id)
        parts = list(zip(outs, lses))
        for group_outs, group_lses in levels:
            results = list(zip(_slices(group_outs), _slices(group_lses)))
            for i, (out, lse) in enumerate(results):
                group = parts[i * params.MAX_MERGE_PARTIALS:(i + 1) * params.MAX_MERGE_PARTIALS]
                _launch_group(ctx, group, out, lse, sms, grouped=True)
            parts = results
        _launch_group(ctx, parts, dst, dst_lse, sms, grouped=len(outs) > params.MAX_MERGE_PARTIALS)


def _launch_group(ctx, group, dst, dst_lse, sms: int, grouped: bool) -> None:
    """One launch merging at most MAX_MERGE_PARTIALS partials into dst; ``grouped``: a step of a
    larger merge (its variant takes the largest cap and may change the element type)."""
    c_type = validation.check_dtype("outs", group[0][0])
    out_type = validation.check_dtype("out", dst)
    head_dim = dst.shape[3]
    wide = merge_plan.VEC_WIDTHS[c_type][0]
    outs = [o for o, _ in group]
    vec = wide if validation.aligned(
        [o.ptr for o in outs], [s for o in outs for s in o.strides[:3]], outs[0].dtype.itemsize, wide, head_dim,
    ) and validation.aligned([dst.ptr], dst.strides[:3], dst.dtype.itemsize, wide, head_dim) else 1
    cap = merge_plan.CAPS[-1] if grouped else merge_plan.cap_for(len(group), vec)
    variant = merge_plan.variant(c_type, vec, cap, out_type)
    batch, seqlen, heads, _ = dst.shape
    grid = merge_plan.grid(batch * seqlen * heads, head_dim, vec, merge_plan.rows_per_lane(cap, vec), sms)
    p = params.new(params.MERGE_PARAMS)
    for i, (o, l) in enumerate(group):
        p["outs"][i], p["lses"][i] = o.ptr, l.ptr
        p["out_strides"][i], p["lse_strides"][i] = o.strides[:3], l.strides
    p["dst_out"], p["dst_lse"] = dst.ptr, dst_lse.ptr
    p["dst_out_strides"], p["dst_lse_strides"] = dst.strides[:3], dst_lse.strides
    p["num_partials"] = len(group)
    p["batch"], p["seqlen"], p["heads"], p["head_dim"] = batch, seqlen, heads, head_dim
    ctx.launch(variant, grid, (variant.threads, 1, 1), p)


def sum_rows(ctx, piece, total, out=None, fresh: bool = False) -> None:
    """``total <- (fresh ? 0 : total) + piece`` in fp32, or ``out <- that`` rounded to out's
    dtype (``total`` not written), on the call's stream (merge/sum_partials.cu). Device views
    ``(batch, rows, heads, head_dim)`` whose rows are contiguous (a slice of rows of a contiguous
    array); ``out``'s rows may lie apart (strides ``(any, any, head_dim, 1)``: a slice of a packed
    dqkv). ``piece`` None adds nothing. For schedules that visit the keys in pieces."""
    batch, rows, heads, head_dim = total.shape
    inner = rows * heads * head_dim
    if batch * inner == 0:
        return
    for name, a in (("piece", piece), ("total", total), ("out", out)):
        if a is None:
            continue
        layout = a.strides[2:] == (head_dim, 1) or heads == 1 and a.strides[3] == 1
        if a.shape != total.shape or not layout or name != "out" and a.strides[1] != heads * head_dim:
            raise ValueError(f"sum_rows: {name} must be rows of a contiguous array shaped like total, got {a.shape} {a.strides}")
    c_type = validation.check_dtype("piece", piece if piece is not None else total)
    out_type = c_type if out is None else validation.check_dtype("out", out)
    p = params.pack(
        params.SUM_PARAMS, piece=0 if piece is None else piece.ptr, sum=total.ptr, out=0 if out is None else out.ptr,
        outer=batch, inner=inner, piece_stride=0 if piece is None else piece.strides[0], sum_stride=total.strides[0],
        out_stride=0 if out is None else out.strides[0], out_row_stride=heads * head_dim if out is None or rows == 1 else out.strides[1],
        row_elems=heads * head_dim, fresh=int(fresh),
    )
    variant = merge_plan.sum_variant(c_type, out_type)
    with ctx.device, ctx.stream:
        grid = merge_plan.sum_grid(batch * inner, loader.device_sm_count(ctx.device.id))
        ctx.launch(variant, grid, (variant.threads, 1, 1), p)
