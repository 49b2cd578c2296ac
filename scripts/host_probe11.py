"""Where the replayed CuPy backward and the PyTorch forward+backward spend the host's time
(issue 14's two missed bars), each piece timed alone in bursts (scripts/host_timing.py).

    PYTHONPATH=. python3 scripts/host_probe11.py [cupy] [torch]
"""
import sys
import time

import numpy as np

from host_timing import host

SHAPE = (1, 128, 4, 64)


def cupy_pieces():
    import cupy
    import ml_dtypes

    import cuattn
    from cuattn import replay

    q, k, v = (cupy.random.standard_normal(SHAPE, dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
    x, y = cupy.ones(SHAPE, np.float32), cupy.empty(SHAPE, np.float32)
    sync = cupy.cuda.get_current_stream().synchronize
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    call = lambda: cuattn.attention_backward(q, q, k, v, out, lse)  # noqa: E731
    call()
    fw = replay._frameworks[cupy.ndarray]
    key, plan = next((key, p) for key, p in replay._plans.items() if key[0] == "attention_backward")
    arrays = (q, q, k, v, out, lse, None, None)
    options = (False, None, "bottom_right", None, None, 0, False, 0.0)
    grads = [cupy.ndarray(s, d) for s, d in plan.outputs]
    pointers = [0 if a is None else a.data.ptr for a in arrays] + [g.data.ptr for g in grads]
    stream = cupy.cuda.get_current_stream().ptr
    read = fw.read

    def loop():
        parts, ptrs = [], []
        for a in arrays:
            if a is None:
                parts.append(None)
                ptrs.append(0)
                continue
            shape, strides, dtype, where, address = read(a)
            parts.append((shape, strides, dtype))
            ptrs.append(address)
        return parts

    parts = loop()
    rows = {
        "bare launch (out=)": lambda: cupy.multiply(x, 2, out=y),
        "cuattn.attention_backward": call,
        "replay.run (no prologue)": lambda: replay.run("attention_backward", call, arrays, options),
        "read 6 arrays + 2 None (loop)": loop,
        "read 1 array": lambda: read(q),
        "q.shape, q.strides, q.dtype": lambda: (q.shape, q.strides, q.dtype),
        "q.data.ptr, q.data.device_id": lambda: (q.data.ptr, q.data.device_id),
        "key build + lookup": lambda: replay._plans.get(
            ("attention_backward", fw.name, 0, replay._ENV.get(replay._WGMMA), replay._ENV.get(replay._SMALL), tuple(parts), replay.option_key(options))),
        "option_key": lambda: replay.option_key(options),
        "hash(tuple(parts))": lambda: hash(tuple(parts)),
        "3 cupy.ndarray": lambda: [cupy.ndarray(s, d) for s, d in plan.outputs],
        "1 cupy.ndarray": lambda: cupy.ndarray(SHAPE, q.dtype),
        "cupy.cuda.alloc(3 x 64 KB)": lambda: cupy.cuda.alloc(3 * 65536),
        "plan.run (writes + launch)": lambda: plan.run(pointers, stream),
        "launch alone": lambda: plan.launches[0](stream),
        "current stream ptr": lambda: fw.stream(0),
        "current device": replay._current_device,
        "contextvar get": replay._scope,
    }
    for name, fn in rows.items():
        print(f"cupy  {name:<40} {host(fn, sync):8.2f} us")


def torch_pieces():
    import torch
    import torch.nn.functional as F

    import cuattn.torch as ct
    from cuattn.backward import attention_backward

    q, k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    sync = torch.cuda.synchronize
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)  # noqa: E731

    class Trivial(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = torch.empty_like(q), torch.empty((1, 4, 128), device=q.device)
            ctx.save_for_backward(q, k, v, out, lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    inside = []
    original = ct._EagerAttention.backward

    def timed(ctx, *grads):
        s = time.perf_counter_ns()
        r = original(ctx, *grads)
        inside.append(time.perf_counter_ns() - s)
        return r

    with torch.no_grad():
        out, lse = ct.attention(q, k, v, return_lse=True)
    dout = torch.randn_like(out)
    dsum = torch.ones((), device="cuda", dtype=torch.bfloat16).expand(SHAPE)
    rows = {
        "SDPA f+b": lambda: sdpa(q, k, v).sum().backward(),
        "cuattn f+b": lambda: ct.attention(q, k, v).sum().backward(),
        "trivial Function f+b": lambda: Trivial.apply(q, k, v)[0].sum().backward(),
        "SDPA forward (grad)": lambda: sdpa(q, k, v),
        "cuattn forward (grad)": lambda: ct.attention(q, k, v),
        "trivial Function forward": lambda: Trivial.apply(q, k, v),
        "SDPA forward+sum (grad)": lambda: sdpa(q, k, v).sum(),
        "cuattn forward+sum (grad)": lambda: ct.attention(q, k, v).sum(),
        "core backward (no_grad, contiguous dout)": lambda: attention_backward(dout, q, k, v, out, lse),
        "expanded dout .contiguous()": lambda: dsum.contiguous(),
        "3 empty_like": lambda: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)),
    }
    for name, fn in rows.items():
        with torch.no_grad() if "no_grad" in name else torch.enable_grad():
            print(f"torch {name:<40} {host(fn, sync, bursts=30):8.2f} us")
    ct._EagerAttention.backward = staticmethod(timed)
    try:
        host(lambda: ct.attention(q, k, v).sum().backward(), sync, bursts=30)
    finally:
        ct._EagerAttention.backward = staticmethod(original)
    print(f"torch {'inside cuattn backward (median)':<40} {np.median(inside) / 1e3:8.2f} us")
    stamps = []

    def stamped(ctx, dout, dlse):
        t = [time.perf_counter_ns()]
        q, k, v, out, lse, sink, saved_seed, *mask_arrays = ctx.saved_tensors
        t.append(time.perf_counter_ns())
        dout, dlse = ct._kernel_ready(dout), ct._kernel_ready(dlse)
        t.append(time.perf_counter_ns())
        deterministic = torch.are_deterministic_algorithms_enabled()
        ct._eager(*(x for x in (dout, q, k, v, out, lse, dlse, sink) if x is not None))
        t.append(time.perf_counter_ns())
        grads = attention_backward(dout, q, k, v, out, lse, dlse=dlse, deterministic=deterministic)
        t.append(time.perf_counter_ns())
        attention_backward(dout, q, k, v, out, lse, dlse=dlse, deterministic=deterministic)
        t.append(time.perf_counter_ns())
        stamps.append(np.diff(t))
        return (*grads, None, None, None, None)

    ct._EagerAttention.backward = staticmethod(stamped)
    try:
        host(lambda: ct.attention(q, k, v).sum().backward(), sync, bursts=30)
    finally:
        ct._EagerAttention.backward = staticmethod(original)
    med = np.median(np.array(stamps), axis=0) / 1e3
    for name, us in zip(("saved_tensors", "_kernel_ready", "deterministic + _eager", "core backward", "core backward again"), med):
        print(f"torch {'  in engine: ' + name:<40} {us:8.2f} us")
    import threading
    import queue
    jobs, done = queue.Queue(), queue.Queue()

    def worker():
        while True:
            fn = jobs.get()
            s = time.perf_counter_ns()
            fn()
            done.put(time.perf_counter_ns() - s)

    threading.Thread(target=worker, daemon=True).start()
    ts = []
    for _ in range(200):
        jobs.put(lambda: attention_backward(dout, q, k, v, out, lse))
        ts.append(done.get())
    print(f"torch {'core backward on another Python thread':<40} {np.median(ts) / 1e3:8.2f} us")


if __name__ == "__main__":
    parts = sys.argv[1:] or ["cupy", "torch"]
    if "cupy" in parts:
        cupy_pieces()
    if "torch" in parts:
        torch_pieces()
