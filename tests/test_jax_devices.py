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


def test_arguments_that_are_no_arrays_are_named_under_jit():
    """q is read for its head_dim before the op's checks (a 0-d q gave an IndexError), and a
    traced call's arguments are wrapped by shape (a list sink gave an AttributeError)."""
    import jax.numpy as jnp

    import cuattn.jax as cj

    shape = jax.ShapeDtypeStruct((1, 16, 4, 64), jnp.float16)
    with pytest.raises(ValueError, match=r"q must have 4 dimensions, got shape \(\)"):
        cj.attention(jnp.ones((), jnp.float16), jnp.ones((), jnp.float16), jnp.ones((), jnp.float16))
    with pytest.raises(TypeError, match="sink must be an array, got list"):
        jax.eval_shape(lambda x: cj.attention(x, x, x, sink=[0.0, 0.0, 0.0, 0.0]), shape)
