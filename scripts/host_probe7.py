"""Host time of each piece of a replayed CuPy backward, default vs deterministic plan."""
import time
import numpy as np
import cupy, ml_dtypes
import cuattn
from cuattn import replay

from host_timing import host as _host


def host(fn, sync):
    return _host(fn, sync, bursts=80)

SHAPE = (1, 128, 4, 64)
q, k, v = (cupy.random.standard_normal(SHAPE, dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
out, lse = cuattn.attention(q, k, v, return_lse=True)
sync = cupy.cuda.get_current_stream().synchronize
stream = cupy.cuda.get_current_stream().ptr
fw = replay._frameworks[cupy.ndarray]
for det in (False, True):
    before = replay.counters.replays
    call = lambda: cuattn.attention_backward(q, q, k, v, out, lse, deterministic=det)
    t_total = host(call, sync)
    print(f"det={det}: total {t_total:.1f} us; replays {replay.counters.replays - before}")
    plan = [p for key, p in replay._plans.items() if key[0] == "attention_backward" and p is not None and key[-1][0][-1] is det][0]
    print("  launches:", [(l.function.ptr, l.grid, l.block, l.shared_mem) for l in plan.launches])
    print("  outputs", len(plan.outputs), "scratch", plan.scratch_bytes, "slots", sum(len(b.slots) for b in plan.buffers), "buffers", len(plan.buffers))
    arrays = (q, q, k, v, out, lse, None)
    ptrs = [0 if a is None else a.data.ptr for a in arrays]
    mem = [cupy.ndarray(s, d) for s, d in plan.outputs]
    scr = cupy.cuda.alloc(max(plan.scratch_bytes, 1))
    ptrs += [m.data.ptr for m in mem] + [scr.ptr + o for o in plan.scratch_offsets]
    print(f"  plan.run {host(lambda: plan.run(ptrs, stream), sync):.1f}")
    for i, l in enumerate(plan.launches):
        print(f"  launch {i} {host(lambda: l(stream), sync):.1f}")
    print(f"  allocs {host(lambda: [cupy.ndarray(s, d) for s, d in plan.outputs], sync):.1f}")
    print(f"  scratch {host(lambda: cupy.cuda.alloc(plan.scratch_bytes), sync):.1f}")
    print(f"  replay.run with no-op plan.run:", end=" ")
    saved = replay.Plan.run
    replay.Plan.run = lambda self, p, s: None
    print(f"{host(call, sync):.1f}")
    replay.Plan.run = saved
ew = cupy.ElementwiseKernel("float32 a", "float32 b", "b = a * 2", "dbl")
x = cupy.ones(SHAPE, np.float32); y = cupy.empty_like(x)
print(f"bare multiply out= {host(lambda: cupy.multiply(x, 2, out=y), sync):.1f}")
print(f"fwd {host(lambda: cuattn.attention(q, k, v), sync):.1f}")
import torch
tq, tk, tv = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
import cuattn.torch as ct
def rate(fn, sync, calls=2000):
    fn(); sync(); s = time.perf_counter()
    for _ in range(calls): fn()
    sync(); return (time.perf_counter() - s) / calls * 1e6
ts = torch.cuda.synchronize
with torch.no_grad():
    print(f"torch fwd no_grad rate {rate(lambda: ct.attention(tq, tk, tv), ts):.1f} host {host(lambda: ct.attention(tq, tk, tv), ts):.1f}")
print(f"torch fwd grad-mode rate {rate(lambda: ct.attention(tq, tk, tv), ts):.1f} host {host(lambda: ct.attention(tq, tk, tv), ts):.1f}")
with torch.no_grad():
    print(f"torch fwd no_grad rate again {rate(lambda: ct.attention(tq, tk, tv), ts):.1f}")
    d = tq.detach(); e = tk.detach(); f = tv.detach()
    print(f"torch fwd detached rate {rate(lambda: ct.attention(d, e, f), ts):.1f}")
