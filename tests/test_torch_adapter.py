"""cuattn.torch: gradients against float64, opcheck, torch.compile, streams, the SDPA drop-in."""

import math

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cuattn.torch as ct  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _reference(q, k, v, causal=False, scale=None, align="bottom_right", window=None):
    """Textbook attention with lse on (batch, seqlen, heads, head_dim), in the inputs' dtype."""
    sq, sk, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bmhd,bnhd->bhmn", q, k) * scale
    offset = sk - sq if align == "bottom_right" else 0
    rows, cols = torch.arange(sq, device=q.device)[:, None], torch.arange(sk, device=q.device)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= cols <= rows + offset
    if window is not None:
        visible &= cols >= rows + offset - window[0]
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhmn,bnhd->bmhd", p.to(v.dtype), v), lse


def _inputs(shape_q, shape_kv, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda shape: torch.randn(shape, generator=g, device="cuda", dtype=torch.float64)  # noqa: E731
    return [make(s) for s in (shape_q, shape_kv, shape_kv)]


def _grads(fn, inputs, dtype, weights):
    xs = [x.detach().to(dtype).clone().requires_grad_() for x in inputs]
    outs = fn(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights))
    loss.backward()
    return [o.detach().double() for o in outs], [x.grad.double() for x in xs]


def _err(a, b) -> float:
    assert not torch.isnan(a).any()
    return float((a - b).abs().max())


def _assert_matches(fn, yardstick, inputs, dtype, weights, out_factor=2.0, grad_factor=3.0):
    """FlashAttention's criterion: error against float64 at most factor x the error of the same
    computation done by PyTorch in the input precision (plus a small floor)."""
    ref_outs, ref_grads = _grads(yardstick, inputs, torch.float64, weights)
    base_outs, base_grads = _grads(yardstick, inputs, dtype, weights)
    outs, grads = _grads(fn, inputs, dtype, weights)
    for name, x, base, ref, factor in [
        *((f"out{i}", o, b, r, out_factor) for i, (o, b, r) in enumerate(zip(outs, base_outs, ref_outs))),
        *((f"d{n}", g, b, r, grad_factor) for n, g, b, r in zip("qkv", grads, base_grads, ref_grads)),
    ]:
        assert _err(x, ref) <= factor * _err(base, ref) + 1e-5, f"{name}: {_err(x, ref):.3e} vs base {_err(base, ref):.3e}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_sdpa_autograd(dtype, causal):
    """cuattn.torch.attention against SDPA's autograd in the same dtype, both judged against
    float64; GQA, seqlen_q != seqlen_k (top-left, SDPA's alignment)."""
    inputs = _inputs((2, 97, 8, 64), (2, 160, 2, 64), dtype)
    w = torch.randn(2, 97, 8, 64, device="cuda", dtype=torch.float64)

    def sdpa(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True
        )
        return out.transpose(1, 2)

    _assert_matches(lambda q, k, v: ct.attention(q, k, v, causal=causal, align="top_left"), sdpa, inputs, DTYPES[dtype], [w])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradients_flow_through_lse(dtype):
    inputs = _inputs((1, 113, 4, 128), (1, 113, 4, 128), dtype, seed=1)
    weights = [torch.randn(1, 113, 4, 128, device="cuda", dtype=torch.float64), torch.randn(1, 4, 113, device="cuda", dtype=torch.float64)]
    _assert_matches(
        lambda q, k, v: ct.attention(q, k, v, causal=True, window=(40, None), return_lse=True),
        lambda q, k, v: _reference(q, k, v, causal=True, window=(40, None)),
        inputs, DTYPES[dtype], weights,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_partials_match_full_attention_with_gradients(dtype):
    """Attention over two key halves merged with cuattn.torch.merge: out and gradients of the
    whole (the merge differentiates through out and lse)."""
    inputs = _inputs((1, 64, 4, 64), (1, 200, 2, 64), dtype, seed=2)
    w = torch.randn(1, 64, 4, 64, device="cuda", dtype=torch.float64)

    def halves(q, k, v):
        parts = [ct.attention(q, k[:, s], v[:, s], return_lse=True) for s in (slice(0, 120), slice(120, None))]
        return ct.merge([p[0] for p in parts], [p[1] for p in parts])[0]

    _assert_matches(halves, lambda q, k, v: _reference(q, k, v)[0], inputs, DTYPES[dtype], [w])


def test_merge_gradients_ignore_what_an_empty_partial_holds():
    """A partial of lse -inf contributes nothing whatever its out holds (NaN included): its
    gradients are zeros and the others' are finite (its dlse was 0 * NaN = NaN)."""
    outs = [torch.randn(1, 8, 2, 16, device="cuda", requires_grad=True) for _ in range(2)]
    lses = [torch.randn(1, 2, 8, device="cuda") for _ in range(2)]
    with torch.no_grad():
        outs[0][0, 3, 1] = float("nan")
        lses[0][0, 1, 3] = float("-inf")
    lses = [x.requires_grad_() for x in lses]
    out, lse = ct.merge(outs, lses)
    (out.square().sum() + lse.sum()).backward()
    for x in (*outs, *lses):
        assert torch.isfinite(x.grad).all(), x.grad
    assert lses[0].grad[0, 1, 3] == 0 and (outs[0].grad[0, 3, 1] == 0).all()
    assert torch.isfinite(out).all()


def test_double_backward_through_the_ops_raises():
    """The kernels' backward is not differentiable. On the op path (varlen with gradients) a
    graph of it (create_graph=True) gave zeros when differentiated, with a warning; now it
    raises, as the eager path does."""
    q, k, v = (torch.randn(32, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 10, 32], dtype=torch.int32, device="cuda")
    out = ct.attention_varlen(q, k, v, cu, cu, max_seqlen_q=22, max_seqlen_k=22)
    dq, = torch.autograd.grad(out.float().square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.float().square().sum().backward()


def test_opcheck():
    q = torch.randn(2, 33, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 40, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 40, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    plain = dict(causal=True, window_left=-1, window_right=-1, align="bottom_right", scale=0.125, softcap=0.0, sink_tokens=0)
    for options in (plain, {**plain, "window_left": 8, "window_right": 0, "sink_tokens": 4}):  # one key range, and two
        torch.library.opcheck(ct.op("attention"), (q, k, v), options)
        out, lse = ct.op("attention")(q.detach(), k.detach(), v.detach(), **options)
        dout = torch.randn_like(out)
        torch.library.opcheck(ct.op("attention_backward"), (dout, q.detach(), k.detach(), v.detach(), out, lse, None), {**options, "deterministic": True})
    outs = [torch.randn(1, 5, 2, 32, device="cuda", requires_grad=True) for _ in range(3)]
    lses = [torch.randn(1, 2, 5, device="cuda", requires_grad=True) for _ in range(3)]
    torch.library.opcheck(ct.op("merge"), (outs, lses))


class _Block(torch.nn.Module):
    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).unbind(2)
        return x + self.proj(ct.attention(q, k, v, causal=True).reshape(b, s, -1))


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    block = _Block().cuda().to(torch.bfloat16)
    x = torch.randn(2, 100, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True)
    results = []
    for model in (block, compiled):
        x.grad = None
        block.zero_grad()
        y = model(x)
        y.float().square().mean().backward()
        results.append((y.detach().float(), x.grad.float(), block.qkv.weight.grad.float()))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_algorithms_pick_the_atomic_free_backward(monkeypatch, deterministic):
    """torch.use_deterministic_algorithms(True) gives bit-identical gradients (no dQ atomics);
    otherwise Hopper runs the one-pass backward."""
    from cuattn import loader

    launched = []  # the variants each new launch plan loads (plans are recorded afresh per test)
    load = loader.load_kernel
    monkeypatch.setattr(loader, "load_kernel", lambda variant: launched.append(variant.kernel) or load(variant))
    q, k, v = (torch.randn(1, 300, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 300, 4, 128, device="cuda", dtype=torch.bfloat16)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        runs = [torch.autograd.grad(ct.attention(q, k, v, causal=True), (q, k, v), dout) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(saved)
    fused = loader.device_arch() == "sm_90a" and not deterministic
    assert bool({"backward_tma", "backward_wgmma_fused"} & set(launched)) == fused  # the one-pass kernels
    if deterministic:
        for later in runs[1:]:
            for a, b in zip(runs[0], later):
                assert torch.equal(a, b)


def test_runs_on_the_current_non_default_stream():
    """Inputs finish on a side stream after a long sleep; cuattn must queue behind them there."""
    q0, k0, v0 = (torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    expected = ct.attention(q0, k0, v0)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        q, k, v = q0 * 1, k0 * 1, v0 * 1
        out = ct.attention(q, k, v)
    side.synchronize()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads_kv, causal, sk, scale", [(8, False, 128, None), (2, True, 200, 0.3), (1, True, 77, None)])
def test_sdpa_drop_in(dtype, heads_kv, causal, sk, scale):
    """SDPA's (batch, heads, seqlen, head_dim) layout, is_causal (top-left), scale, enable_gqa;
    outputs and gradients against float64 SDPA, judged against SDPA in the same dtype."""
    inputs = [x.transpose(1, 2) for x in _inputs((2, 150, 8, 64), (2, sk, heads_kv, 64), dtype, seed=3)]
    w = torch.randn(2, 8, 150, 64, device="cuda", dtype=torch.float64)
    kwargs = dict(is_causal=causal, scale=scale, enable_gqa=heads_kv != 8)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    _assert_matches(lambda q, k, v: ct.scaled_dot_product_attention(q, k, v, **kwargs), lambda q, k, v: sdpa(q, k, v, **kwargs), inputs, DTYPES[dtype], [w])
    out = ct.scaled_dot_product_attention(*(x.to(DTYPES[dtype]) for x in inputs), **kwargs)
    assert out.shape == (2, 8, 150, 64) and out.transpose(1, 2).is_contiguous()  # a view of cuattn's layout


def test_sdpa_drop_in_rejects_what_it_does_not_cover():
    q = torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        ct.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match="dropout_p"):
        ct.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match="enable_gqa"):
        ct.scaled_dot_product_attention(q, k, k)


def test_an_int_dropout_seed_needs_no_host_synchronization():
    """An int seed becomes a device tensor by a fill kernel: the copy from host memory it was
    made by waited for the stream (torch's sync debug mode reports that) and could not be
    captured in a CUDA graph. The same seed gives the same result."""
    q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    first = ct.attention(q, q, q, dropout_p=0.1, dropout_seed=2**63 + 5)  # kernels compiled, plans recorded
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = ct.attention(q, q, q, dropout_p=0.1, dropout_seed=2**63 + 5)
        with torch.no_grad():
            eager = ct.attention(q, q, q, dropout_p=0.1, dropout_seed=2**63 + 5)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(eager, first, rtol=0, atol=0)


@pytest.mark.parametrize("replayed", [True, False])
def test_calls_on_two_devices_in_one_process(monkeypatch, replayed):
    """Tensors on cuda:0, then cuda:1, then cuda:0 again, replayed or on the full path (which
    wraps torch's default stream, handle 0 on every device, for CuPy once per device)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from cuattn import replay

    monkeypatch.setattr(replay, "enabled", replayed)
    for device in ("cuda:0", "cuda:1", "cuda:0"):
        q, k, v = (torch.randn(1, 64, 4, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
        out = ct.attention(q, k, v, causal=True)
        ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)
        assert out.device == q.device
        torch.testing.assert_close(out, ref, rtol=0, atol=2e-2)


@pytest.mark.parametrize("traced", [False, True])
def test_cache_writes_bump_versions_and_refuse_gradients(traced):
    """Writes into the KV cache are in place: autograd must see them (a backward that saved the
    cache's old values raises, as after any in-place op), and the decoding calls, which have no
    backward, refuse inputs that require grad instead of returning detached results. Traced:
    the registered ops (a dispatch mode watching)."""
    import contextlib

    from torch.utils.flop_counter import FlopCounterMode

    mode = (lambda: FlopCounterMode(display=False)) if traced else contextlib.nullcontext
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.float16)
    k_cache, v_cache = (torch.randn(2, 16, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    k_new, v_new = (torch.randn(2, 1, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    lengths = torch.tensor([3, 9], dtype=torch.int32, device="cuda")
    w = torch.randn(2, 16, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    for call in (
        lambda: ct.append_kv(k_new, v_new, k_cache, v_cache, cache_seqlens=lengths),
        lambda: ct.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k_new=k_new, v_new=v_new),
    ):
        saved = (w * k_cache).sum()  # saves k_cache for its backward
        before = (k_cache._version, v_cache._version)
        with mode():
            call()
        assert k_cache._version > before[0] and v_cache._version > before[1]
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.backward()
    with torch.inference_mode():  # inference tensors have no version counter: written as before
        k_inf, v_inf = k_cache.clone(), v_cache.clone()
        ct.append_kv(k_new, v_new, k_inf, v_inf, cache_seqlens=lengths)
    with mode():
        with pytest.raises(NotImplementedError, match="q requires grad"):
            ct.attention_with_kvcache(q.clone().requires_grad_(), k_cache, v_cache, cache_seqlens=lengths)
        with pytest.raises(NotImplementedError, match="k_cache requires grad"):
            ct.append_kv(k_new, v_new, k_cache.clone().requires_grad_(), v_cache, cache_seqlens=lengths)
    with torch.no_grad():
        ct.attention_with_kvcache(q.clone().requires_grad_(), k_cache, v_cache, cache_seqlens=lengths)


def test_a_broadcast_incoming_gradient_is_read_as_it_is():
    """A loss weighted by a tensor broadcast over batch, rows and heads hands the backward a
    view of strides (0, 0, 0, 1): read in place, with the gradients of a contiguous copy."""
    q, k, v = (x.to(torch.bfloat16) for x in _inputs((2, 77, 4, 64), (2, 77, 4, 64), torch.bfloat16, seed=3))
    w = torch.randn(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16)
    grads = []
    for dense in (False, True):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = ct.attention(*xs, causal=True)
        dout = w.expand_as(out)
        out.backward(dout.contiguous() if dense else dout)
        grads.append([x.grad for x in xs])
    assert w.expand_as(q).stride() == (0, 0, 0, 1)
    for a, b in zip(*grads):  # equal up to the order of dQ's fp32 atomic sums
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("replayed", [True, False])
def test_in_place_writes_of_the_core_calls_bump_versions(monkeypatch, replayed):
    """cuattn.merge_ and the calls' out= write torch tensors in place: a backward that saved
    them raises, as after torch's in-place ops, where it read the new values silently (the
    replayed plans and the full path, CUATTN_REPLAY=0); a call refused before its launch leaves
    the version as it was."""
    import cuattn
    from cuattn import replay

    monkeypatch.setattr(replay, "enabled", replayed)

    q, k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    out_b, lse_b = cuattn.attention(q, k.flip(1), v, return_lse=True)
    for write in (lambda: cuattn.merge_(out, lse, out_b, lse_b), lambda: cuattn.attention(q, k, v, out=out)):
        for _ in range(2):  # the first call (replayed: recorded, then run as the plan), a second
            w = torch.randn_like(out, requires_grad=True)
            saved = (w * out).sum()
            version = out._version
            write()
            assert out._version > version
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                saved.backward()
    version = out._version
    with pytest.raises(ValueError):
        cuattn.merge_(out, lse, out_b, lse_b[:, :1])
    assert out._version == version
