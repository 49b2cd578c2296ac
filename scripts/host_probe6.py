"""Host time vs GPU-bound rate per call (H100 probe): bursts short enough for the launch queue
time the host alone; long loops time whichever of host and GPU is slower."""
import sys, time, cProfile, io, pstats
import numpy as np

from host_timing import host, rate

def show(section, fns, sync, calls=2000, burst=40):
    for name, fn in fns.items():
        print(f"{section:6s} {name:34s} rate {rate(fn, sync, calls):8.1f}  host {host(fn, sync, burst):8.1f} us", flush=True)

which = sys.argv[1:] or ["cupy", "torch", "jax"]
SHAPE = (1, 128, 4, 64)
if "cupy" in which:
    import cupy, ml_dtypes, cuattn
    q, k, v = (cupy.random.standard_normal(SHAPE, dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
    x, y = cupy.ones(SHAPE, np.float32), cupy.empty(SHAPE, np.float32)
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    sync = cupy.cuda.get_current_stream().synchronize
    show("cupy", {
        "bare": lambda: cupy.multiply(x, 2, out=y),
        "fwd": lambda: cuattn.attention(q, k, v),
        "bwd": lambda: cuattn.attention_backward(q, q, k, v, out, lse),
        "bwd det": lambda: cuattn.attention_backward(q, q, k, v, out, lse, deterministic=True),
        "merge": lambda: cuattn.merge([out, out], [lse, lse]),
    }, sync)
if "torch" in which:
    import torch, torch.nn.functional as F
    import cuattn.torch as ct
    q, k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    sync = torch.cuda.synchronize
    with torch.no_grad():
        show("torch", {"fwd cuattn": lambda: ct.attention(q, k, v), "fwd sdpa": lambda: sdpa(q, k, v)}, sync)
    show("torch", {"f+b cuattn": lambda: ct.attention(q, k, v).sum().backward(), "f+b sdpa": lambda: sdpa(q, k, v).sum().backward()}, sync, 500, 10)
    out = ct.attention(q, k, v)
    g = torch.ones_like(out)
    show("torch", {"bwd only cuattn": lambda: torch.autograd.grad(ct.attention(q, k, v), (q, k, v), g),
                   "bwd only sdpa": lambda: torch.autograd.grad(sdpa(q, k, v), (q, k, v), g)}, sync, 500, 10)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(300): ct.attention(q, k, v).sum().backward()
    torch.cuda.synchronize(); pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(s.getvalue()[-4200:])
if "jax" in which:
    import jax, jax.numpy as jnp
    import cuattn.jax as cj
    from cuattn import replay
    spent = [0.0, 0]
    inner = replay.run_preallocated
    def timed(*a, **kw):
        s = time.perf_counter(); r = inner(*a, **kw); spent[0] += time.perf_counter() - s; spent[1] += 1; return r
    replay.run_preallocated = timed
    for shape in (SHAPE, (32, 256, 4, 64)):
        q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal(shape), jnp.bfloat16) for i in range(3))
        attends = {"cuattn": lambda q, k, v: cj.attention(q, k, v, causal=True), "jax.nn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)}
        state = {}
        sync = lambda: jax.block_until_ready(state.get("last"))
        fns = {}
        for name, attend in attends.items():
            fwd = jax.jit(attend)
            grad = jax.jit(jax.grad(lambda q, k, v, attend=attend: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
            fwd(q, k, v).block_until_ready(); jax.block_until_ready(grad(q, k, v))
            fns[f"{shape[0]}x{shape[1]} fwd {name}"] = lambda fwd=fwd: state.__setitem__("last", fwd(q, k, v))
            fns[f"{shape[0]}x{shape[1]} f+b {name}"] = lambda grad=grad: state.__setitem__("last", grad(q, k, v))
        spent[:] = [0.0, 0]
        show("jax", fns, sync, 1000, 20)
        print(f"jax    callback replay time {spent[0] / max(spent[1], 1) * 1e6:.1f} us per callback over {spent[1]}")
