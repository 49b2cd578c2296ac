"""Float64 NumPy reference of cuattn's public math: the oracle of every test.

Same names and signatures as the GPU functions. Attention is computed as online softmax over
chunks of keys (and chunks of queries), so memory stays bounded on long sequences; it runs on
machines without a GPU. Inputs may be any array NumPy can read (host memory).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

QUERY_CHUNK = 256
KEY_CHUNK = 1024


def _f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def diagonal_offset(seqlen_q: int, seqlen_k: int, align: str) -> int:
    """Key column that query row 0 lines up with: bottom-right puts the last query on the last key."""
    if align == "bottom_right":
        return seqlen_k - seqlen_q
    if align == "top_left":
        return 0
    raise ValueError(f"align must be 'bottom_right' or 'top_left', got {align!r}")


def window_bounds(causal: bool, window) -> tuple[int, int]:
    """(left, right) reach of the mask, -1 meaning unbounded; causal caps right at 0."""
    left, right = -1, -1
    if window is not None:
        left, right = (-1 if w is None else int(w) for w in window)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def visible(rows: np.ndarray, cols: np.ndarray, offset: int, left: int, right: int, sink_tokens: int = 0) -> np.ndarray:
    """Boolean (len(rows), len(cols)): query row i sees key j when
    i + offset - left <= j <= i + offset + right (a bound of -1 is unbounded); keys
    j < sink_tokens are exempt from the left bound."""
    diag = rows[:, None] + offset
    ok = np.ones((len(rows), len(cols)), dtype=bool)
    if left >= 0:
        ok &= (cols[None, :] >= diag - left) | (cols[None, :] < sink_tokens)
    if right >= 0:
        ok &= cols[None, :] <= diag + right
    return ok


def _scores(qc, kc, scale, softcap):
    """Scaled (and soft-capped) scores of a query chunk against a key chunk: (h, m, n)."""
    s = np.einsum("mhd,nhd->hmn", qc, kc) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    return s


def _expand_kv(x: np.ndarray, heads_q: int) -> np.ndarray:
    return np.repeat(x, heads_q // x.shape[2], axis=2)


_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_U32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox4x32-10 (Salmon et al., SC'11): ``counter`` (..., 4) and ``key`` (2,) of uint32
    words to (..., 4) uint32, as common/dropout.cuh computes it."""
    c = [np.asarray(counter, dtype=np.uint64)[..., i] for i in range(4)]
    k0, k1 = (int(w) & 0xFFFFFFFF for w in key)
    for _ in range(10):
        p0, p1 = _PHILOX_M[0] * c[0], _PHILOX_M[1] * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & _U32, (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p0 & _U32]
        k0, k1 = (k0 + _PHILOX_W[0]) & 0xFFFFFFFF, (k1 + _PHILOX_W[1]) & 0xFFFFFFFF
    return np.stack(c, axis=-1).astype(np.uint32)


def dropout_threshold(dropout_p: float) -> int:
    """The 8-bit threshold of a dropout probability: an element is kept when its draw is at
    least this (``round(256 p)``, at most 255)."""
    return min(int(round(float(dropout_p) * 256)), 255)


def dropout_kept_fraction(dropout_p: float) -> float:
    """The fraction of probabilities that dropout keeps, ``1 - threshold / 256``; kept ones are
    divided by it."""
    return 1.0 - dropout_threshold(dropout_p) / 256


def dropout_keep(heads_q: int, seq: int, rows, cols, dropout_p: float, seed: int) -> np.ndarray:
    """Boolean ``(heads_q, len(rows), len(cols))``: which probabilities of sequence ``seq``
    survive dropout (common/dropout.cuh): element (i, j) of head h draws byte
    ``8 * bit3(i) + 4 * bit0(i) + 2 * bit3(j) + bit0(j)`` of Philox4x32-10 with counter
    ``(j & ~9, i & ~9, seq * heads_q + h, 0)`` and key ``seed`` (low word first; byte w is byte
    w % 4 of output w // 4, low byte first), and is kept when the byte is at least
    :func:`dropout_threshold`."""
    rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    heads = np.arange(heads_q, dtype=np.int64)
    counter = np.zeros((heads_q, len(rows), len(cols), 4), dtype=np.uint64)
    counter[..., 0] = (cols & ~9)[None, None, :]
    counter[..., 1] = (rows & ~9)[None, :, None]
    counter[..., 2] = (seq * heads_q + heads)[:, None, None]
    seed = _seed_int(seed)
    draws = philox4x32_10(counter, (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))
    byte = ((rows >> 3) & 1)[:, None] * 8 + (rows & 1)[:, None] * 4 + ((cols >> 3) & 1)[None, :] * 2 + (cols & 1)[None, :]
    word = np.take_along_axis(draws, np.broadcast_to((byte // 4)[None, ..., None], (heads_q, *byte.shape, 1)), axis=-1)[..., 0]
    value = (word >> (8 * (byte % 4))[None].astype(np.uint32)) & np.uint32(0xFF)
    return value >= dropout_threshold(dropout_p)


def _seed_int(seed) -> int:
    """A dropout seed as an int: an int, or the arrays the kernels read (``(2,)`` uint32, low
    word first, or ``(1,)`` int64 / uint64; any framework's, copied to the host)."""
    if isinstance(seed, (int, np.integer)):
        return int(seed)
    words = np.ascontiguousarray(_host_array(seed)).reshape(-1)
    return int(words.view("<u8")[0]) if words.nbytes == 8 else int(seed)


def _dropout_weights(heads_q, seq, rows, cols, dropout_p, seed):
    """Kept elements times the kept fraction's inverse, zeros elsewhere (None without dropout)."""
    if not dropout_p:
        return None
    return dropout_keep(heads_q, seq, rows, cols, dropout_p, seed) / dropout_kept_fraction(dropout_p)


def attention(q, k, v, *, causal=False, window=None, align="bottom_right", scale=None, softcap=None, sink=None, sink_tokens=0,
              dropout_p=0.0, dropout_seed=None, block_mask=None, return_lse=False, out=None, first_sequence=0):
    """Reference attention; see :func:`cuattn.attention`. Returns float64 ``out`` (and ``lse``,
    which dropout does not change: it applies to the normalized probabilities).
    ``first_sequence``: the sequence index of batch entry 0 in dropout's draws (the varlen
    reference passes each packed sequence's). ``block_mask``: a BlockMask (arrays of any
    framework) or its dense bool form ``(B, H, q_blocks, k_blocks)``."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    offset = diagonal_offset(seqlen_q, seqlen_k, align)
    left, right = window_bounds(causal, window)
    keep_blocks = _keep_blocks(block_mask, batch, heads_q, seqlen_q, seqlen_k)
    result = np.zeros((batch, seqlen_q, heads_q, v.shape[3]))
    lse = np.full((batch, heads_q, seqlen_q), -np.inf)
    for b in range(batch):
        kb, vb = _expand_kv(k[b:b + 1], heads_q)[0], _expand_kv(v[b:b + 1], heads_q)[0]
        for m0 in range(0, seqlen_q, QUERY_CHUNK):
            rows = np.arange(m0, min(m0 + QUERY_CHUNK, seqlen_q))
            row_max = np.full((heads_q, len(rows)), -np.inf)
            denom = np.zeros((heads_q, len(rows)))
            acc = np.zeros((heads_q, len(rows), v.shape[3]))
            for n0 in range(0, seqlen_k, KEY_CHUNK):
                cols = np.arange(n0, min(n0 + KEY_CHUNK, seqlen_k))
                s = _scores(q[b, rows], kb[cols], scale, softcap)
                s = np.where(visible(rows, cols, offset, left, right, sink_tokens)[None] & _kept(keep_blocks, b, rows, cols), s, -np.inf)
                new_max = np.maximum(row_max, s.max(axis=2))
                safe = np.where(np.isfinite(new_max), new_max, 0.0)
                rescale = np.exp(row_max - safe)  # online softmax: old terms move to the new max
                p = np.exp(s - safe[..., None])
                denom = denom * rescale + p.sum(axis=2)
                z = _dropout_weights(heads_q, first_sequence + b, rows, cols, dropout_p, dropout_seed)
                acc = acc * rescale[..., None] + np.einsum("hmn,nhd->hmd", p if z is None else p * z, vb[cols])
                row_max = new_max
            # A NaN or +inf score makes denom NaN or +inf: that row's out and lse are NaN (as the kernels'
            # and as merge's rule carries them).
            seen, undefined = denom > 0, ~np.isfinite(denom)
            seen &= ~undefined
            empty = np.where(undefined, np.nan, 0.0)
            result[b, rows] = np.where(seen[..., None], acc / np.where(seen, denom, 1.0)[..., None], empty[..., None]).transpose(1, 0, 2)
            lse[b, :, rows] = np.where(seen, row_max + np.log(np.where(seen, denom, 1.0)), np.where(undefined, np.nan, -np.inf)).T
    if sink is not None:
        result, lse = with_sink(result, lse, sink)
    if out is not None:
        np.copyto(out, result.astype(out.dtype))
    return (result, lse) if return_lse else result


def _keep_blocks(block_mask, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int):
    """The dense bool (B, H, q_blocks, k_blocks) form of a block mask, or None; a ValueError
    for a mask that is malformed or not of the call's lengths, batch and heads (as the kernels'
    callers raise: this oracle must not read a mask its kernels refuse)."""
    if block_mask is None:
        return None
    from cuattn import block_mask as bm

    if isinstance(block_mask, bm.BlockMask):
        bm.check_lengths(block_mask, seqlen_q, seqlen_k)
        hosts = {name: _host_array(getattr(block_mask, name)) for name in bm.ARRAY_FIELDS}
        mask = dataclasses.replace(block_mask, **hosts, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        bm.check_shapes(mask, batch, heads_q)
        mask.check()
        return mask.to_dense()
    keep = np.asarray(block_mask, dtype=bool)
    if keep.ndim != 4 or keep.shape[0] not in (1, batch) or keep.shape[1] not in (1, heads_q) or keep.shape[2:] != (
            bm.blocks(seqlen_q), bm.blocks(seqlen_k)):
        raise ValueError(f"block_mask has shape {keep.shape}; expected (1 or {batch}, 1 or {heads_q}, {bm.blocks(seqlen_q)}, "
                         f"{bm.blocks(seqlen_k)})")
    return keep


def _host_array(x) -> np.ndarray:
    from cuattn.block_mask import _host

    return _host(x)


def _kept(keep_blocks, b: int, rows: np.ndarray, cols: np.ndarray):
    """(H or 1, len(rows), len(cols)): the elements a block mask keeps for batch entry b."""
    if keep_blocks is None:
        return np.ones((1, 1, 1), dtype=bool)
    from cuattn.block_mask import BLOCK_SIZE

    entry = keep_blocks[b if keep_blocks.shape[0] > 1 else 0]
    return entry[:, rows // BLOCK_SIZE][:, :, cols // BLOCK_SIZE]


def with_sink(out, lse, sink):
    """``(out, lse)`` of attention whose softmax denominators also hold ``exp(sink[h])``: the
    sink is a partial result over no key with ``lse = sink[h]`` and ``out = 0``, merged in."""
    sink = _f64(sink)[None, :, None]
    total = np.logaddexp(lse, sink)
    weight = np.where(np.isfinite(lse), np.exp(lse - total), 0.0)  # (batch, heads, seqlen)
    return out * weight.transpose(0, 2, 1)[..., None], total


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False, window=None,
                     align="bottom_right", scale=None, softcap=None, sink=None, dropout_p=0.0, dropout_seed=None, return_lse=False,
                     out=None):
    """Reference of :func:`cuattn.attention_varlen`, with its signature: every packed sequence
    through :func:`attention` alone. Returns float64 ``out`` ``(total_q, heads_q, head_dim)``
    (and ``lse`` ``(heads_q, total_q)``); ``max_seqlen_*`` and ``out`` change nothing here (a
    new array is returned)."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    cu_q, cu_k = (np.asarray(c, dtype=np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = attention(q[None, rows], k[None, keys], v[None, keys], causal=causal, window=window, align=align, scale=scale,
                         softcap=softcap, sink=sink, dropout_p=dropout_p, dropout_seed=dropout_seed, return_lse=True, first_sequence=b)
        out[rows], lse[:, rows] = o[0], l[0]
    return (out, lse) if return_lse else out


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, block_table=None, cache_batch_idx=None, k_new=None, v_new=None,
                           causal=True, window=None, scale=None, softcap=None, sink=None, num_splits=None, return_lse=False, out=None):
    """Reference of :func:`cuattn.attention_with_kvcache`: ``k_new`` / ``v_new`` appended to
    copies of the caches (:func:`append_kv`; the arguments are not changed), each sequence's
    cached keys gathered (rows of a contiguous cache, or pages through the block table), then
    :func:`attention` bottom-right aligned. ``num_splits`` and ``out`` change nothing here.
    Returns float64 ``out`` (and ``lse``)."""
    q = _f64(q)
    lengths = np.asarray(cache_seqlens, dtype=np.int64)
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new are given together")
    if k_new is not None:
        k_cache, v_cache = np.array(k_cache), np.array(v_cache)
        append_kv(k_new, v_new, k_cache, v_cache, cache_seqlens=lengths, block_table=block_table, cache_batch_idx=cache_batch_idx)
        lengths = lengths + np.asarray(k_new).shape[1]
    out = np.zeros(q.shape)
    lse = np.full((q.shape[0], q.shape[2], q.shape[1]), -np.inf)
    for b in range(q.shape[0]):
        if block_table is None:
            row = b if cache_batch_idx is None else int(cache_batch_idx[b])
            keys, values = k_cache[row, :lengths[b]], v_cache[row, :lengths[b]]
        else:
            pages = np.asarray(block_table[b], dtype=np.int64)
            keys = np.concatenate(list(k_cache[pages]))[:lengths[b]]
            values = np.concatenate(list(v_cache[pages]))[:lengths[b]]
        o, l = attention(q[b:b + 1], keys[None], values[None], causal=causal, window=window, scale=scale, softcap=softcap, sink=sink,
                         return_lse=True)
        out[b], lse[b] = o[0], l[0]
    return (out, lse) if return_lse else out


def append_kv(k_new, v_new, k_cache, v_cache, *, cache_seqlens, block_table=None, cache_batch_idx=None) -> None:
    """Reference of :func:`cuattn.append_kv`, on NumPy caches in place: row ``t`` of sequence
    ``b`` at position ``cache_seqlens[b] + t`` of its cache row or pages; positions past the
    capacity, pages and rows outside the cache are skipped, as the kernel skips them."""
    k_new, v_new = np.asarray(k_new), np.asarray(v_new)
    rows, page_size = k_cache.shape[0], k_cache.shape[1]
    for b in range(k_new.shape[0]):
        for t in range(k_new.shape[1]):
            pos = int(cache_seqlens[b]) + t
            if block_table is None:
                row = b if cache_batch_idx is None else int(cache_batch_idx[b])
                if pos < page_size and 0 <= row < rows:
                    k_cache[row, pos], v_cache[row, pos] = k_new[b, t], v_new[b, t]
            elif pos < np.shape(block_table)[1] * page_size and 0 <= int(block_table[b][pos // page_size]) < rows:
                page = int(block_table[b][pos // page_size])
                k_cache[page, pos % page_size], v_cache[page, pos % page_size] = k_new[b, t], v_new[b, t]


def attention_backward(dout, q, k, v, out, lse, *, causal=False, window=None, align="bottom_right", scale=None, softcap=None, sink=None,
                       sink_tokens=0, dropout_p=0.0, dropout_seed=None, block_mask=None, dlse=None, deterministic=False, dq=None, dk=None,
                       dv=None, first_sequence=0):
    """Reference gradients ``(dq, dk, dv)`` of :func:`attention`, from the saved ``lse``
    (with ``sink``, ``(dq, dk, dv, dsink)``).

    ``dlse`` is the gradient flowing into ``lse``; since d lse / d s = softmax(s), it adds
    ``dlse * p`` to the score gradient. A sink is one more score with no value:
    ``dsink[h] = sum over h's rows of p_sink * (dlse - rowsum(dout * out))``, ``p_sink =
    exp(sink[h] - lse)``. ``deterministic`` and ``dq`` / ``dk`` / ``dv`` (arrays to write
    into) are accepted for signature parity; new arrays are returned.
    """
    dout, q, k, v, out, lse = map(_f64, (dout, q, k, v, out, lse))
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    offset = diagonal_offset(seqlen_q, seqlen_k, align)
    left, right = window_bounds(causal, window)
    dlse = np.zeros_like(lse) if dlse is None else _f64(dlse)
    keep_blocks = _keep_blocks(block_mask, batch, heads_q, seqlen_q, seqlen_k)
    delta = np.einsum("bshd,bshd->bhs", dout, out)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(batch):
        kb, vb = _expand_kv(k[b:b + 1], heads_q)[0], _expand_kv(v[b:b + 1], heads_q)[0]
        dkb, dvb = np.zeros_like(kb), np.zeros_like(vb)
        for m0 in range(0, seqlen_q, QUERY_CHUNK):
            rows = np.arange(m0, min(m0 + QUERY_CHUNK, seqlen_q))
            for n0 in range(0, seqlen_k, KEY_CHUNK):
                cols = np.arange(n0, min(n0 + KEY_CHUNK, seqlen_k))
                raw = np.einsum("mhd,nhd->hmn", q[b, rows], kb[cols]) * scale
                s = softcap * np.tanh(raw / softcap) if softcap else raw
                mask = visible(rows, cols, offset, left, right, sink_tokens)[None] & _kept(keep_blocks, b, rows, cols)
                row_lse = lse[b][:, rows][..., None]
                p = np.where(mask & np.isfinite(row_lse), np.exp(s - np.where(np.isfinite(row_lse), row_lse, 0.0)), 0.0)
                dp = np.einsum("mhd,nhd->hmn", dout[b, rows], vb[cols])
                z = _dropout_weights(heads_q, first_sequence + b, rows, cols, dropout_p, dropout_seed)
                if z is not None:  # out used p * z: so do dV and the score gradient
                    dp = dp * z
                ds = p * (dp - delta[b][:, rows][..., None] + dlse[b][:, rows][..., None])
                if softcap:
                    ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
                ds = ds * scale
                dq[b, rows] += np.einsum("hmn,nhd->mhd", ds, kb[cols])
                dkb[cols] += np.einsum("hmn,mhd->nhd", ds, q[b, rows])
                dvb[cols] += np.einsum("hmn,mhd->nhd", p if z is None else p * z, dout[b, rows])
        dk[b] = dkb.reshape(seqlen_k, heads_kv, group, head_dim).sum(axis=2)
        dv[b] = dvb.reshape(seqlen_k, heads_kv, group, v.shape[3]).sum(axis=2)
    if sink is None:
        return dq, dk, dv
    # A row that sees no key has lse = sink: its p_sink is 1, also in the limit of a sink of -inf
    # (whose lse is -inf too: exp(-inf - -inf) would be NaN).
    p_sink = np.where(np.isneginf(lse), 1.0, np.exp(_f64(sink)[None, :, None] - lse))
    return dq, dk, dv, (p_sink * (dlse - delta)).sum(axis=(0, 2))


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                              causal=False, window=None, align="bottom_right", scale=None, softcap=None, sink=None, dropout_p=0.0,
                              dropout_seed=None, dlse=None, deterministic=False, dq=None, dk=None, dv=None):
    """Reference gradients ``(dq, dk, dv)`` of :func:`attention_varlen` (with ``sink``, and
    ``dsink`` summed over the sequences), with its signature: every packed sequence through
    :func:`attention_backward` alone. ``lse`` and ``dlse`` are ``(heads_q, total_q)``;
    ``dq`` / ``dk`` / ``dv`` are accepted for signature parity (new arrays are returned)."""
    dout, q, k, v, out, lse = map(_f64, (dout, q, k, v, out, lse))
    dlse = None if dlse is None else _f64(dlse)
    cu_q, cu_k = (np.asarray(c, dtype=np.int64) for c in (cu_seqlens_q, cu_seqlens_k))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsink = None if sink is None else np.zeros(np.shape(sink))
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        grads = attention_backward(
            dout[None, rows], q[None, rows], k[None, keys], v[None, keys], out[None, rows], lse[None, :, rows],
            causal=causal, window=window, align=align, scale=scale, softcap=softcap, sink=sink, dropout_p=dropout_p,
            dropout_seed=dropout_seed, dlse=None if dlse is None else dlse[None, :, rows], first_sequence=b,
        )
        dq[rows], dk[keys], dv[keys] = (g[0] for g in grads[:3])
        if sink is not None:
            dsink += grads[3]
    return (dq, dk, dv) if sink is None else (dq, dk, dv, dsink)


def merge(outs, lses):
    """Reference :func:`cuattn.merge`: float64 ``(out, lse)``."""
    outs = np.stack([_f64(o) for o in outs]) if isinstance(outs, (list, tuple)) else _f64(outs)
    lses = np.stack([_f64(l) for l in lses]) if isinstance(lses, (list, tuple)) else _f64(lses)
    lse_max = lses.max(axis=0)
    shift = np.where(np.isfinite(lse_max), lse_max, 0.0)
    weights = np.exp(lses - shift)  # (N, b, h, s); exp(-inf) = 0 for empty partials
    total = weights.sum(axis=0)
    lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    w = np.where(total > 0, weights / np.where(total > 0, total, 1.0), 0.0)
    safe_outs = np.where(np.isfinite(lses).transpose(0, 1, 3, 2)[..., None], outs, 0.0)
    out = np.einsum("nbhs,nbshd->bshd", w, safe_outs)
    undefined = np.isnan(lses).any(axis=0)  # a partial of lse NaN: the merged row is NaN
    lse = np.where(undefined, np.nan, lse)
    out = np.where(undefined.transpose(0, 2, 1)[..., None], np.nan, out)
    return out, lse
