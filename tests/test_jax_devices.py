"""cuattn.jax on arrays that are not on a CUDA device: a ValueError before any callback (on a
machine without a GPU, JAX's CPU-only build; with one, an array put on the CPU device)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")


def test_arrays_off_the_gpu_are_refused_with_a_value_error():
    import cuattn.jax as cj

    cpu = jax.devices("cpu")[0]
    q = jax.device_put(np.ones((1, 8, 2, 16), np.float16), cpu)
    with pytest.raises(ValueError, match="CUDA"):
        cj.attention(q, q, q)
