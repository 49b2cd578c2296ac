"""Command line: ``python -m cuattn {info,selftest,warmup,compile}``."""

from __future__ import annotations

import argparse
import json
import platform
import sys

import cuattn
from cuattn import loader, offline, variants


def _gpu_problem() -> str | None:
    """None when a CUDA GPU is usable through CuPy, else why not."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device found"
    except Exception as exc:  # ImportError, CUDARuntimeError without a driver, ...
        return f"{type(exc).__name__}: {exc}"
    return None


def cmd_info(args) -> int:
    print(f"cuattn      {cuattn.__version__}  ({loader.source_dir()}, sources sha256 {loader.source_hash()[:16]})")
    print(f"python      {platform.python_version()}")
    try:
        import cupy
        from cupy.cuda import nvrtc

        print(f"cupy        {cupy.__version__}")
        print("nvrtc       {}.{}".format(*nvrtc.getVersion()))
    except Exception as exc:
        print(f"cupy        unavailable ({type(exc).__name__}: {exc})")
    problem = _gpu_problem()
    if problem:
        print(f"gpu         none ({problem})")
    else:
        import cupy

        driver = cupy.cuda.runtime.driverGetVersion()
        print(f"driver      CUDA {driver // 1000}.{driver % 1000 // 10}")
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            props = cupy.cuda.runtime.getDeviceProperties(i)
            cc = f"{props['major']}{props['minor']}"
            print(f"gpu {i}       {props['name'].decode()}  cc {cc}  {props['multiProcessorCount']} SMs  kernels built for {loader.arch_for(cc)}")
    cache = loader.cache_dir()
    files = list(cache.glob("*.cubin")) if cache.is_dir() else []
    print(f"cache       {cache}  ({len(files)} cubins, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB)")
    current = loader.source_hash()[:16]
    entries = sorted(k for k in loader.read_manifest() if k.startswith(current))
    print(f"cached cuattn variants of these sources: {len(entries)}")
    for key in entries:
        print(f"  {key.split('/', 1)[1]}")
    return 0


def cmd_selftest(args) -> int:
    problem = _gpu_problem()
    if problem:
        print(f"selftest needs a CUDA GPU and found none: {problem}")
        return 2
    from cuattn import selftest

    ok = selftest.run()
    print("selftest passed" if ok else "selftest FAILED")
    return 0 if ok else 1


def _select(names: list[str], everything: bool) -> list[variants.Variant]:
    pool = variants.all_variants() if everything or names else variants.common_variants()
    if names:
        pool = [v for v in pool if any(n in v.uri for n in names)]
    return pool


def cmd_warmup(args) -> int:
    problem = _gpu_problem()
    if problem:
        print(f"warmup compiles for the GPU in use and found none: {problem}; use 'compile' for offline builds")
        return 2
    import time

    arch = loader.device_arch()
    chosen = [v for v in _select(args.names, args.all) if v.builds_for(arch)]
    for v in chosen:
        start = time.perf_counter()
        loader.load_kernel(v)
        print(f"{v.uri:<48} {time.perf_counter() - start:6.2f} s")
    print(f"{len(chosen)} variants ready in {loader.cache_dir()}")
    return 0


def cmd_compile(args) -> int:
    archs = tuple(a.strip() for a in args.arch.split(",") if a.strip())
    reports = offline.compile_all(archs, _select(args.names, True), jobs=args.jobs)
    print(offline.format_table(reports))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in vars(r).items() if k != "log"} for r in reports], f, indent=1)
    failed = [r for r in reports if r.failed]
    for r in failed:
        print(f"\n{r.uri} [{r.arch}] {'failed to compile' if not r.ok else 'spills registers (hot kernel)'}:\n{r.log}", file=sys.stderr)
    print(f"{len(reports)} compiled, {len(failed)} failed")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, GPU, target architecture, kernel cache").set_defaults(fn=cmd_info)
    sub.add_parser("selftest", help="run each public kernel against the reference").set_defaults(fn=cmd_selftest)
    warm = sub.add_parser("warmup", help="compile kernel variants into the cache for this GPU")
    warm.add_argument("names", nargs="*", help="substrings of variant URIs (default: the common set)")
    warm.add_argument("--all", action="store_true", help="every variant")
    warm.set_defaults(fn=cmd_warmup)
    comp = sub.add_parser("compile", help="compile variants offline (no GPU) and report resources")
    comp.add_argument("names", nargs="*", help="substrings of variant URIs (default: all)")
    comp.add_argument("--arch", default=",".join(offline.DEFAULT_ARCHS))
    comp.add_argument("--jobs", type=int, default=2)
    comp.add_argument("--json", help="also write the report as JSON here")
    comp.set_defaults(fn=cmd_compile)
    args = parser.parse_args(argv)
    return args.fn(args)
