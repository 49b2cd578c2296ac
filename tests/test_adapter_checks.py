"""Argument checks of the framework adapters that need no GPU: each bad argument is named in a
TypeError / ValueError before anything runs, on the eager path and on the op path (a dispatch
mode watching makes a call take the op), and the adapters' gradient rules."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import cuattn  # noqa: E402
import cuattn.torch  # noqa: E402
from cuattn import block_mask as bm  # noqa: E402


def _qkv(grad: bool = False):
    q, k, v = (torch.ones(1, 128, 2, 64, dtype=torch.float16) for _ in range(3))
    return q.requires_grad_(grad), k, v


@pytest.mark.parametrize("grad", [False, True])
def test_dropout_with_a_block_mask_is_refused(grad):
    """The adapter took the block-sparse path first and dropped dropout_p and the seed."""
    mask = bm.local_global(128, 128, window_blocks=1).to(torch.as_tensor)
    with pytest.raises(ValueError, match="block_mask is not supported with dropout"):
        cuattn.torch.attention(*_qkv(grad), block_mask=mask, dropout_p=0.5, dropout_seed=3)
    with pytest.raises(TypeError, match="dropout_p"):
        cuattn.torch.attention(*_qkv(grad), block_mask=mask, dropout_p="junk")


@pytest.mark.parametrize("seed, error", [(-1, ValueError), (2**64, ValueError), (1.5, TypeError), ("x", TypeError)])
def test_a_bad_dropout_seed_is_named_at_dropout_p_zero(seed, error):
    """The core path checks an int seed whatever dropout_p; the adapter passed it unchecked."""
    with pytest.raises(error, match="dropout_seed"):
        cuattn.torch.attention(*_qkv(), dropout_seed=seed)
    q = torch.ones(32, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    with pytest.raises(error, match="dropout_seed"):
        cuattn.torch.attention_varlen(q, q, q, cu, cu, max_seqlen_q=16, max_seqlen_k=16, dropout_seed=seed)


@pytest.mark.parametrize("grad", [False, True])
def test_return_lse_is_checked_before_anything_runs(grad):
    """It was checked after the forward (with gradients: after the kernels; here, on the CPU,
    the device error came first)."""
    with pytest.raises(TypeError, match="return_lse"):
        cuattn.torch.attention(*_qkv(grad), return_lse=1)
    with pytest.raises(TypeError, match="return_lse"):
        cuattn.torch.attention_with_kvcache(*_qkv(), cache_seqlens=torch.zeros(1, dtype=torch.int32), return_lse="yes")


def test_a_missing_tensor_is_a_type_error():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="q must be a torch tensor, got None"):
        cuattn.torch.attention(None, k, v)
    with pytest.raises(TypeError, match="v must be a torch tensor, got ndarray"):
        cuattn.torch.attention(q, k, np.ones((1, 128, 2, 64), np.float16))
    with pytest.raises(TypeError, match="cache_seqlens must be a torch tensor"):
        cuattn.torch.attention_with_kvcache(q, k, v, cache_seqlens=None)


def test_op_paths_name_a_tensor_off_the_gpu():
    """Under a dispatch mode the calls take the registered ops, whose dispatcher said only that
    they have no CPU kernel (NotImplementedError)."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = _qkv()
    lengths = torch.zeros(1, dtype=torch.int32)
    calls = {
        "attention": lambda: cuattn.torch.attention(q, k, v),
        "dropout": lambda: cuattn.torch.attention(q, k, v, dropout_p=0.5, dropout_seed=torch.zeros(1, dtype=torch.int64)),
        "block mask": lambda: cuattn.torch.attention(q, k, v, block_mask=bm.local_global(128, 128, window_blocks=1).to(torch.as_tensor)),
        "kvcache": lambda: cuattn.torch.attention_with_kvcache(q, k, v, cache_seqlens=lengths),
        "append": lambda: cuattn.torch.append_kv(q[:, :1], v[:, :1], k, v, cache_seqlens=lengths),
    }
    for name, call in calls.items():
        with FlopCounterMode(display=False), pytest.raises(ValueError, match="is on device 'cpu'"):
            call()


def test_op_paths_name_optional_arguments_that_are_not_tensors():
    """On the op path a list or NumPy block table raised AttributeError (its .device read), and
    k_new without v_new chose the writing op, whose check came only when the graph ran."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = _qkv()
    lengths = torch.zeros(1, dtype=torch.int32)
    with FlopCounterMode(display=False):
        for name in ("block_table", "cache_batch_idx"):
            with pytest.raises(TypeError, match=f"{name} must be a torch tensor"):
                cuattn.torch.attention_with_kvcache(q, k, v, cache_seqlens=lengths, **{name: [0]})
            with pytest.raises(TypeError, match=f"{name} must be a torch tensor"):
                cuattn.torch.append_kv(q[:, :1], v[:, :1], k, v, cache_seqlens=lengths, **{name: np.zeros(1, np.int32)})
        with pytest.raises(TypeError, match="k_new and v_new go together"):
            cuattn.torch.attention_with_kvcache(q, k, v, cache_seqlens=lengths, k_new=q[:, :1])


def test_a_second_differentiation_of_the_backward_raises():
    """torch's once_differentiable lets a create_graph=True gradient through as a constant when
    the incoming gradients need none (the usual case): a gradient penalty lost its term."""
    from cuattn.torch import _once_differentiable

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, option):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        @_once_differentiable
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * x * g, None

    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(Square.apply(x, 0).sum(), x)
    assert torch.equal(g, 2 * x.detach()) and not g.requires_grad
    (g,) = torch.autograd.grad(Square.apply(x, 0).sum(), x, create_graph=True)
    assert torch.equal(g.detach(), 2 * x.detach())
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (g**2).sum().backward()


def test_jax_merge_gradient_of_an_empty_partial_is_zero_whatever_its_out():
    """A partial of lse -inf whose out holds NaN: its dlse was NaN in the JAX adapter (the torch
    adapter gave zeros)."""
    jnp = pytest.importorskip("jax.numpy")
    from cuattn.jax import _merge_vjp

    rng = np.random.default_rng(3)
    outs = [jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32), jnp.full((1, 4, 2, 8), jnp.nan, jnp.float32)]
    lses = [jnp.asarray(rng.standard_normal((1, 2, 4)), jnp.float32), jnp.full((1, 2, 4), -jnp.inf, jnp.float32)]
    out, lse = outs[0], lses[0]
    dout, dlse = jnp.asarray(rng.standard_normal((1, 4, 2, 8)), jnp.float32), jnp.asarray(rng.standard_normal((1, 2, 4)), jnp.float32)
    douts, dlses = _merge_vjp((outs, lses), (out, lse), (dout, dlse))
    assert bool(jnp.all(dlses[1] == 0)) and bool(jnp.all(douts[1] == 0))
    np.testing.assert_allclose(np.asarray(douts[0]), np.asarray(dout), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dlses[0]), np.asarray(dlse), rtol=1e-5, atol=1e-6)


def test_jax_arguments_are_checked_before_the_op():
    """return_lse was checked after the op ran, a block mask with k=None raised AttributeError,
    and a dropout_rng that is no key passed unchecked at dropout_p 0."""
    jnp = pytest.importorskip("jax.numpy")
    import cuattn.jax as cj

    q = jnp.ones((1, 128, 2, 64), jnp.float16)
    packed = jnp.ones((128, 2, 64), jnp.float16)
    cu = jnp.asarray([0, 128], jnp.int32)
    with pytest.raises(TypeError, match="return_lse"):
        cj.attention(q, q, q, return_lse=1)
    with pytest.raises(TypeError, match="return_lse"):
        cj.attention_varlen(packed, packed, packed, cu, cu, return_lse="yes")
    with pytest.raises(TypeError, match="return_lse"):
        cj.attention_with_kvcache(q, q, q, cache_seqlens=jnp.zeros(1, jnp.int32), return_lse=None)
    mask = bm.local_global(128, 128, window_blocks=1).to(jnp.asarray)
    with pytest.raises(TypeError, match="k must be an array, got NoneType"):
        cj.attention(q, None, q, block_mask=mask)
    cj._check_rng(np.array([0, 42], np.uint32))  # a raw key restored from a checkpoint: accepted
    for junk in (np.int64(3), np.array(1.5), np.array([1, 2], np.int64)):
        with pytest.raises(TypeError, match="dropout_rng must be a JAX PRNG key"):
            cj._check_rng(junk)
    for call in (lambda: cj.attention(q, q, q, dropout_rng="junk"),
                 lambda: cj.attention_varlen(packed, packed, packed, cu, cu, dropout_rng=3)):
        with pytest.raises(TypeError, match="dropout_rng must be a JAX PRNG key"):
            call()


def test_a_sparse_tensor_is_named_in_a_type_error():
    """A sparse tensor has no strides: the plan cache's read of it raised torch's RuntimeError."""
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q is a torch tensor of layout torch.sparse_coo"):
        cuattn.attention(q.to_sparse(), k, v)
    with pytest.raises(TypeError, match=r"v is a torch tensor of layout torch.sparse_coo"):
        cuattn.torch.attention(q, k, v.to_sparse())


def test_meta_tensors_take_the_ops_fake_kernels():
    """Shapes only (meta tensors) under a dispatch mode: the ops' fake kernels give the outputs'
    shapes; the device check takes meta as it takes CUDA."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = (torch.empty(1, 128, 2, 64, dtype=torch.float16, device="meta") for _ in range(3))
    with FlopCounterMode(display=False):
        out, lse = cuattn.torch.attention(q, k, v, causal=True, return_lse=True)
    assert out.device.type == "meta" and out.shape == q.shape and lse.shape == (1, 2, 128)
    with pytest.raises(ValueError, match=r"q must have 4 dimensions \(batch, seqlen, heads, head_dim\), got shape \(128, 2, 64\)"):
        with FlopCounterMode(display=False):
            cuattn.torch.attention(q[0], k, v)


def test_the_ops_trace_with_symbolic_shapes():
    """torch.compile with dynamic shapes hands the adapters a symbolic head_dim: its options
    are checked each call (they were remembered in a dict, whose store raised "unhashable type:
    non-nested SymInt")."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q = torch.empty(1, 64, 2, 64, device="meta", dtype=torch.bfloat16)
    graph = make_fx(lambda q, k, v: cuattn.torch.attention(q, k, v, causal=True), tracing_mode="symbolic")(q, q, q)
    assert any("cuattn.attention" in str(n.target) for n in graph.graph.nodes)
    t = q.transpose(1, 2)
    make_fx(lambda q, k, v: cuattn.torch.scaled_dot_product_attention(q, k, v, is_causal=True), tracing_mode="symbolic")(t, t, t)


def test_every_backward_raises_when_differentiated_again():
    """Each autograd.Function of the adapter wraps its backward in _once_differentiable (the
    ring's had torch's, which lets a create_graph=True gradient through as a constant)."""
    functions = [x for x in vars(cuattn.torch).values() if isinstance(x, type) and issubclass(x, torch.autograd.Function)]
    wrapper = cuattn.torch._once_differentiable(lambda ctx, *grads: None).__code__  # every wrapper runs this code
    assert len(functions) >= 2
    for fn in functions:
        assert fn.backward.__code__ is wrapper, fn.__name__


def test_sdpa_drop_in_names_an_argument_that_is_not_a_tensor():
    k = torch.ones(1, 2, 8, 64, dtype=torch.float16)
    for args, name in (((None, k, k), "query"), ((k, np.ones((1, 2, 8, 64)), k), "key")):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
            cuattn.torch.scaled_dot_product_attention(*args)


def test_foreign_streams_are_kept_per_device(monkeypatch):
    """CuPy's view of a torch stream is made on the call's device and cached per device: a
    default stream's handle is 0 on every device, and CuPy records the device current when a
    view is made (a review's reading; two H200s in one process ran either way)."""
    from types import SimpleNamespace

    import cupy

    from cuattn import boundary

    current = [0]

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            current.append(self.index)

        def __exit__(self, *exc):
            current.pop()

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(cupy.cuda.Stream, "from_external", staticmethod(lambda stream: (current[-1], stream.cuda_stream)))
    monkeypatch.setattr(boundary, "_external_streams", {})
    default = SimpleNamespace(cuda_stream=0)
    assert boundary._external_stream(default, 1) == (1, 0)
    assert boundary._external_stream(default, 0) == (0, 0)
    assert boundary._external_stream(default, 1) == (1, 0)


def test_forward_mode_ad_is_refused_not_dropped():
    """The ops have no jvp rule: a dual tensor's result had no tangent and torch.func.jvp
    returned zeros (torch gives a custom op without one no error); both raise, before anything
    runs, on every entry point that takes floating tensors."""
    import torch.autograd.forward_ad as fwad

    q, k, v = _qkv()
    cache_lengths = torch.zeros(1, dtype=torch.int32)
    calls = {
        "attention": lambda q: cuattn.torch.attention(q, k, v),
        "attention_varlen": lambda q: cuattn.torch.attention_varlen(q[0], k[0], v[0], *(torch.tensor([0, 128], dtype=torch.int32),) * 2),
        "attention_with_kvcache": lambda q: cuattn.torch.attention_with_kvcache(q, k, v, cache_seqlens=cache_lengths),
        "append_kv": lambda q: cuattn.torch.append_kv(q, q, k, v, cache_seqlens=cache_lengths),
        "merge": lambda q: cuattn.torch.merge([q, q], [torch.zeros(1, 2, 128), torch.zeros(1, 2, 128)]),
        "scaled_dot_product_attention": lambda q: cuattn.torch.scaled_dot_product_attention(q, k, v),
    }
    for name, call in calls.items():
        with fwad.dual_level():
            with pytest.raises(NotImplementedError, match="forward-mode"):
                call(fwad.make_dual(q, torch.ones_like(q)))
        with pytest.raises(NotImplementedError, match="forward-mode"):
            torch.func.jvp(call, (q,), (torch.ones_like(q),))
    with fwad.dual_level():  # a dual level alone, no tangent on the inputs: the call goes on (to the device check here)
        with pytest.raises(ValueError, match="CUDA"):
            cuattn.torch.attention(q, k, v)
    with pytest.raises(ValueError, match="CUDA"):  # jvp whose tangent does not reach attention's inputs: goes on too
        torch.func.jvp(lambda x: cuattn.torch.attention(q, k, v).float().sum() + x, (torch.ones(()),), (torch.ones(()),))
    with pytest.raises(NotImplementedError, match="forward-mode"):  # under vmap too
        torch.func.vmap(lambda x: torch.func.jvp(lambda y: cuattn.torch.attention(y, k, v), (x,), (torch.ones_like(x),))[1])(q[None])
    with pytest.raises(NotImplementedError, match="forward-mode"):  # vmap inside jvp (unpack_dual has no batching rule)
        torch.func.jvp(lambda x: torch.func.vmap(lambda y: cuattn.torch.attention(y, k, v))(x), (q[None],), (torch.ones_like(q[None]),))
