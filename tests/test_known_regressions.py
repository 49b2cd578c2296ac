"""Regressions a review of the 2026-11-27 changes found after that session's last GPU run (the
package could not change again without one). Each is a strict xfail: it fails the suite once
the behaviour is restored, so the fix also removes the mark. No GPU needed."""

import random
from types import SimpleNamespace

import numpy as np
import pytest

from cuattn import block_mask as bm, boundary, chunked


@pytest.mark.xfail(raises=ValueError, strict=True, reason="check_qkv's row limit also runs on chunked._prepare's whole-pair shape check")
def test_an_unmasked_pair_of_more_than_2_to_the_31_keys_streams():
    """Without a mask any number of keys streams (chunked._mask_fields); the limit of 2**31 - 256
    rows per sequence belongs to what one kernel sees (a chunk), not to the pair."""
    base = np.zeros(16, np.float16)
    keys = 2**31
    k = np.lib.stride_tricks.as_strided(base, (1, keys, 1, 8), (keys * 16, 16, 16, 2))
    q = SimpleNamespace(shape=(1, 16, 1, 8), dtype=np.dtype(np.float16))
    boundary.trace(chunked.attention_chunked, q, (k, k))


@pytest.mark.xfail(raises=TypeError, strict=True, reason="BlockMask.to() checks a NumPy mask before converting it")
def test_a_mask_of_int64_arrays_converts_to_int32():
    """``mask.to(lambda a: a.astype(np.int32))`` of a hand-built mask in NumPy's default integers
    worked; the check belongs after the conversion (and costs a dense mask: 0.67 s for 8 heads
    at 128k tokens on a review's CPU, against 8 ms before)."""
    good = bm.from_dense(np.tril(np.ones((3, 3), bool)), 384, 384)
    wide = good.to(lambda a: a.astype(np.int64))
    assert wide.to(lambda a: a.astype(np.int32)).kv_counts.dtype == np.int32


@pytest.mark.xfail(raises=TypeError, strict=True, reason="from_callable's per-block calls pass np.intp, not Python ints")
def test_a_per_block_function_may_need_python_ints():
    """A function that seeds Python's random per block (``random.Random`` takes no np.intp) ran."""
    mask = bm.from_callable(lambda i, j: random.Random(i * 1000 + j).random() < 2, 256, 256)
    assert mask.to_dense().all()


@pytest.mark.xfail(raises=NotImplementedError, strict=True, reason="_refuse_forward_ad raises whenever a jvp transform is active")
def test_jvp_through_a_function_whose_attention_inputs_are_constant():
    """torch.func.jvp of f(x) = attention(q, k, v).sum() + x, with q, k, v not depending on x,
    reached the call (here on the CPU: its device check); only an input that carries a tangent
    should be refused."""
    torch = pytest.importorskip("torch")
    import cuattn.torch

    q = torch.ones(1, 128, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="CUDA"):
        torch.func.jvp(lambda x: cuattn.torch.attention(q, q, q).float().sum() + x, (torch.ones(()),), (torch.ones(()),))
