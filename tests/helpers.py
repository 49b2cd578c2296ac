"""Shared test helpers: random inputs, the accuracy criterion, poisoned allocators."""

from __future__ import annotations

import contextlib
import os

import numpy as np

from cuattn.dtypes import BFLOAT16

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "float32": np.dtype(np.float32)}


def randn(rng, shape, dtype, scale=1.0) -> np.ndarray:
    """Fresh standard-normal values (never zeros) in the given dtype."""
    return (rng.standard_normal(shape) * scale).astype(DTYPES.get(dtype, dtype))


def max_err(x, ref) -> float:
    x = np.asarray(x, dtype=np.float64)
    assert not np.isnan(x).any(), "NaN in result"
    return float(np.max(np.abs(x - ref))) if x.size else 0.0


def assert_close_to_rounding(result, ref, dtype, factor=2.0, floor=1e-6):
    """Error at most ``factor`` times that of rounding the float64 reference to ``dtype``."""
    rounded = np.asarray(ref).astype(DTYPES.get(dtype, dtype)).astype(np.float64)
    bound = factor * max_err(rounded, ref) + floor * max(1.0, float(np.max(np.abs(ref))) if np.size(ref) else 1.0)
    err = max_err(result, ref)
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e}"


def poison_cupy_pool(nbytes: int = 64 << 20) -> None:
    """Leave NaN-filled blocks in CuPy's memory pool so that unwritten outputs show as NaN."""
    import cupy

    for size in (nbytes, nbytes // 16, nbytes // 256, 4096, 512):
        cupy.full(size // 4, np.nan, dtype=np.float32)
    cupy.cuda.get_current_stream().synchronize()


def poison_torch_cache(nbytes: int = 64 << 20) -> None:
    import torch

    for size in (nbytes, nbytes // 16, nbytes // 256, 4096, 512):
        torch.full((size // 4,), float("nan"), device="cuda")
    torch.cuda.synchronize()


def to_host(x) -> np.ndarray:
    """Any framework's array as a float64 NumPy array."""
    module = type(x).__module__
    if module.startswith("cupy"):
        x = x.get()
    elif module.startswith("torch"):
        x = x.detach().float().cpu().numpy()
    elif module.startswith(("jax", "jaxlib")):
        x = np.asarray(x)
    return np.asarray(x).astype(np.float64)


def _naive_probs(q, k, rnd, causal, window, align, scale, softcap, sink=None, sink_tokens=0, keep=None):
    """(capped scores, probabilities, scale) of naive attention on fp32 q and head-expanded k;
    with ``sink`` (per head) the probabilities of the sink column come last along the keys;
    ``keep``: a further element mask, (batch or 1, heads or 1, seqlen_q, seqlen_k) bool."""
    import math

    from cuattn import reference

    scale = 1 / math.sqrt(q.shape[3]) if scale is None else scale
    s = rnd(np.einsum("bmhd,bnhd->bhmn", q, k) * np.float32(scale))
    if softcap:
        s = rnd(softcap * np.tanh(s / softcap))
    sq, sk = q.shape[1], k.shape[1]
    left, right = reference.window_bounds(causal, window)
    ok = reference.visible(np.arange(sq), np.arange(sk), reference.diagonal_offset(sq, sk, align), left, right, sink_tokens)
    sm = np.where(ok if keep is None else ok & keep, s, -np.inf)
    if sink is not None:
        sm = np.concatenate([sm, np.broadcast_to(np.asarray(sink, np.float32)[None, :, None, None], (*sm.shape[:3], 1))], axis=-1)
    m = sm.max(-1, keepdims=True)
    e = np.exp(sm - np.where(np.isfinite(m), m, 0))
    den = e.sum(-1, keepdims=True)
    return s, rnd(e / np.where(den > 0, den, 1)), scale


def naive_attention(q, k, v, dtype, causal=False, window=None, align="bottom_right", scale=None, softcap=None, sink=None, sink_tokens=0,
                    dropout=None, keep=None):
    """Textbook attention done in the input precision (products accumulated in fp32, every
    intermediate rounded to ``dtype``): the yardstick of the FlashAttention test criterion.
    ``dropout``: (batch, heads_q, seqlen_q, seqlen_k) weights (kept / kept fraction, 0);
    ``keep``: an element mask (a block mask's elements)."""
    dt = DTYPES[dtype]
    rnd = lambda x: np.asarray(x, np.float32).astype(dt).astype(np.float32)  # noqa: E731
    q, k, v = (np.asarray(x).astype(np.float32) for x in (q, k, v))
    hq, hk = q.shape[2], k.shape[2]
    k, v = np.repeat(k, hq // hk, axis=2), np.repeat(v, hq // hk, axis=2)
    _, p, _ = _naive_probs(q, k, rnd, causal, window, align, scale, softcap, sink, sink_tokens, keep)
    p = p[..., : k.shape[1]] if dropout is None else rnd(p[..., : k.shape[1]] * dropout)
    return rnd(np.einsum("bhmn,bnhd->bmhd", p, v))


def assert_attention_accuracy(out, ref, naive, factor=2.0, floor=1e-5):
    """FlashAttention's criterion: max error against float64 at most ``factor`` times that of
    the naive same-precision computation (plus a small floor for near-exact cases)."""
    err = max_err(out, ref)
    bound = factor * max_err(naive, ref) + floor
    assert err <= bound, f"max error {err:.3e} > {factor} x naive {max_err(naive, ref):.3e} + {floor}"


def result_ulp(ref, dtype) -> float:
    """One unit in the last place of ``dtype`` at the reference's largest magnitude: what one
    rounding of the exact result to ``dtype`` can cost."""
    import ml_dtypes

    largest = float(np.max(np.abs(ref))) if np.size(ref) else 0.0
    if largest == 0.0:
        return 0.0
    return 2.0 ** np.floor(np.log2(largest)) * float(ml_dtypes.finfo(DTYPES.get(dtype, dtype)).eps)


def naive_attention_backward(dout, q, k, v, dtype, causal=False, window=None, align="bottom_right", scale=None, softcap=None, dlse=None,
                             sink=None, sink_tokens=0, dropout=None, keep=None):
    """Textbook autograd of :func:`naive_attention` in the input precision (fp32 products,
    every intermediate rounded to ``dtype``): the yardstick for backward accuracy. With
    ``sink``, also its gradient (summed in fp32)."""
    dt = DTYPES[dtype]
    rnd = lambda x: np.asarray(x, np.float32).astype(dt).astype(np.float32)  # noqa: E731
    dout, q, k, v = (np.asarray(x).astype(np.float32) for x in (dout, q, k, v))
    hq, hk = q.shape[2], k.shape[2]
    group = hq // hk
    ke, ve = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    sk = k.shape[1]
    s, p, scale = _naive_probs(q, ke, rnd, causal, window, align, scale, softcap, sink, sink_tokens, keep)
    p, p_sink = p[..., :sk], p[..., sk:]
    dv = rnd(np.einsum("bhmn,bmhd->bnhd", p if dropout is None else rnd(p * dropout), dout))
    dp = rnd(np.einsum("bmhd,bnhd->bhmn", dout, ve))
    if dropout is not None:
        dp = rnd(dp * dropout)
    row = (dp * p).sum(-1, keepdims=True)
    if dlse is not None:
        row = row - np.asarray(dlse, np.float32)[..., None]
    ds = rnd(p * (dp - row))
    if softcap:
        ds = rnd(ds * (1 - (s / softcap) ** 2))
    dq = rnd(np.einsum("bhmn,bnhd->bmhd", ds, ke) * np.float32(scale))
    dk = rnd(np.einsum("bhmn,bmhd->bnhd", ds, q) * np.float32(scale))
    b, _, _, d = k.shape
    dk = rnd(dk.reshape(b, sk, hk, group, d).sum(3))
    dv = rnd(dv.reshape(b, sk, hk, group, v.shape[3]).sum(3))
    if sink is None:
        return dq, dk, dv
    return dq, dk, dv, -(p_sink * row).sum(axis=(0, 2, 3))


def torch_attention_grads(fn, q, k, v, w):
    """``fn``'s output on bf16 CUDA copies of ``q``, ``k``, ``v`` and the gradients of
    ``sum(out * w)``, as float NumPy arrays."""
    import torch

    xs = [torch.from_numpy(np.asarray(x, np.float32)).cuda().bfloat16().requires_grad_() for x in (q, k, v)]
    out = fn(*xs)
    (out.float() * torch.from_numpy(w).cuda()).sum().backward()
    return out.detach().float().cpu().numpy(), [x.grad.float().cpu().numpy() for x in xs]


# The kernels a GPU test can ask for: "default" is what cuattn picks for the device (the wgmma
# kernel on Hopper for f16/bf16 head dims 33-64 and 97-128) for problems of any size;
# "portable" switches the Hopper kernels off, so the mma.sync kernels run there too; "small"
# lets small backward calls take their one-launch kernel (backward_small.cu), which the other
# paths switch off so that their kernels are the ones tested on small problems; "copying" keeps
# dense Hopper forwards on the wgmma kernel that copies its own tiles instead of the TMA kernel.
KERNEL_PATHS = ("default", "portable")
_PATH_ENV = {
    "CUATTN_WGMMA": {"portable": "0"}, "CUATTN_TMA": {"copying": "0"},
    "CUATTN_SMALL_BACKWARD": {"default": "0", "deterministic": "0", "portable": "0", "copying": "0"},
}


@contextlib.contextmanager
def kernel_path(path: str):
    saved = {name: os.environ.get(name) for name in _PATH_ENV}
    for name, values in _PATH_ENV.items():
        if path in values:
            os.environ[name] = values[path]
        else:
            os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def ragged_lengths(values, max_size):
    """A hypothesis strategy of packed batches: (query lengths, key lengths), as many of each,
    drawn from ``values`` (varlen tests)."""
    from hypothesis import strategies as st

    lengths = st.lists(st.sampled_from(values), min_size=1, max_size=max_size)
    return st.tuples(lengths, lengths).map(lambda ab: (ab[0], (ab[1] * len(ab[0]))[: len(ab[0])]))


VARLEN_HEADS = [(1, 1), (4, 4), (8, 1), (6, 2)]  # (heads_q, heads_kv) the varlen tests draw


def group_edge_heads(heads_q: int, heads_kv: int) -> list[int]:
    """The first and last query head of each KV head's group: where a wrong query-to-KV head
    mapping shows. Query heads ``q[..., heads, :]`` with all of k and v are a GQA problem of
    their own (as many heads per group), so the float64 reference can run on these alone."""
    group = heads_q // heads_kv
    return sorted({g * group + i for g in range(heads_kv) for i in (0, group - 1)})


def assert_every_kernel_path_has_form(suffix: str, expression_tail: str, **form):
    """On every target, dtype, bucket and softcap, the forward kernel and every gradient kernel
    of both backward modes selected with ``form`` (``dropout=True``, ``sparse=True``) are its
    form: URIs ending in ``suffix``, the forward's template arguments in ``expression_tail``;
    without ``form`` the forward is not."""
    from cuattn.kernels import backward as backward_plan, forward as forward_plan
    from cuattn.kernels.backward import BackwardGrid

    for arch in ("sm_80", "sm_86", "sm_90a"):
        for c_type in ("f16", "bf16", "float"):
            for bucket in (32, 64, 128, 256):
                for softcap in (False, True):
                    v = forward_plan.select(c_type, bucket, softcap, arch, **form)
                    assert v.uri.endswith(suffix) and v.expression.endswith(expression_tail)
                    assert not forward_plan.select(c_type, bucket, softcap, arch).uri.endswith(suffix)
                    g = BackwardGrid("dense", 2, 300, 300, 4, 2, bucket, 600, 600)
                    for fused in (False, True) if c_type != "float" else (False,):
                        if fused and backward_plan.select_fused(c_type, bucket, softcap, arch, **form) is None:
                            continue
                        plan = backward_plan.launches(g, c_type, softcap, arch, True, 232448, fused, **form)
                        gradient_kernels = [variant for variant, _ in plan if "prep" not in variant.uri and "finish" not in variant.uri]
                        assert gradient_kernels and all(variant.uri.endswith(suffix) for variant in gradient_kernels)
