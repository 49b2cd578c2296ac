"""Timing helpers for benchmarks: CUDA events, warm-up, medians, rotation of input sets."""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import pathlib
import platform
import statistics


def median_ms(fn, *, warmup: int = 3, repeat: int = 20, input_sets: int = 1) -> float:
    """Median over ``repeat`` timed calls of ``fn(i)``, i cycling over ``input_sets`` so that
    inputs larger together than L2 are not served from it. Each call is timed with CUDA events
    on CuPy's current stream."""
    import cupy

    for i in range(warmup):
        fn(i % input_sets)
    stream = cupy.cuda.get_current_stream()
    times = []
    for i in range(repeat):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn(i % input_sets)
        stop.record(stream)
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def grid_arguments(default_csv: str) -> argparse.ArgumentParser:
    """Options of the attention benchmarks' grid: head dims, seqlens, CSV path."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", default=default_csv)
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument("--head-dims", default="64,128")
    return parser


def grid_configs(args):
    """(head_dim, seqlen, causal, batch, heads): batch * seqlen = 16k tokens, heads = 2048 / head_dim."""
    for d in map(int, args.head_dims.split(",")):
        for s in map(int, args.seqlens.split(",")):
            for causal in (False, True):
                yield d, s, causal, 16384 // s, 2048 // d


def torch_kernel_ms(fn, *, repeat: int = 10, samples: int = 7, input_sets: int = 0) -> float:
    """Median over ``samples`` of the mean GPU time of ``repeat`` back-to-back calls on torch's
    current stream. A sleep kernel queued ahead keeps the GPU busy while the host enqueues the
    calls, so every implementation is timed on its GPU work alone, not on its host overhead
    (``scripts/overhead_probe.py`` measures that). With ``input_sets`` > 0, ``fn`` takes the
    index of the input set to use, cycled so that consecutive calls do not hit L2."""
    import torch

    call = (lambda i: fn(i % input_sets)) if input_sets else (lambda i: fn())
    call(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        torch.cuda._sleep(20_000_000)  # about 10 ms of clock cycles: longer than queueing `repeat` calls
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(repeat):
            call(i)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / repeat)
    return statistics.median(times)


def torch_tflops(flops: float, fn) -> float:
    """TFLOP/s of ``fn`` by :func:`torch_kernel_ms`; NaN (reported) if the backend refuses."""
    try:
        return round(flops / torch_kernel_ms(fn) / 1e9, 1)
    except RuntimeError as exc:
        print(f"failed: {exc}")
        return float("nan")


def with_env(fn, name: str, value: str = "0"):
    """``fn`` run with the environment variable ``name`` set to ``value`` (restored after)."""

    def run():
        saved = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn()
        finally:
            if saved is None:
                del os.environ[name]
            else:
                os.environ[name] = saved

    return run


def portable(fn):
    """``fn`` run with cuattn's Hopper kernels switched off (``CUATTN_WGMMA=0``)."""
    return with_env(fn, "CUATTN_WGMMA")


def copying(fn):
    """``fn`` run with the Hopper kernels that copy their own tiles (``CUATTN_TMA=0``)."""
    return with_env(fn, "CUATTN_TMA")


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    import cupy

    src = cupy.ones(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    ms = median_ms(lambda _: dst.__setitem__(Ellipsis, src), repeat=10)
    return 2 * nbytes / ms / 1e6


def environment() -> dict:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return {
        "gpu": props["name"].decode(),
        "date": datetime.date.today().isoformat(),
        "cupy": cupy.__version__,
        "python": platform.python_version(),
    }


def write_csv(path: str | pathlib.Path, rows: list[dict]) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        fields = list(dict.fromkeys(k for row in rows for k in row))
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def print_comparison(title: str, rows: list[dict]) -> None:
    """The bench_forward / bench_backward table: cuattn next to the SDPA peers, ratios, and any
    extra cuattn_* columns."""
    print(title)
    extra = sorted({c for r in rows for c in r if c.startswith("cuattn_")})
    print(f"{'d':>4} {'seqlen':>6} {'causal':>6} {'cuattn':>7} {'flash':>7} {'cudnn':>7} {'vs flash':>8} {'vs cudnn':>8}" + "".join(f" {c[7:]:>9}" for c in extra))
    for r in rows:
        print(
            f"{r['head_dim']:>4} {r['seqlen']:>6} {str(r['causal']):>6} {r['cuattn']:>7} {r['sdpa_flash']:>7} {r['sdpa_cudnn']:>7} "
            f"{r['cuattn'] / r['sdpa_flash']:>8.2f} {r['cuattn'] / r['sdpa_cudnn']:>8.2f}" + "".join(f" {r.get(c, ''):>9}" for c in extra)
        )
