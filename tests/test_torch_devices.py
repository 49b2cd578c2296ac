"""cuattn.torch with tensors off the GPU: each entry point names the argument in a ValueError
before the dispatcher (which would say only that the op has no CPU kernel), whatever path the
call takes (eager, gradients, a learnable sink). No GPU needed."""

import pytest

torch = pytest.importorskip("torch")
import cuattn.torch  # noqa: E402


def _qkv(grad: bool):
    q, k, v = (torch.ones(2, 16, 4, 64, dtype=torch.float16) for _ in range(3))
    return q.requires_grad_(grad), k, v


@pytest.mark.parametrize("grad", [False, True])
def test_a_learnable_sink_takes_the_eager_path(grad):
    """An nn.Parameter sink was taken for a traced call: with dropout it raised 'traced
    cuattn.torch.attention takes sink or dropout, not both', though the call was eager."""
    q, k, v = _qkv(grad)
    sink = torch.nn.Parameter(torch.zeros(4))
    for kw in ({}, {"dropout_p": 0.1, "dropout_seed": 3}):
        with pytest.raises(ValueError, match="q is on device 'cpu'"):
            cuattn.torch.attention(q, k, v, sink=sink, **kw)


@pytest.mark.parametrize("grad", [False, True])
def test_varlen_with_gradients_names_the_argument(grad):
    q, k, v = (torch.ones(32, 4, 64, dtype=torch.float16).requires_grad_(grad) for _ in range(3))
    cu = torch.tensor([0, 16, 32], dtype=torch.int32)
    with pytest.raises(ValueError, match="q is on device 'cpu'"):
        cuattn.torch.attention_varlen(q, k, v, cu, cu, max_seqlen_q=16, max_seqlen_k=16)


@pytest.mark.parametrize("grad", [False, True])
def test_merge_with_gradients_names_the_argument(grad):
    outs = [torch.ones(1, 8, 2, 16).requires_grad_(grad) for _ in range(2)]
    lses = [torch.zeros(1, 2, 8) for _ in range(2)]
    with pytest.raises(ValueError, match=r"outs\[0\] is on device 'cpu'|on device 'cpu'"):
        cuattn.torch.merge(outs, lses)
