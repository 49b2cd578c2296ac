"""Where the host time of a cuattn call goes, on a tiny problem (the GPU work is negligible).

    PYTHONPATH=. python3 scripts/overhead_probe.py [core|torch|jax ...] [--profile]
"""

import cProfile
import pstats
import sys
import time

import numpy as np


def core():
    import torch

    import cuattn

    q = torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16)
    return lambda: cuattn.attention(q, q, q), torch.cuda.synchronize


def torch_adapter():
    import torch

    import cuattn.torch as ct

    q = torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return lambda: ct.attention(q, q, q).sum().backward(), torch.cuda.synchronize


def jax_adapter():
    import jax
    import jax.numpy as jnp

    import cuattn.jax as cj

    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 128, 4, 64)), jnp.bfloat16)
    f = jax.jit(lambda q: cj.attention(q, q, q))
    state = {"out": f(q)}
    return lambda: state.__setitem__("out", f(q)), lambda: state["out"].block_until_ready()


CASES = {"core": core, "torch": torch_adapter, "jax": jax_adapter}

for name in [a for a in sys.argv[1:] if a in CASES] or ["core"]:
    fn, sync = CASES[name]()
    for _ in range(20):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(500):
        fn()
    sync()
    print(f"{name}: host time per call {(time.perf_counter() - start) / 500 * 1e6:.1f} us")
    if "--profile" in sys.argv:
        with cProfile.Profile() as prof:
            for _ in range(500):
                fn()
            sync()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
