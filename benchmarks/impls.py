"""The implementations the benchmark suite times, each built for one case on input sets.

Every builder returns ``(fn, clock)``: ``fn(i)`` runs the case on input set ``i`` and ``clock``
says how it is timed: "torch" (CUDA events on torch's current stream, GPU work only; cuattn
runs there too), "cupy" (events on CuPy's stream) or "wall" (JAX: back-to-back dispatches,
one block at the end). A builder raises :class:`Skip` with a reason when the implementation
cannot run the case (unsupported, or its O(seqlen^2) scores would not fit)."""

from __future__ import annotations

from benchmarks.cases import Case

# Bytes of materialized fp32 scores beyond which the O(seqlen^2) peers (SDPA math, JAX xla,
# naive CuPy) are skipped: past it they are slow, and the whole grid must run in minutes.
SCORES_LIMIT = 2 << 30


class Skip(Exception):
    pass


def torch_inputs(case: Case, sets: int):
    import torch

    dtype = getattr(torch, case.dtype)
    make = lambda s, h: torch.randn(case.batch, s, h, case.head_dim, device="cuda", dtype=dtype)  # noqa: E731
    return [
        (make(case.seqlen_q, case.heads_q), make(case.seqlen_k, case.heads_kv), make(case.seqlen_k, case.heads_kv), make(case.seqlen_q, case.heads_q))
        for _ in range(sets)
    ]


def _check_scores(case: Case) -> None:
    nbytes = 4 * case.batch * case.heads_q * case.seqlen_q * case.seqlen_k
    if nbytes > SCORES_LIMIT:
        raise Skip(f"materialized scores would take {nbytes / 2**30:.0f} GiB")


def cuattn_impl(case: Case, inputs):
    import cuattn

    kw = dict(causal=case.causal)
    if case.mode == "decode":  # the decode call: the cache read once per KV head, split over the keys
        import torch

        lengths = torch.full((case.batch,), case.seqlen_k, dtype=torch.int32, device=inputs[0][0].device)
        return (lambda i: cuattn.attention_with_kvcache(*inputs[i][:3], cache_seqlens=lengths, **kw)), "torch"
    if case.mode == "fwd":
        return (lambda i: cuattn.attention(*inputs[i][:3], **kw)), "torch"
    saved = [cuattn.attention(*x[:3], return_lse=True, **kw) for x in inputs]
    if case.mode == "bwd":
        return (lambda i: cuattn.attention_backward(inputs[i][3], *inputs[i][:3], *saved[i], **kw)), "torch"

    def fwdbwd(i):
        q, k, v, do = inputs[i]
        out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
        cuattn.attention_backward(do, q, k, v, out, lse, **kw)

    return fwdbwd, "torch"


def sdpa_impl(backend_name: str):
    def build(case: Case, inputs):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        if backend_name == "MATH":
            _check_scores(case)
        backend = getattr(SDPBackend, backend_name)
        gqa = case.heads_q != case.heads_kv
        views = [tuple(x.transpose(1, 2) for x in s) for s in inputs]  # SDPA layout, strided views

        def forward(q, k, v):
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=case.causal, enable_gqa=gqa)

        try:  # refusals show up at the first call
            with torch.no_grad():
                forward(*views[0][:3])
        except RuntimeError as exc:
            raise Skip(str(exc).splitlines()[0][:80]) from None
        if case.mode in ("fwd", "decode"):
            def run(i):
                with torch.no_grad():
                    forward(*views[i][:3])
            return run, "torch"
        leaves = [tuple(x.detach().requires_grad_() for x in s[:3]) for s in views]
        if case.mode == "bwd":
            outs = [forward(*leaf) for leaf in leaves]
            return (lambda i: torch.autograd.grad(outs[i], leaves[i], views[i][3], retain_graph=True)), "torch"
        return (lambda i: torch.autograd.grad(forward(*leaves[i]), leaves[i], views[i][3])), "torch"

    return build


def jax_impl(implementation: str):
    def build(case: Case, inputs):
        import jax
        import jax.numpy as jnp

        if implementation == "xla":
            _check_scores(case)
        arrays = [tuple(jnp.from_dlpack(x) for x in s) for s in inputs]  # zero-copy from torch

        def forward(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=case.causal, implementation=implementation)

        if case.mode in ("fwd", "decode"):
            fn = jax.jit(forward)
            call = lambda i: fn(*arrays[i][:3])  # noqa: E731
        elif case.mode == "bwd":
            # The vjp closure is a pytree of its residuals: passed as an argument, not baked
            # into the program as constants.
            vjps = [jax.vjp(forward, *a[:3])[1] for a in arrays]
            apply = jax.jit(lambda vjp, do: vjp(do))
            call = lambda i: apply(vjps[i], arrays[i][3])  # noqa: E731
        else:
            loss = lambda q, k, v, do: (forward(q, k, v).astype(jnp.float32) * do).sum()  # noqa: E731
            fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            call = lambda i: fn(*arrays[i])  # noqa: E731
        try:
            jax.block_until_ready(call(0))
        except Exception as exc:  # noqa: BLE001 - XLA raises its own types for unsupported cases
            raise Skip(str(exc).splitlines()[0][:80]) from None
        return call, "wall"

    return build


def naive_cupy_impl(case: Case, inputs):
    """Textbook attention in CuPy: scores materialized, softmax, then P V (forward only). CuPy's
    matmul has no bfloat16, so bfloat16 cases run it in float16 (same size, same tensor cores)."""
    import cupy
    import torch

    if case.mode != "fwd":
        raise Skip("forward only")
    _check_scores(case)
    group = case.heads_q // case.heads_kv
    arrays = [tuple(cupy.from_dlpack(x.transpose(1, 2).to(torch.float16)) for x in s[:3]) for s in inputs]
    scale = case.head_dim ** -0.5
    mask = None
    if case.causal:
        mask = cupy.triu(cupy.ones((case.seqlen_q, case.seqlen_k), dtype=bool), 1)

    def run(i):
        q, k, v = arrays[i]
        if group > 1:
            k, v = cupy.repeat(k, group, axis=1), cupy.repeat(v, group, axis=1)
        s = cupy.matmul(q, k.transpose(0, 1, 3, 2)).astype(cupy.float32) * scale
        if mask is not None:
            s[..., mask] = -cupy.inf
        s -= s.max(-1, keepdims=True)
        p = cupy.exp(s, out=s)
        p /= p.sum(-1, keepdims=True)
        return cupy.matmul(p.astype(q.dtype), v)

    try:
        run(0)
    except Exception as exc:  # noqa: BLE001 - CuPy raises its own types for unsupported dtypes
        raise Skip(str(exc).splitlines()[0][:80]) from None
    return run, "cupy"


IMPLEMENTATIONS = {
    "cuattn": cuattn_impl,
    "sdpa_flash": sdpa_impl("FLASH_ATTENTION"),
    "sdpa_cudnn": sdpa_impl("CUDNN_ATTENTION"),
    "sdpa_efficient": sdpa_impl("EFFICIENT_ATTENTION"),
    "sdpa_math": sdpa_impl("MATH"),
    "jax_cudnn": jax_impl("cudnn"),
    "jax_xla": jax_impl("xla"),
    "naive_cupy": naive_cupy_impl,
}
