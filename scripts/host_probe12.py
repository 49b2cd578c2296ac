"""Host cost of candidate replacements on the replayed backward's path (issue 14): one buffer
for the three gradients against three allocations, tighter array reads, and the pieces of
cuattn.torch._eager. PYTHONPATH=. python3 scripts/host_probe12.py"""
import numpy as np

from host_timing import host

SHAPE = (1, 128, 4, 64)


def cupy_rows():
    import cupy
    import ml_dtypes

    q = cupy.random.standard_normal(SHAPE, dtype=np.float32).astype(ml_dtypes.bfloat16)
    sync = cupy.cuda.get_current_stream().synchronize
    dt = q.dtype
    arrays = (q, q, q, q, q, None, None, q)
    alloc = cupy.cuda.alloc
    n = q.nbytes

    def views_memptr():
        m = alloc(3 * n)
        return [cupy.ndarray(SHAPE, dt, memptr=m + i * n) for i in range(3)]

    def read_loop():
        parts, ptrs = [], []
        for x in arrays:
            if x is None:
                parts.append(None)
                ptrs.append(0)
                continue
            data = x.data
            parts.append((x.shape, x.strides, x.dtype, data.device_id))
            ptrs.append(data.ptr)
        return parts

    def read_comprehension():
        parts = [None if x is None else (x.shape, x.strides, x.dtype, x.data.device_id) for x in arrays]
        ptrs = [0 if x is None else x.data.ptr for x in arrays]
        return parts, ptrs

    rows = {
        "bare launch (out=)": lambda: cupy.multiply(q, 2, out=q),
        "3 cupy.ndarray": lambda: [cupy.ndarray(SHAPE, dt) for _ in range(3)],
        "1 ndarray (3,...) + 3 getitem": lambda: (lambda b: (b[0], b[1], b[2]))(cupy.ndarray((3,) + SHAPE, dt)),
        "1 ndarray (3,...) + tuple()": lambda: tuple(cupy.ndarray((3,) + SHAPE, dt)),
        "alloc + 3 ndarray(memptr=)": views_memptr,
        "read loop (4-tuple parts)": read_loop,
        "read comprehension": read_comprehension,
    }
    for name, fn in rows.items():
        print(f"cupy  {name:<40} {host(fn, sync):8.2f} us")


def torch_rows():
    import torch

    import cuattn.torch as ct

    q = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    sync = torch.cuda.synchronize
    dev = q.device
    strides = q.stride()
    rows = {
        "3 empty_strided": lambda: [torch.empty_strided(SHAPE, strides, dtype=torch.bfloat16, device=dev) for _ in range(3)],
        "1 empty (3,...) + unbind": lambda: torch.empty((3,) + SHAPE, dtype=torch.bfloat16, device=dev).unbind(0),
        "_eager(7 tensors)": lambda: ct._eager(q, q, q, q, q, q, q),
        "_compiling()": ct._compiling,
        "_tracing()": ct._tracing,
        "_in_dispatch_mode()": ct._in_dispatch_mode,
        "_functorch_active()": ct._functorch_active,
        "torch.is_grad_enabled()": torch.is_grad_enabled,
        "are_deterministic_algorithms_enabled": torch.are_deterministic_algorithms_enabled,
        "q.is_contiguous()": q.is_contiguous,
    }
    for name, fn in rows.items():
        print(f"torch {name:<40} {host(fn, sync):8.2f} us")


if __name__ == "__main__":
    cupy_rows()
    torch_rows()
