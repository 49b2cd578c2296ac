"""PyTorch adapter: cuattn's ops as ``torch.library`` custom ops with autograd.

They work eagerly, under ``torch.compile(fullgraph=True)`` and pass ``torch.library.opcheck``;
kernels run on PyTorch's current stream and outputs come from its caching allocator. Every entry
of :data:`cuattn.ops.OPS` is registered the same way (``torch.ops.cuattn.<name>``). Importing
:mod:`cuattn` does not import torch; importing this module does.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from cuattn import ops, replay, requirements, validation
from cuattn.attention import attention as core_attention
from cuattn.backward import attention_backward as core_attention_backward
from cuattn.block_mask import ARRAY_FIELDS as BLOCK_MASK_FIELDS, BlockMask, check_lengths
from cuattn.dropout import check_dropout_p, check_seed_int, dropout_threshold
from cuattn.decode import append_kv as core_append_kv, attention_with_kvcache as core_attention_with_kvcache, check_num_splits
from cuattn.merge import merge as core_merge
from cuattn.options import OP_SCHEMA, WINDOW_SCHEMA, AttnOptions, flat_seqlen_bounds
from cuattn.validation import check_bool
from cuattn.varlen import attention_varlen as core_attention_varlen

requirements.require("torch", "cupy", by="cuattn.torch")  # before any torch.library API is touched

__all__ = ["attention", "attention_varlen", "merge", "ring_attention", "scaled_dot_product_attention", "op"]

_LIBRARY = torch.library.Library("cuattn", "FRAGMENT")
_TENSOR_KINDS = {"?": "Tensor?", "]": "Tensor[]"}


def attention(
    q, k, v, *, causal=False, window=None, align="bottom_right", scale=None, softcap=None, sink=None, sink_tokens=0,
    dropout_p=0.0, dropout_seed=None, block_mask=None, return_lse=False,
):
    """:func:`cuattn.attention` on torch tensors, differentiable in ``q``, ``k``, ``v``, the
    ``sink`` logits if given (``(heads_q,)`` float32), and through ``lse`` when it is returned
    and used. With ``dropout_p > 0`` and no ``dropout_seed``, the seed is drawn on q's device
    from torch's generator (``torch.manual_seed`` makes runs repeatable; a captured CUDA graph
    draws a new one each replay); the backward reuses it. ``block_mask``: a
    :class:`cuattn.block_mask.BlockMask` of CUDA int32 tensors (``mask.to(lambda a:
    torch.as_tensor(a, device="cuda"))``); traced, ``torch.ops.cuattn.attention_block_sparse``."""
    return_lse, dropout = _checked_arguments(q, k, v, return_lse, dropout_p, dropout_seed)
    _refuse_forward_ad("attention", q, k, v, sink)
    if block_mask is not None:
        if dropout_threshold(dropout):
            raise ValueError("block_mask is not supported with dropout")
        return _attention_block_sparse(q, k, v, sink, block_mask, (causal, window, align, scale, softcap, sink_tokens), return_lse)
    if dropout:
        dropout_seed = _device_seed(dropout_seed, q)
        return _attention_dropout(q, k, v, sink, dropout_p, dropout_seed, (causal, window, align, scale, softcap, sink_tokens), return_lse)
    if _eager(q, k, v, sink):
        wants_grad = q.requires_grad or k.requires_grad or v.requires_grad or sink is not None and sink.requires_grad
        if not (wants_grad and torch.is_grad_enabled()):
            return core_attention(
                q, k, v, causal=causal, window=window, align=align, scale=scale, softcap=softcap, sink=sink, sink_tokens=sink_tokens,
                return_lse=return_lse,
            )
        out, lse = _apply_eager_attention(q, k, v, sink, (causal, window, align, scale, softcap, sink_tokens))
    else:
        _check_cuda(q=q, k=k, v=v, sink=sink)
        flat = _flat_mask_options(causal, window, align, scale, softcap, _head_dim(q), sink_tokens)
        out, lse = op("attention")(q, k, v, *flat) if sink is None else op("attention_sink")(q, k, v, sink, *flat)
    return (out, lse) if return_lse else out


def _checked_arguments(q, k, v, return_lse, dropout_p, dropout_seed) -> tuple[bool, float]:
    """The checks every attention entry point starts with: q, k, v torch tensors, return_lse a
    bool, dropout_p in [0, 1), an int seed in range (whatever dropout_p, as the core path
    checks it). Returns (return_lse, dropout_p)."""
    _check_tensors(q=q, k=k, v=v)
    return_lse = check_bool("return_lse", return_lse)
    dropout = check_dropout_p(dropout_p)
    if dropout_seed is not None and not isinstance(dropout_seed, torch.Tensor):
        check_seed_int(dropout_seed)
    return return_lse, dropout


def _device_seed(seed, q):
    """The dropout seed as an array on q's device: drawn from torch's generator when None."""
    if seed is None:
        return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=q.device)
    if isinstance(seed, torch.Tensor):
        return seed
    seed = check_seed_int(seed)
    # The same 8 bytes, written by a fill kernel: a copy from host memory would wait for the stream
    # (and cannot be captured in a CUDA graph).
    return torch.full((1,), seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64, device=q.device)


def _attention_dropout(q, k, v, sink, dropout_p, seed, options, return_lse):
    tensors = (q, k, v) if sink is None else (q, k, v, sink)
    causal, window, align, scale, softcap, sink_tokens = options
    if _eager(*tensors, seed):
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return core_attention(
                q, k, v, causal=causal, window=window, align=align, scale=scale, softcap=softcap, sink=sink, sink_tokens=sink_tokens,
                dropout_p=dropout_p, dropout_seed=seed, return_lse=return_lse,
            )
        out, lse = _EagerAttention.apply(q, k, v, sink, options, (dropout_p, seed))
    elif sink is None:
        _check_cuda(q=q, k=k, v=v, dropout_seed=seed)
        out, lse = op("attention_dropout")(q, k, v, seed, *_flat_mask_options(causal, window, align, scale, softcap, _head_dim(q), sink_tokens), dropout_p)
    else:
        raise NotImplementedError("traced cuattn.torch.attention takes sink or dropout, not both (eager calls take both)")
    return (out, lse) if return_lse else out


def _attention_block_sparse(q, k, v, sink, block_mask, options, return_lse):
    tensors = (q, k, v) if sink is None else (q, k, v, sink)
    causal, window, align, scale, softcap, sink_tokens = options
    mask_arrays = block_mask_arrays(block_mask)
    _check_rank4(q=q, k=k)
    check_lengths(block_mask, q.shape[1], k.shape[1])  # a traced op sees the arrays alone
    if _eager(*tensors, *mask_arrays):
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            return core_attention(
                q, k, v, causal=causal, window=window, align=align, scale=scale, softcap=softcap, sink=sink, sink_tokens=sink_tokens,
                block_mask=block_mask, return_lse=return_lse,
            )
        out, lse = _EagerAttention.apply(q, k, v, sink, options, (0.0, None), block_mask)
    elif sink is None:
        _check_cuda(q=q, k=k, v=v, **{f"block_mask.{n}": a for n, a in zip(BLOCK_MASK_FIELDS, mask_arrays)})
        flat = _flat_mask_options(causal, window, align, scale, softcap, _head_dim(q), sink_tokens)
        out, lse = op("attention_block_sparse")(q, k, v, *mask_arrays, *flat)
    else:
        raise NotImplementedError("traced cuattn.torch.attention takes sink or block_mask, not both (eager calls take both)")
    return (out, lse) if return_lse else out


def block_mask_arrays(block_mask) -> tuple:
    """The four tensors of a BlockMask (TypeError for anything else)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cuattn.block_mask.BlockMask, got {type(block_mask).__name__}")
    for name, a in zip(BLOCK_MASK_FIELDS, block_mask.arrays):
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"block_mask.{name} must be a torch tensor like q, got {type(a).__name__} "
                            "(convert the mask with mask.to(lambda a: torch.as_tensor(a, device=q.device)))")
    return block_mask.arrays


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False, window=None,
    align="bottom_right", scale=None, softcap=None, dropout_p=0.0, dropout_seed=None, return_lse=False,
):
    """:func:`cuattn.attention_varlen` on torch tensors (``cu_seqlens_*`` int32 CUDA tensors),
    differentiable in ``q``, ``k``, ``v`` (and through ``lse``). Pass ``max_seqlen_*`` as ints
    when known: derived, they are the totals (device offsets are never read on the host).
    Dropout as :func:`attention` (the seed drawn on the device unless given)."""
    return_lse, dropout = _checked_arguments(q, k, v, return_lse, dropout_p, dropout_seed)
    _refuse_forward_ad("attention_varlen", q, k, v)
    seed = _device_seed(dropout_seed, q) if dropout else None
    if _eager(q, k, v) and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return core_attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
            window=window, align=align, scale=scale, softcap=softcap, dropout_p=dropout, dropout_seed=seed, return_lse=return_lse,
        )
    _check_cuda(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    options = _flat_mask_options(causal, window, align, scale, softcap, _head_dim(q, 3), schema=WINDOW_SCHEMA)
    bounds = tuple(flat_seqlen_bounds(max_seqlen_q, max_seqlen_k).values())
    if dropout:
        out, lse = op("attention_varlen_dropout")(q, k, v, cu_seqlens_q, cu_seqlens_k, seed, *options, *bounds, dropout)
    else:
        out, lse = op("attention_varlen")(q, k, v, cu_seqlens_q, cu_seqlens_k, *options, *bounds)
    return (out, lse) if return_lse else out


def attention_with_kvcache(
    q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None, cache_batch_idx=None, causal=True,
    window=None, scale=None, softcap=None, sink=None, num_splits=None, return_lse=False,
):
    """:func:`cuattn.attention_with_kvcache` on torch tensors (not differentiable: decoding).
    Traced, it is ``torch.ops.cuattn.attention_with_kvcache`` (which declares the cache written
    in place) when ``k_new`` / ``v_new`` are given, else
    ``torch.ops.cuattn.attention_with_kvcache_readonly`` (no write declared); both trace under
    ``torch.compile(fullgraph=True)`` and capture in CUDA graphs."""
    _check_tensors(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens)
    return_lse = check_bool("return_lse", return_lse)
    _refuse_forward_ad("attention_with_kvcache", q, k_cache, v_cache, k_new, v_new, sink)
    _refuse_gradients("attention_with_kvcache", q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new, sink=sink)
    tensors = [x for x in (q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, cache_batch_idx, sink) if x is not None]
    if _eager(*tensors):
        return core_attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new, block_table=block_table,
            cache_batch_idx=cache_batch_idx, causal=causal, window=window, scale=scale, softcap=softcap, sink=sink,
            num_splits=num_splits, return_lse=return_lse,
        )
    if (k_new is None) != (v_new is None):  # before the op is chosen: one of them picks the writing op
        raise TypeError("k_new and v_new go together: pass both or neither")
    _check_cuda(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, k_new=k_new, v_new=v_new, block_table=block_table,
                cache_batch_idx=cache_batch_idx, sink=sink)
    flat = AttnOptions.from_user(causal, window, "bottom_right", scale, softcap, head_dim=_head_dim(q)).flat(WINDOW_SCHEMA)
    del flat["align"]
    splits = -1 if num_splits is None else check_num_splits(num_splits)
    if k_new is None and v_new is None:
        out, lse = op("attention_with_kvcache_readonly")(
            q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, sink, *flat.values(), splits,
        )
    else:
        out, lse = op("attention_with_kvcache")(
            q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, cache_batch_idx, sink, *flat.values(), splits,
        )
    return (out, lse) if return_lse else out


def append_kv(k_new, v_new, k_cache, v_cache, *, cache_seqlens, block_table=None, cache_batch_idx=None):
    """:func:`cuattn.append_kv` on torch tensors (``torch.ops.cuattn.append_kv`` when traced)."""
    _refuse_forward_ad("append_kv", k_new, v_new, k_cache, v_cache)
    _refuse_gradients("append_kv", k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache)
    if _eager(*(x for x in (k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx) if x is not None)):
        return core_append_kv(k_new, v_new, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx)
    _check_tensors(k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens)
    _check_cuda(k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                cache_batch_idx=cache_batch_idx)
    op("append_kv")(k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx)
    return None


def merge(outs, lses):
    """:func:`cuattn.merge` of lists of partial ``(out, lse)`` tensors, differentiable in both."""
    outs, lses = list(outs), list(lses)
    _refuse_forward_ad("merge", *outs, *lses)
    if _eager(*outs, *lses) and not (torch.is_grad_enabled() and any(t.requires_grad for t in outs + lses)):
        return core_merge(outs, lses)
    _check_cuda(**{f"outs[{i}]": t for i, t in enumerate(outs)}, **{f"lses[{i}]": t for i, t in enumerate(lses)})
    return op("merge")(outs, lses)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on
    ``(batch, heads, seqlen, head_dim)`` tensors: strided views into cuattn's layout, no copies.
    ``is_causal`` is aligned top-left, as in SDPA. ``dropout_p`` as SDPA's (applied whenever
    it is given, seeded from torch's generator), but kept in 8 bits as in :func:`cuattn.attention`
    (a probability of at most 1/512 drops nothing). ``attn_mask`` is not supported."""
    if attn_mask is not None:
        raise NotImplementedError("cuattn's scaled_dot_product_attention takes no attn_mask; use is_causal (or cuattn.torch.attention's window)")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be (batch, heads, seqlen, head_dim), got shape {tuple(x.shape)}")
    if not enable_gqa and key.shape[1] != query.shape[1]:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}; pass enable_gqa=True for grouped-query attention")
    out = attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=is_causal, align="top_left", scale=scale, dropout_p=dropout_p,
    )
    return out.transpose(1, 2)


def ring_attention(q, k, v, *, comm, layout="zigzag", causal=True, window=None, scale=None, softcap=None):
    """:func:`cuattn.dist.ring_attention` (this rank's shards, ``comm`` a process group),
    differentiable in ``q``, ``k``, ``v``. The backward is a ring exchange too: every rank of
    ``comm`` runs it, in the same order (as any collective). Eager only."""
    _refuse_forward_ad("ring_attention", q, k, v)
    return _RingAttention.apply(q, k, v, comm, (layout, causal, window, scale, softcap))


def _once_differentiable(backward):
    """A backward whose results raise when differentiated: where a graph of the backward is
    being built (create_graph=True: grad mode on in the backward), it runs under no_grad and
    each gradient it returns is handed out through torch's ``DelayedError`` node, so a second
    differentiation through it raises instead of treating it as a constant. (torch's
    ``once_differentiable`` does that only when an incoming gradient requires grad, which the
    ones ``create_graph=True`` starts from do not: a gradient penalty then came out without this
    term, silently.) Otherwise the engine runs the backward under no_grad already, and it is
    called as it is."""

    @functools.wraps(backward)
    def dispatch(ctx, *grads):
        if not torch.is_grad_enabled():
            return backward(ctx, *grads)
        with torch.no_grad():
            results = backward(ctx, *grads)
        single = not isinstance(results, tuple)
        results = (results,) if single else results
        delayed = torch._C._functions.DelayedError(b"trying to differentiate twice cuattn's backward, which is not differentiable", len(results))
        detached = [r.detach().requires_grad_() if isinstance(r, torch.Tensor) and r.is_floating_point() else r for r in results]
        wrapped = delayed(*detached)
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        results = tuple(w if isinstance(r, torch.Tensor) and r.is_floating_point() else r for w, r in zip(wrapped, results))
        return results[0] if single else results

    return dispatch


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, options):
        from cuattn.dist import ring_attention as core_ring_attention

        layout, causal, window, scale, softcap = options
        out, lse = core_ring_attention(q, k, v, comm=comm, layout=layout, causal=causal, window=window, scale=scale, softcap=softcap,
                                       return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.options = comm, options
        return out

    @staticmethod
    @_once_differentiable
    def backward(ctx, dout):
        from cuattn.dist import ring_attention_backward

        q, k, v, out, lse = ctx.saved_tensors
        layout, causal, window, scale, softcap = ctx.options
        dq, dk, dv = ring_attention_backward(
            _kernel_ready(dout), q, k, v, out, lse, comm=ctx.comm, layout=layout, causal=causal, window=window, scale=scale, softcap=softcap,
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )
        return dq, dk, dv, None, None


_FLAT_OPTIONS: dict[tuple, tuple] = {}


def _flat_mask_options(causal, window, align, scale, softcap, head_dim, sink_tokens=0, schema=OP_SCHEMA) -> tuple:
    """The op's option values (:class:`cuattn.options.AttnOptions` in ``schema``'s order),
    remembered per distinct arguments once they passed its checks."""
    try:
        key = replay.option_key((causal, window, align, scale, softcap, head_dim, sink_tokens, len(schema)))
        return _FLAT_OPTIONS[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable value (a symbolic head_dim under torch.compile): checked each time
        key = None
    user = AttnOptions.from_user(causal, window, align, scale, softcap, head_dim=head_dim, sink_tokens=sink_tokens)
    options = tuple(user.flat(schema).values())
    if key is not None and len(_FLAT_OPTIONS) < replay.MAX_PLANS:
        _FLAT_OPTIONS[key] = options
    return options


def _eager(*tensors) -> bool:
    """Whether a call may run the core path directly, without the dispatcher: plain tensors or
    None (no subclass: fake, functional, DTensor), not traced (torch.compile, export, jit.trace),
    no torch.func transform (vmap, grad) and no dispatch mode (FlopCounterMode, ...) watching."""
    if _compiling() or _tracing() is not None or _in_dispatch_mode() or _functorch_active():
        return False
    for t in tensors:
        if type(t) not in _PLAIN and t is not None:
            return False
    return True


_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))  # a learnable sink is a Parameter


def _check_tensors(**tensors) -> None:
    """TypeError naming the first required argument that is no torch tensor (None included),
    before anything reads its shape."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor, got {'None' if t is None else type(t).__name__}")


def _check_rank4(**tensors) -> None:
    """ValueError naming the first of ``tensors`` that is not (batch, seqlen, heads, head_dim),
    before a traced path reads its dimensions."""
    for name, t in tensors.items():
        validation.check_rank(name, t, 4, "(batch, seqlen, heads, head_dim)")  # the core path's words


def _head_dim(q, rank: int = 4) -> int:
    """q's last dimension, after its rank check (3: packed varlen rows)."""
    if rank == 4:
        _check_rank4(q=q)
    else:
        validation.check_rank("q", q, rank, "(total, heads, head_dim)")
    return q.shape[-1]


def _check_cuda(**tensors) -> None:
    """ValueError naming the first argument not on a CUDA device or meta (before the dispatcher, which
    would say only that the op has no CPU kernel)."""
    for name, t in tensors.items():  # types first: a TypeError names a wrong argument before any device is read
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor or None, got {type(t).__name__}")
    for name, t in tensors.items():
        if t is not None and t.device.type not in ("cuda", "meta"):  # meta: shapes only, the ops' fake kernels
            raise ValueError(f"{name} is on device '{t.device}'; cuattn computes on CUDA devices (move it with .cuda())")


class _EagerAttention(torch.autograd.Function):
    """Eager autograd of the attention op without the dispatcher: the forward and backward
    call the core path (its validated, replayed launches); traced code uses the op instead."""

    @staticmethod
    def forward(ctx, q, k, v, sink, options, dropout=(0.0, None), block_mask=None):
        causal, window, align, scale, softcap, sink_tokens = options
        out, lse = core_attention(
            q, k, v, causal=causal, window=window, align=align, scale=scale, softcap=softcap, sink=sink, sink_tokens=sink_tokens,
            dropout_p=dropout[0], dropout_seed=dropout[1], block_mask=block_mask, return_lse=True,
        )
        # The seed (a tensor, or None) and the block mask are saved too: changed in place
        # before the backward, they raise.
        mask_arrays = () if block_mask is None else block_mask.arrays
        ctx.save_for_backward(q, k, v, out, lse, sink, dropout[1], *mask_arrays)
        ctx.options, ctx.dropout_p, ctx.block_mask = options, dropout[0], block_mask
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @_once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink, saved_seed, *mask_arrays = ctx.saved_tensors
        block_mask = None if ctx.block_mask is None else dataclasses.replace(ctx.block_mask, **dict(zip(BLOCK_MASK_FIELDS, mask_arrays)))
        tail = (None,) * (3 if sink is None else 2) + (None,)  # options, dropout, block_mask
        if dout is None:
            dout = torch.zeros_like(out)
        dout = _kernel_ready(dout)
        if dlse is not None:
            dlse = _kernel_ready(dlse)
        deterministic = torch.are_deterministic_algorithms_enabled()
        dropout_p, seed = ctx.dropout_p, saved_seed
        if not _eager(dout, q, k, v, out, lse, dlse, sink):  # e.g. compiled autograd
            causal, window, align, scale, softcap, sink_tokens = ctx.options
            flat = _flat_mask_options(causal, window, align, scale, softcap, q.shape[-1], sink_tokens)
            if (dropout_p or block_mask is not None) and sink is not None:
                raise NotImplementedError("traced backward of attention with sink and dropout or a block mask")
            if dropout_p:
                return (*op("attention_dropout_backward")(dout, q, k, v, out, lse, dlse, seed, *flat, dropout_p, deterministic), *tail)
            if block_mask is not None:
                return (*op("attention_block_sparse_backward")(dout, q, k, v, out, lse, dlse, *mask_arrays, *flat, deterministic), *tail)
            if sink is None:
                return (*op("attention_backward")(dout, q, k, v, out, lse, dlse, *flat, deterministic), *tail)
            return (*op("attention_sink_backward")(dout, q, k, v, out, lse, dlse, sink, *flat, deterministic), *tail)
        causal, window, align, scale, softcap, sink_tokens = ctx.options
        grads = core_attention_backward(
            dout, q, k, v, out, lse, causal=causal, window=window, align=align, scale=scale, softcap=softcap, sink=sink,
            sink_tokens=sink_tokens, dropout_p=dropout_p, dropout_seed=seed, block_mask=block_mask, dlse=dlse, deterministic=deterministic,
        )
        return (*grads, *tail)


def _raw_apply(function):
    """``function.apply`` without its Python prologue (binding defaults for setup_context,
    unwrapping functorch's dead wrappers): for eager calls, which run with no functorch
    transform active (:func:`_eager`). The C++ ``_FunctionBase.apply`` where torch has it."""
    raw = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")
    return raw.__get__(None, function) if hasattr(raw, "__get__") else function.apply


_apply_eager_attention = _raw_apply(_EagerAttention)


def _refuse_forward_ad(name: str, *tensors) -> None:
    """NotImplementedError where forward-mode AD would lose a tangent: the ops have no jvp rule,
    and torch would give a dual tensor's result no tangent and ``torch.func.jvp`` / ``jacfwd``
    zeros."""
    if _compiling():  # not checked while torch.compile traces
        return
    functorch = _functorch_active()
    if functorch and _carries_jvp_tangent(tensors):
        raise NotImplementedError(f"cuattn.torch.{name} has no forward-mode derivative (torch.func.jvp / jacfwd); use reverse mode")
    if _forward_ad._current_level >= 0 and any(
        t is not None and not (functorch and torch._C._functorch.is_functorch_wrapped_tensor(t))  # unpack_dual has no batching rule
        and _forward_ad.unpack_dual(t).tangent is not None for t in tensors
    ):
        raise NotImplementedError(f"cuattn.torch.{name} has no forward-mode derivative (an input is a dual tensor); use reverse mode")


def _refuse_gradients(name: str, **tensors) -> None:
    """NotImplementedError where an argument requires grad under grad mode: the decoding ops
    have no backward, and their results would come out detached (no gradient, no error)."""
    if torch.is_grad_enabled():
        for arg, t in tensors.items():
            if getattr(t, "requires_grad", False):
                raise NotImplementedError(
                    f"cuattn.torch.{name} is not differentiable ({arg} requires grad): call it under torch.no_grad() or "
                    "torch.inference_mode(), or pass detached tensors (cuattn.torch.attention takes gradients)"
                )


def _carries_jvp_tangent(tensors) -> bool:
    """Whether an input is wrapped at the level of an active ``torch.func.jvp``: made inside
    the transformed function (from a primal, or a new tensor there); a tensor from outside it
    is not wrapped at that level."""
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    functorch = torch._C._functorch
    jvp = functorch.TransformType.Jvp
    levels = {i.level() for i in retrieve_all_functorch_interpreters() if i.key() == jvp}
    for t in tensors:
        while levels and t is not None and functorch.is_functorch_wrapped_tensor(t):
            if functorch.maybe_get_level(t) in levels:
                return True
            t = functorch.get_unwrapped(t)
    return False


def _in_dispatch_mode() -> bool:
    return _python_dispatch._is_in_torch_dispatch_mode or _dispatch_stack() > 0


_compiling = torch.compiler.is_compiling
_tracing = torch._C._get_tracing_state
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)  # unknown: always dispatch
_dispatch_stack = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)  # unknown: always dispatch
from torch.autograd import forward_ad as _forward_ad  # noqa: E402
from torch.utils import _python_dispatch  # noqa: E402


def op(name: str):
    """``torch.ops.cuattn.<name>.default`` (every entry of the table is registered at import)."""
    return _REGISTERED[name]


def _register(name: str):
    entry = ops.OPS[name]
    _LIBRARY.define(name + _schema(entry))
    _LIBRARY.impl(name, functools.partial(_run, entry), "CUDA")
    torch.library.register_fake(f"cuattn::{name}", functools.partial(_fake, entry), lib=_LIBRARY)
    if entry.vjp is not None or name in _CUSTOM_VJPS:
        # The kernels' backward ops have no autograd of their own: built into a graph
        # (create_graph=True), their results raise when differentiated, as the eager path's do
        # (they were zeros, with a warning). merge's backward is torch operations: differentiable.
        backward = _CUSTOM_VJPS.get(name) or _once_differentiable(functools.partial(_table_vjp, entry))
        torch.library.register_autograd(
            f"cuattn::{name}", functools.partial(backward, entry) if name in _CUSTOM_VJPS else backward,
            setup_context=functools.partial(_save, entry), lib=_LIBRARY,
        )
    return getattr(torch.ops.cuattn, name).default


def _schema(entry: ops.OpEntry) -> str:
    aliases = {name: f"({chr(ord('a') + i)}!)" for i, name in enumerate(entry.mutates)}  # written in place
    arrays = []
    for a in entry.arrays:
        name = a.rstrip("?[]")
        kind = _TENSOR_KINDS.get(a[-1], "Tensor")
        arrays.append(f"{kind[:6]}{aliases.get(name, '')}{kind[6:]} {name}")
    options = [f"{kind} {name}" for name, kind in entry.options]
    return f"({', '.join(arrays + options)}) -> ({', '.join('Tensor' for _ in entry.returns)})"


def _split(entry: ops.OpEntry, args, kwargs=None) -> tuple[list, dict]:
    n = len(entry.arrays)
    options = dict(zip((o for o, _ in entry.options), args[n:]))
    options.update(kwargs or {})
    return list(args[:n]), options


def _run(entry: ops.OpEntry, *args, **kwargs):
    arrays, options = _split(entry, args, kwargs)
    results = tuple(entry.call(*arrays, **options))
    return results if entry.returns else None


def _fake(entry: ops.OpEntry, *args, **kwargs):
    arrays, options = _split(entry, args, kwargs)
    named = dict(zip(entry.array_names, arrays))
    shapes = {n: _shape(a) for n, a in named.items()}
    device = next(_tensors(arrays)).device
    outs = entry.outputs(**shapes, **options)[: len(entry.returns)]
    results = tuple(torch.empty(shape, dtype=_dtype_of(named, d), device=device) for shape, d in outs)
    return results if entry.returns else None


def _save(entry: ops.OpEntry, ctx, inputs, output) -> None:
    arrays, options = _split(entry, inputs)
    flat = list(_tensors(arrays))
    ctx.layout = [len(a) if isinstance(a, (list, tuple)) else None for a in arrays]
    ctx.options = options
    ctx.save_for_backward(*flat, *output)


def _saved(ctx) -> tuple[list, list]:
    """(inputs with lists regrouped, outputs) from the tensors ``_save`` kept."""
    saved, inputs, i = list(ctx.saved_tensors), [], 0
    for length in ctx.layout:
        inputs.append(saved[i] if length is None else saved[i:i + length])
        i += 1 if length is None else length
    return inputs, saved[i:]


def _table_vjp(entry: ops.OpEntry, ctx, *grads):
    inputs, outputs = _saved(ctx)
    options = {**ctx.options, **dict(entry.vjp_options)}
    if "deterministic" in options:  # torch.use_deterministic_algorithms(True) picks the atomic-free backward
        options["deterministic"] = torch.are_deterministic_algorithms_enabled()
    arrays = entry.vjp_arrays(inputs, outputs, [_kernel_ready(g) for g in grads])
    if not torch.is_grad_enabled() and _eager(*(a for a in arrays if a is not None)):  # eager, first order: no second dispatch
        grads_in = ops.OPS[entry.vjp].call(*arrays, **options)
    else:
        grads_in = op(entry.vjp)(*arrays, **options)
    no_grads = len(entry.arrays) - len(grads_in) + len(entry.options)  # integer arrays (offsets) and options
    return (*grads_in, *(None,) * no_grads)


def _merge_vjp(entry: ops.OpEntry, ctx, dout, dlse):
    """out = sum_i w_i out_i with w_i = exp(lse_i - lse): d out_i = w_i dout and
    d lse_i = w_i (<dout, out_i - out> + dlse); a partial with lse_i = -inf gets zeros."""
    (outs, lses), (out, lse) = _saved(ctx)
    finite = torch.isfinite(lse)
    douts, dlses = [], []
    for out_i, lse_i in zip(outs, lses):
        w = torch.where(finite & torch.isfinite(lse_i), torch.exp(lse_i - torch.where(finite, lse, 0.0)), 0.0)
        w_rows = w.transpose(1, 2).unsqueeze(-1)  # (batch, seqlen, heads, 1)
        douts.append((w_rows * dout.float()).to(out_i.dtype))
        dot = ((out_i.float() - out.float()) * dout.float()).sum(-1).transpose(1, 2)  # (batch, heads, seqlen)
        # A partial of lse -inf gets 0 whatever its out holds (NaN included), as in the forward.
        dlses.append(torch.where(w > 0, w * (dot + (0.0 if dlse is None else dlse)), 0.0))
    return douts, dlses


_CUSTOM_VJPS = {"merge": _merge_vjp}
_REGISTERED = {name: _register(name) for name in ops.OPS}


def _kernel_ready(x):
    """Incoming gradients may be expanded or oddly strided views; the kernels need a unit last
    stride and 16-byte aligned rows: such gradients are made contiguous (a copy), others pass."""
    if x is None or x.numel() == 0 or x.dtype == torch.float32 and x.stride(-1) == 1:
        return x
    vec = 16 // x.element_size()
    # The caching allocator aligns every block; a view is aligned when its offset is.
    if x.stride(-1) == 1 and x.storage_offset() % vec == 0 and all(s % vec == 0 for s in x.stride()[:-1]):
        return x
    return x.contiguous()


def _tensors(arrays):
    for a in arrays:
        if isinstance(a, (list, tuple)):
            yield from a
        elif a is not None:
            yield a


def _shape(a):
    if a is None:
        return None
    return [tuple(t.shape) for t in a] if isinstance(a, (list, tuple)) else tuple(a.shape)


def _dtype_of(named: dict, dtype: str):
    if dtype == "float32":
        return torch.float32
    src = named[dtype]
    return (src[0] if isinstance(src, (list, tuple)) else src).dtype
