"""JAX adapter: cuattn's ops as differentiable JAX functions, eager or under ``jax.jit``.

Each entry of :data:`cuattn.ops.OPS` runs through ``jax.experimental.buffer_callback``: XLA
allocates every array the op would allocate (found by running the op's validation on the
traced shapes), and the kernels are launched on XLA's stream with its device buffers (no
host round trip, no copies; JAX arrays are never written in place). Arguments are validated
while tracing. Differentiation is ``jax.custom_vjp`` through the entry's ``vjp``. Importing
:mod:`cuattn` does not import jax; importing this module does.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from cuattn import boundary, ops, replay, requirements
from cuattn.block_mask import ARRAY_FIELDS, BlockMask, check_lengths
from cuattn.decode import check_num_splits
from cuattn.dropout import check_dropout_p, dropout_threshold
from cuattn.options import WINDOW_SCHEMA, AttnOptions, flat_seqlen_bounds
from cuattn.validation import check_bool

requirements.require("jax", "cupy", by="cuattn.jax")  # before importing what older releases lack

from jax.experimental.buffer_callback import buffer_callback  # noqa: E402

from cuattn.dist.jax_ring import ring_attention  # noqa: E402  (after the version check too)

# A block mask is a pytree of its four arrays (traced under jit), its lengths static.
jax.tree_util.register_dataclass(BlockMask, data_fields=list(ARRAY_FIELDS), meta_fields=["seqlen_q", "seqlen_k"])

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "append_kv", "merge", "call", "ring_attention"]


def attention(
    q, k, v, *, causal=False, window=None, align="bottom_right", scale=None, softcap=None, sink=None, sink_tokens=0,
    dropout_p=0.0, dropout_rng=None, block_mask=None, return_lse=False,
):
    """:func:`cuattn.attention` on JAX arrays, differentiable in ``q``, ``k``, ``v``, the
    ``sink`` logits if given (``(heads_q,)`` float32), and through ``lse`` when it is returned
    and used. ``dropout_p > 0`` needs ``dropout_rng``, a JAX PRNG key (traced under jit): the
    kernels' seed is ``jax.random.bits(dropout_rng, (2,), uint32)`` (low word first), so
    :func:`dropout_seed` gives the seed that :func:`cuattn.reference.dropout_keep` takes.
    ``block_mask``: a :class:`cuattn.block_mask.BlockMask` of int32 JAX arrays
    (``mask.to(jax.numpy.asarray)``; traced under jit like any argument)."""
    return_lse = check_bool("return_lse", return_lse)
    _check_rng(dropout_rng)
    user = AttnOptions.from_user(causal, window, align, scale, softcap, head_dim=_head_dim(q), sink_tokens=sink_tokens)
    options = tuple(user.flat().items())
    if block_mask is not None:
        if dropout_threshold(check_dropout_p(dropout_p)):  # as the core call and the torch adapter: a p that drops nothing passes
            raise ValueError("block_mask is not supported with dropout")
        if sink is not None:
            raise NotImplementedError("cuattn.jax.attention takes block_mask without sink")
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a cuattn.block_mask.BlockMask, got {type(block_mask).__name__}")
        check_lengths(block_mask, q.shape[1], _dims("k", k, 4)[1])  # the op sees the arrays alone
        out, lse = _differentiable("attention_block_sparse")(options, q, k, v, *block_mask.arrays)
    elif check_dropout_p(dropout_p):
        if sink is not None:
            raise NotImplementedError("cuattn.jax.attention takes sink or dropout, not both")
        out, lse = _differentiable("attention_dropout")(options + (("dropout_p", float(dropout_p)),), q, k, v, _seed_words(dropout_rng))
    elif sink is None:
        out, lse = _differentiable("attention")(options, q, k, v)
    else:
        out, lse = _differentiable("attention_sink")(options, q, k, v, sink)
    return (out, lse) if return_lse else out


def dropout_seed(dropout_rng) -> int:
    """The 64-bit seed that :func:`attention` draws from ``dropout_rng`` (a concrete key)."""
    low, high = (int(w) for w in np.asarray(_seed_words(dropout_rng)))
    return low | high << 32


def _check_rng(dropout_rng) -> None:
    """TypeError for a ``dropout_rng`` that is neither None nor an array (a JAX PRNG key, or
    a raw uint32 key held in NumPy), whatever dropout_p (as the torch adapter checks its seed)."""
    raw_key = isinstance(dropout_rng, np.ndarray) and dropout_rng.dtype == np.uint32 and dropout_rng.shape[-1:] == (2,)
    if dropout_rng is not None and not (isinstance(dropout_rng, jax.Array) or raw_key):
        raise TypeError(f"dropout_rng must be a JAX PRNG key (jax.random.key), got {type(dropout_rng).__name__}")


def _seed_words(dropout_rng):
    """The kernels' seed from a JAX PRNG key: two uint32 words, low first."""
    if dropout_rng is None:
        raise ValueError("dropout_p > 0 needs dropout_rng (a JAX PRNG key)")
    return jax.random.bits(dropout_rng, (2,), jnp.uint32)


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False, window=None,
    align="bottom_right", scale=None, softcap=None, dropout_p=0.0, dropout_rng=None, return_lse=False,
):
    """:func:`cuattn.attention_varlen` on JAX arrays (``cu_seqlens_*`` int32), differentiable
    in ``q``, ``k``, ``v`` (and through ``lse``). Under ``jax.jit`` the offsets are traced:
    pass ``max_seqlen_*`` as Python ints when known, else the grids are sized by the totals.
    Bad device offsets found by the GPU's check are raised by :func:`cuattn.check_varlen_offsets`
    alone under jit (a compiled step runs no host code that could raise them): call it after
    a step whose offsets may be malformed. Dropout as :func:`attention`."""
    return_lse = check_bool("return_lse", return_lse)
    _check_rng(dropout_rng)
    options = {**AttnOptions.from_user(causal, window, align, scale, softcap, head_dim=_head_dim(q, 3)).flat(WINDOW_SCHEMA),
               **flat_seqlen_bounds(max_seqlen_q, max_seqlen_k)}
    if check_dropout_p(dropout_p):
        out, lse = _differentiable("attention_varlen_dropout")(
            tuple({**options, "dropout_p": float(dropout_p)}.items()), q, k, v, cu_seqlens_q, cu_seqlens_k, _seed_words(dropout_rng),
        )
    else:
        out, lse = _differentiable("attention_varlen")(tuple(options.items()), q, k, v, cu_seqlens_q, cu_seqlens_k)
    return (out, lse) if return_lse else out


def merge(outs, lses):
    """:func:`cuattn.merge` of lists of partial ``(out, lse)`` arrays, differentiable in both."""
    return _differentiable("merge")((), list(outs), list(lses))


def _head_dim(q, rank: int = 4) -> int:
    """q's head_dim, read before the op's checks: an argument that is no array of ``rank``
    dimensions gets the core's error naming q here."""
    return _dims("q", q, rank)[-1]


def _dims(name: str, x, rank: int) -> tuple:
    """``x``'s shape, read before the op's checks (TypeError / ValueError naming ``name``)."""
    if not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if len(x.shape) != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(x.shape)}")
    return tuple(x.shape)


def call(name: str, *arrays, **options):
    """Runs op ``name`` of :data:`cuattn.ops.OPS` (not differentiated); returns its outputs,
    then, for an op that writes arrays in place (the KV cache of ``attention_with_kvcache``
    with ``k_new``, ``append_kv``), their new values: XLA aliases each to its input, so a
    donated input is updated without a copy (and an undonated one is copied first)."""
    entry = ops.OPS[name]
    written = [entry.array_names.index(n) for n in entry.written(arrays)]
    # XLA allocates every buffer the op allocates: its outputs, then its scratch (delta, ...);
    # the run replays the choices that sized them. Written arrays come back as extra results.
    traced = boundary.trace(entry.call, *arrays, **options)
    _check_on_gpu(entry.array_names, arrays)
    results = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape, dtype in traced.allocations]
    allocated = len(results)
    results += [jax.ShapeDtypeStruct(arrays[i].shape, arrays[i].dtype) for i in written]
    flat_index = lambda i: len(jax.tree_util.tree_leaves(arrays[:i]))  # noqa: E731  (None arrays are no leaves)
    aliases = {flat_index(i): allocated + j for j, i in enumerate(written)}

    plans = {}  # this trace's launch plan, per device (cuattn.replay)

    def callback(ctx, outs, *buffers):
        outs, buffers = list(outs), list(buffers)
        for j, i in enumerate(written):  # the op writes the aliased results, which hold the inputs' values
            buffers[i] = outs[allocated + j]
        sources = [b for a in buffers for b in (a if isinstance(a, (list, tuple)) else (a,))]
        device = _device_of(sources)
        run = lambda: entry.call(*buffers, **options)  # noqa: E731
        if replay.run_preallocated(plans, run, sources, outs[:allocated], device, ctx.stream, traced.decisions):
            return
        with boundary.preallocated_outputs(device, ctx.stream, outs[:allocated], traced.decisions):
            run()

    outputs = buffer_callback(callback, results, input_output_aliases=aliases or None)(*arrays)
    outputs = varying_like(outputs, jax.tree_util.tree_leaves(arrays))
    return tuple(outputs[: len(entry.returns)]) + tuple(outputs[allocated:])


def _check_on_gpu(names, arrays) -> None:
    """The kernels run on CUDA devices: a ValueError where JAX has no GPU backend (its CPU-only
    build) or an argument is a concrete array on another device, instead of XLA's error when the
    callback runs. (A traced argument's device is XLA's to choose.)"""
    try:
        jax.devices("gpu")
    except RuntimeError:
        raise ValueError("cuattn.jax: JAX sees no CUDA GPU (a CPU-only JAX?): the kernels need JAX's CUDA plugin, "
                         "e.g. pip install 'jax[cuda13]'") from None
    for name, a in zip(names, arrays):
        for leaf in jax.tree_util.tree_leaves(a):
            try:
                platforms = {d.platform for d in leaf.devices()}
            except Exception:  # a tracer, or not a JAX array
                continue
            if platforms - {"gpu", "cuda"}:
                raise ValueError(f"{name} is on {'/'.join(sorted(platforms))}: cuattn.jax runs on CUDA devices (jax.device_put it to a GPU)")


def _varying_axes(x) -> frozenset:
    """The mesh axes over which ``x`` may differ between devices (inside ``shard_map``)."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None:  # a JAX before per-device types
        return frozenset()
    aval = typeof(x)
    axes = getattr(aval, "vma", None)
    if axes is None:
        axes = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(axes or ())


def varying_like(outputs, inputs) -> list:
    """``outputs`` typed as varying over every mesh axis an input varies over. A
    ``buffer_callback``'s results carry no such type: inside ``shard_map`` they would pass for
    equal on every device, and mismatch per-device values (in ``lax.switch`` branches, in the
    cotangents of a ``custom_vjp``)."""
    axes = frozenset().union(*(_varying_axes(x) for x in inputs))
    if not axes:
        return list(outputs)
    return [o if axes <= _varying_axes(o) else jax.lax.pcast(o, tuple(sorted(axes - _varying_axes(o))), to="varying") for o in outputs]


def attention_with_kvcache(
    q, k_cache, v_cache, *, cache_seqlens, k_new=None, v_new=None, block_table=None, cache_batch_idx=None, causal=True,
    window=None, scale=None, softcap=None, sink=None, num_splits=None, return_lse=False,
):
    """:func:`cuattn.attention_with_kvcache` on JAX arrays, eager or under ``jax.jit`` (not
    differentiable). Functional: with ``k_new`` / ``v_new`` it returns ``(out, k_cache,
    v_cache)`` (``(out, lse, k_cache, v_cache)`` with ``return_lse``), the caches with the new
    rows written; donate the caches (``jax.jit(..., donate_argnums=...)``) and they are updated
    in place, else XLA copies them first."""
    return_lse = check_bool("return_lse", return_lse)
    options = AttnOptions.from_user(causal, window, "bottom_right", scale, softcap, head_dim=_head_dim(q)).flat(WINDOW_SCHEMA)
    del options["align"]
    options["num_splits"] = -1 if num_splits is None else check_num_splits(num_splits)
    out, lse, *caches = call(
        "attention_with_kvcache", q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, cache_batch_idx, sink, **options,
    )
    result = (out, lse) if return_lse else (out,)
    return (*result, *caches) if caches or len(result) > 1 else out


def append_kv(k_new, v_new, k_cache, v_cache, *, cache_seqlens, block_table=None, cache_batch_idx=None):
    """:func:`cuattn.append_kv` on JAX arrays: returns the new ``(k_cache, v_cache)`` (aliased
    to the inputs: donate them to update in place)."""
    return call("append_kv", k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx)


def xla_deterministic_ops() -> bool:
    """Whether ``XLA_FLAGS`` asks XLA for deterministic GPU ops (``--xla_gpu_deterministic_ops``,
    or ``--xla_gpu_exclude_nondeterministic_ops``): then gradients take the atomic-free backward,
    as JAX's own ops do. Read at trace time."""
    enabled = False
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name in ("--xla_gpu_deterministic_ops", "--xla_gpu_exclude_nondeterministic_ops"):
            enabled = value.lower() in ("", "true", "1")  # the last occurrence wins, as in XLA
    return enabled


@functools.cache
def _differentiable(name: str):
    entry = ops.OPS[name]

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def run(options, *arrays):
        return call(name, *arrays, **dict(options))

    def forward(options, *arrays):
        outputs = call(name, *arrays, **dict(options))
        return outputs, (arrays, outputs)

    def backward(options, saved, grads):
        inputs, outputs = saved
        if name in _CUSTOM_VJPS:
            return _CUSTOM_VJPS[name](inputs, outputs, grads)
        vjp_options = dict(entry.vjp_options)
        if "deterministic" in vjp_options:  # XLA's determinism flag picks the atomic-free backward
            vjp_options["deterministic"] = xla_deterministic_ops()
        grads_in = call(entry.vjp, *entry.vjp_arrays(inputs, outputs, grads), **dict(options), **vjp_options)
        # Integer arrays past the differentiated ones (offsets) take float0 cotangents.
        return (*grads_in, *(np.zeros(np.shape(x), jax.dtypes.float0) for x in inputs[len(grads_in):]))

    run.defvjp(forward, backward)
    return run


def _merge_vjp(inputs, outputs, grads):
    """out = sum_i w_i out_i with w_i = exp(lse_i - lse): d out_i = w_i dout and
    d lse_i = w_i (<dout, out_i - out> + dlse); a partial with lse_i = -inf gets zeros."""
    (outs, lses), (out, lse), (dout, dlse) = inputs, outputs, grads
    finite = jnp.isfinite(lse)
    douts, dlses = [], []
    for out_i, lse_i in zip(outs, lses):
        w = jnp.where(finite & jnp.isfinite(lse_i), jnp.exp(lse_i - jnp.where(finite, lse, 0.0)), 0.0)
        w_rows = jnp.swapaxes(w, 1, 2)[..., None]  # (batch, seqlen, heads, 1)
        douts.append((w_rows * dout.astype(jnp.float32)).astype(out_i.dtype))
        dot = jnp.swapaxes(((out_i.astype(jnp.float32) - out.astype(jnp.float32)) * dout.astype(jnp.float32)).sum(-1), 1, 2)
        dlses.append(jnp.where(w > 0, w * (dot + dlse), 0.0))  # a partial of lse -inf: 0 whatever its out holds (NaN included)
    return douts, dlses


_CUSTOM_VJPS = {"merge": _merge_vjp}


def _device_of(buffers) -> int:
    for b in buffers:
        if hasattr(b, "__dlpack_device__"):
            return int(b.__dlpack_device__()[1])
    return 0
