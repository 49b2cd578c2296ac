"""Ring attention in JAX: the sequence split over the devices of a mesh axis, inside ``shard_map``.

Each device holds its shards of q, k and v (:func:`cuattn.dist.shard` under ``layout``). K/V
shards travel around the ring with ``jax.lax.ppermute`` (device r receives from r - 1, so at
step s it holds the shard of rank r - s); each step computes a partial ``(out, lse)`` with
cuattn's forward kernels and folds it into an fp32 accumulator by its lse. The backward (a
``jax.custom_vjp``) passes K/V around the ring again with fp32 dK / dV accumulators: each
step runs cuattn's backward kernels on the shard in hand with the global ``out`` and ``lse``
(the saved-statistics rule) and adds its pieces in fp32; after W steps the accumulators are
back with their owner. The kernels called through JAX return each step's partial ``out`` and
gradients in the input dtype, so every step's part is rounded once before the fp32 sum: the
error grows mildly with W, where :func:`cuattn.dist.ring_attention` (its kernels fold into
fp32 in place) rounds each result once. Only this device's shards and its out / lse
are kept for the backward.

Which keys a step sees depends on the device's rank, a traced value under ``shard_map``: each
step is a ``lax.switch`` between the two cases of a causal mask (the shard held belongs to a
rank before this one or after it), each a :class:`Piece` of rows, so every device runs one
program:

- ``contiguous``: an earlier rank's shard whole, a later one's skipped (no launch).
- ``zigzag`` (chunks r and 2W-1-r of 2W): from an earlier rank every query row sees its first
  chunk; from a later rank the second chunk of queries sees all of it. The same work on every
  device at every step.
- ``stripe`` (positions r, r + W, ...): key j of an earlier rank is visible to query i when
  j <= i, of a later rank when j < i (queries 1.. against keys ..-2, causal).

Step 0 (the device's own shard) is causal on local indices in every layout. Sliding windows
are not supported here (:func:`cuattn.dist.ring_attention` has them).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cuattn.dist import layout as layouts
from cuattn.options import AttnOptions
from cuattn.validation import check_bool


def _options(causal: bool, scale, softcap, head_dim: int) -> dict:
    """The op table's options of a piece: top-left causal or no mask."""
    return AttnOptions.from_user(causal, None, "top_left", scale, softcap, head_dim=head_dim).flat()


def _cuattn_forward(q, k, v, causal: bool, scale, softcap):
    """``(out, lse)`` of q against k, v: cuattn's forward kernels."""
    import cuattn.jax

    return cuattn.jax.call("attention", q, k, v, **_options(causal, scale, softcap, q.shape[-1]))


def _cuattn_backward(dout, q, k, v, out, lse, dlse, causal: bool, scale, softcap):
    """``(dq, dk, dv)`` of q against k, v given the global ``out``, ``lse`` and ``dlse`` of
    these query rows: cuattn's backward kernels."""
    import cuattn.jax

    return cuattn.jax.call("attention_backward", dout, q, k, v, out, lse, dlse, deterministic=cuattn.jax.xla_deterministic_ops(),
                           **_options(causal, scale, softcap, q.shape[-1]))


# The kernels of a step; tests on the CPU put jnp attention here.
kernels = {"forward": _cuattn_forward, "backward": _cuattn_backward}


@dataclasses.dataclass(frozen=True)
class Piece:
    """The query rows and key rows of a step that see each other, and whether the mask between
    them is causal (top-left) or none."""

    q: slice
    k: slice
    causal: bool


_ALL = slice(None)


def cases(layout: str, causal: bool, s: int, rows: int) -> tuple:
    """The pieces of step ``s`` on a shard of ``rows`` rows: one (the same on every device), or
    two, for a shard from a later rank and from an earlier one (None: nothing seen)."""
    if not causal:
        return (Piece(_ALL, _ALL, False),)
    if s == 0:
        return (Piece(_ALL, _ALL, True),)
    half = rows // 2
    return {
        "contiguous": (None, Piece(_ALL, _ALL, False)),
        "zigzag": (Piece(slice(half, None), _ALL, False), Piece(_ALL, slice(None, half), False)),
        "stripe": (Piece(slice(1, None), slice(None, rows - 1), True) if rows > 1 else None, Piece(_ALL, _ALL, True)),
    }[layout]


def ring_attention(q, k, v, *, axis_name, layout="zigzag", causal=True, scale=None, softcap=None, return_lse=False):
    """This device's rows of attention over a sequence whose rows are dealt to the devices of
    the mesh axis ``axis_name``; call it inside ``jax.shard_map`` over that axis.

    ``q``, ``k``, ``v``: this device's shards ``(batch, seqlen / W, heads, head_dim)`` under
    ``layout`` (``"contiguous"``, ``"zigzag"``, ``"stripe"``); ``causal`` on token positions,
    or no mask. Returns ``out`` (and ``lse``, ``(batch, heads, seqlen / W)`` fp32), equal to
    :func:`cuattn.jax.attention` over the whole sequence, sharded the same way; differentiable
    in ``q``, ``k``, ``v`` (and through ``lse``)."""
    missing = [name for name, owner in (("shard_map", jax), ("axis_size", jax.lax), ("pcast", jax.lax)) if not hasattr(owner, name)]
    if missing:
        raise RuntimeError(f"cuattn.jax.ring_attention needs a JAX with {', '.join(missing)} (this is {jax.__version__})")
    causal = check_bool("causal", causal)
    return_lse = check_bool("return_lse", return_lse)
    world = jax.lax.axis_size(axis_name)
    layouts.check_layout(layout, q.shape[1] * world, world)
    _options(causal, scale, softcap, q.shape[-1])  # checked before tracing
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention is self-attention: q and k shards must hold as many rows ({q.shape[1]} and {k.shape[1]})")
    out, lse = _ring(axis_name, layout, causal, scale, softcap, q, k, v)
    return (out, lse) if return_lse else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _ring(axis_name, layout, causal, scale, softcap, q, k, v):
    return _forward(axis_name, layout, causal, scale, softcap, q, k, v)


def _forward(axis_name, layout, causal, scale, softcap, q, k, v):
    world, rank = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    acc = lse = None
    cur = (k, v)
    for s in range(world):
        nxt = _to_next(cur, axis_name) if s < world - 1 else None
        out_s, lse_s = _switch(rank, s, [_forward_piece(p, q, *cur, scale, softcap, axis_name) for p in cases(layout, causal, s, q.shape[1])])
        acc, lse = fold(acc, lse, out_s, lse_s)
        cur = nxt
    return acc.astype(q.dtype), lse


def _ring_fwd(axis_name, layout, causal, scale, softcap, q, k, v):
    out, lse = _forward(axis_name, layout, causal, scale, softcap, q, k, v)
    return (out, lse), (q, k, v, out, lse)


def _ring_bwd(axis_name, layout, causal, scale, softcap, saved, grads):
    q, k, v, out, lse = saved
    dout, dlse = grads
    world, rank = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    dq = jnp.zeros(q.shape, jnp.float32)
    accs = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    cur = (k, v)
    for s in range(world):
        nxt = _to_next(cur, axis_name) if s < world - 1 else None
        pieces = cases(layout, causal, s, q.shape[1])
        dq_s, dk_s, dv_s = _switch(rank, s, [_backward_piece(p, dout, q, *cur, out, lse, dlse, scale, softcap, axis_name) for p in pieces])
        dq = dq + dq_s.astype(jnp.float32)
        accs = _to_next((accs[0] + dk_s.astype(jnp.float32), accs[1] + dv_s.astype(jnp.float32)), axis_name)
        cur = nxt
    return dq.astype(q.dtype), accs[0].astype(k.dtype), accs[1].astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _to_next(arrays, axis_name):
    world = jax.lax.axis_size(axis_name)
    return jax.lax.ppermute(arrays, axis_name, [(i, (i + 1) % world) for i in range(world)])


def _switch(rank, s: int, branches):
    """The one branch of a step, or the later / earlier one by ``rank`` (traced)."""
    if len(branches) == 1:
        return branches[0]()
    return jax.lax.switch(jnp.asarray(rank >= s).astype(jnp.int32), branches)  # rank - s >= 0: an earlier rank's shard


def _forward_piece(piece: Piece | None, q, k, v, scale, softcap, axis_name):
    """A branch: the piece's ``(out, lse)`` over all of this device's rows (out 0 and lse -inf
    on rows that see nothing)."""
    batch, rows, heads, _ = q.shape

    def run():
        if piece is None:
            return _varying((jnp.zeros(q.shape, q.dtype), jnp.full((batch, heads, rows), -jnp.inf, jnp.float32)), axis_name)
        out, lse = kernels["forward"](q[:, piece.q], k[:, piece.k], v[:, piece.k], piece.causal, scale, softcap)
        return _place(out, piece.q, rows, 1, 0), _place(lse, piece.q, rows, 2, -jnp.inf)

    return run


def _backward_piece(piece: Piece | None, dout, q, k, v, out, lse, dlse, scale, softcap, axis_name):
    """A branch: the piece's ``(dq, dk, dv)`` over all rows of q and of the K/V shard."""
    rows = q.shape[1]

    def run():
        if piece is None:
            return _varying((jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype)), axis_name)
        qs = piece.q
        dq, dk, dv = kernels["backward"](dout[:, qs], q[:, qs], k[:, piece.k], v[:, piece.k], out[:, qs], lse[:, :, qs], dlse[:, :, qs],
                                         piece.causal, scale, softcap)
        return _place(dq, qs, rows, 1, 0), _place(dk, piece.k, rows, 1, 0), _place(dv, piece.k, rows, 1, 0)

    return run


def _place(x, rows: slice, length: int, axis: int, fill):
    """``x``, the values of ``rows`` of ``length`` along ``axis``, padded with ``fill``."""
    start, stop, _ = rows.indices(length)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (start, length - stop)
    return jnp.pad(x, pad, constant_values=fill) if start or length - stop else x


def _varying(arrays, axis_name):
    """Constants typed as varying over the mesh axis, as the other branch's results are
    (``axis_name`` None: outside ``shard_map``)."""
    return arrays if axis_name is None else jax.lax.pcast(arrays, axis_name, to="varying")


def fold(acc, lse, out, out_lse):
    """The fp32 accumulator ``acc`` (None: empty) with lse ``lse``, and a partial ``out`` with
    ``out_lse`` folded in; rows where the partial saw nothing (lse -inf) keep their values."""
    out = out.astype(jnp.float32)
    if acc is None:
        return out, out_lse
    new = jnp.logaddexp(lse, out_lse)
    weight = lambda x: jnp.swapaxes(jnp.exp(x - new), 1, 2)[..., None]  # noqa: E731  (batch, rows, heads, 1)
    return acc * weight(lse) + out * weight(out_lse), new
