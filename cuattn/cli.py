"""Command line: ``python -m cuattn {info,selftest,warmup,compile}``."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import sys

import cuattn
from cuattn import kernels, loader, offline, requirements
from cuattn.kernels.variant import Variant
from cuattn.requirements import gpu_problem

DESCRIPTION = "cuattn: exact attention with CUDA kernels compiled at run time. Commands: info, selftest, warmup, compile."
MIN_ARCH = 80
_SUFFIX_FLOORS = {"": MIN_ARCH, "a": 90, "f": 100}  # sm_90a: the first architecture-specific target; sm_100f: the first family


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
    problem = gpu_problem()
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
    current = loader.manifest_prefix()
    entries = sorted(k for k in loader.read_manifest() if k.startswith(current))
    print(f"cached cuattn variants of these sources: {len(entries)}")
    for key in entries:
        print(f"  {key.split('/', 1)[1]}")
    return 0


def cmd_selftest(args) -> int:
    problem = gpu_problem()
    if problem:
        print(f"selftest needs a CUDA GPU and found none: {problem}")
        return 2
    from cuattn import selftest

    ok = selftest.run()
    print("selftest passed" if ok else "selftest FAILED")
    return 0 if ok else 1


def _select(names: list[str], everything: bool, arch: str) -> list[Variant]:
    """The variants named (substrings of their URIs) that build for ``arch``, tiled for it."""
    pool = kernels.all_variants(arch) if everything or names else kernels.common_variants()
    return [v for v in pool if v.builds_for(arch) and (not names or any(n in v.uri for n in names))]


def unmatched_names(names: list[str], archs=()) -> list[str]:
    """The names (substrings of variant URIs) that match no variant, for any of ``archs``."""
    uris = {v.uri for arch in (None, *archs) for v in kernels.all_variants(arch)}
    return [n for n in names if not any(n in uri for uri in uris)]


def arch_list(text: str) -> tuple[str, ...]:
    """argparse type of ``--arch``: comma-separated targets ``sm_XY`` (XY >= 80), ``sm_XYa``
    (architecture-specific, XY >= 90) or ``sm_XYf`` (family, XY >= 100), that NVRTC compiles for."""
    archs = tuple(a.strip() for a in text.split(",") if a.strip())
    if not archs:
        raise argparse.ArgumentTypeError("give at least one target, such as sm_80 or sm_80,sm_90a")
    supported = _nvrtc_targets()
    for arch in archs:
        match = re.fullmatch(r"sm_(\d{2,3})([af]?)", arch)
        number, suffix = (int(match.group(1)), match.group(2)) if match else (0, "")
        if number < _SUFFIX_FLOORS[suffix]:
            raise argparse.ArgumentTypeError(
                f"{arch!r} is not a target cuattn builds for: use sm_XY with XY >= {MIN_ARCH}, sm_XYa with "
                f"XY >= 90 or sm_XYf with XY >= 100 (sm_80, sm_86, sm_89, sm_90a, sm_100a, sm_120, ...)"
            )
        if supported and number not in supported:
            listed = ", ".join(f"sm_{n}" for n in sorted(supported) if n >= MIN_ARCH)
            raise argparse.ArgumentTypeError(f"{arch!r} is not a target of this NVRTC; it compiles for {listed}")
    return archs


def _nvrtc_targets() -> set[int]:
    """Compute capabilities this NVRTC compiles for (empty when NVRTC cannot say)."""
    try:
        from cupy.cuda import nvrtc

        return {int(n) for n in nvrtc.getSupportedArchs()}
    except Exception:  # no CuPy, or no NVRTC library: the compile itself reports that
        return set()


def positive_int(text: str) -> int:
    """argparse type of ``--jobs``: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value


def writable_file(text: str) -> str:
    """argparse type of ``--json``: a path that can be written now, before any compile."""
    path = pathlib.Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: directory {parent} does not exist")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


def cmd_warmup(args) -> int:
    problem = gpu_problem()
    if problem:
        print(f"warmup compiles for the GPU in use and found none: {problem}; use 'compile' for offline builds")
        return 2
    arch = loader.device_arch()
    chosen = _select(args.names, args.all, arch)
    if args.jobs > 1 and len(chosen) > 1:
        timings = _compile_in_threads(chosen, args.jobs)
    else:
        timings = map(_compile_one, chosen)
    for v, seconds in zip(chosen, timings):
        loader.record_compile(v, arch, seconds)  # once, here: workers' manifest writes may race
        print(f"{v.uri:<48} {seconds:6.2f} s")
    print(f"{len(chosen)} variants ready in {loader.cache_dir()}")
    return 0


def _compile_one(variant: Variant, device_id: int | None = None) -> float:
    """Seconds to load ``variant`` on the device (compiling it unless cached)."""
    import time

    import cupy

    start = time.perf_counter()
    with cupy.cuda.Device(device_id):
        loader.load_kernel(variant)
    return time.perf_counter() - start


def _compile_in_threads(chosen: list[Variant], jobs: int) -> list[float]:
    """Each variant compiled by one of ``jobs`` threads (NVRTC releases the GIL) for the
    current device, into the disk cache."""
    import concurrent.futures

    import cupy

    device_id = cupy.cuda.runtime.getDevice()
    if not chosen:
        return []
    first = _compile_one(chosen[0], device_id)  # alone, as offline.compile_all's first (NVRTC's lazy builtins)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(jobs, len(chosen) - 1))) as pool:
        return [first] + list(pool.map(_compile_one, chosen[1:], [device_id] * (len(chosen) - 1)))


def cmd_compile(args) -> int:
    try:
        from cupy.cuda import nvrtc  # noqa: F401 - compiling needs NVRTC, through CuPy
    except ImportError:
        print(f"compile needs CuPy and NVRTC: {requirements.INSTALL_HINTS['cupy']}", file=sys.stderr)
        return 2
    chosen = {arch: _select(args.names, True, arch) for arch in args.arch}
    if not any(chosen.values()):
        print(f"no variant matching {' '.join(args.names)} builds for {','.join(args.arch)}", file=sys.stderr)
        return 2
    reports = offline.compile_all(args.arch, chosen.__getitem__, jobs=args.jobs)
    print(offline.format_table(reports))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in vars(r).items() if k != "log"} for r in reports], f, indent=1)
    failed = [r for r in reports if r.failed]
    for r in failed:
        print(f"\n{r.uri} [{r.arch}] {r.failure}:\n{r.log}", file=sys.stderr)
    print(f"{len(reports)} compiled, {len(failed)} failed")
    return 1 if failed else 0


def _command(sub, name: str, text: str, fn):
    """A subcommand whose one-line help is also its --help description."""
    parser = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
    parser.set_defaults(fn=fn, parser=parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cuattn", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    _command(sub, "info", "versions, GPU, target architecture, kernel cache", cmd_info)
    _command(sub, "selftest", "run each public kernel against the reference", cmd_selftest)
    warm = _command(sub, "warmup", "compile kernel variants into the cache for this GPU", cmd_warmup)
    warm.add_argument("names", nargs="*", help="substrings of variant URIs (default: the common set)")
    warm.add_argument("--all", action="store_true", help="every variant")
    warm.add_argument(
        "--jobs", type=positive_int, default=min(16, os.cpu_count() or 1),
        help="compiles run in this many threads, at least 1 (default: %(default)s)",
    )
    comp = _command(sub, "compile", "compile variants offline (no GPU needed) and report registers, spills and shared memory", cmd_compile)
    comp.add_argument("names", nargs="*", help="substrings of variant URIs (default: all)")
    comp.add_argument(
        "--arch", type=arch_list, default=",".join(offline.DEFAULT_ARCHS),
        help=f"comma-separated targets: sm_XY (XY >= {MIN_ARCH}), sm_XYa (XY >= 90) or sm_XYf (XY >= 100) (default: %(default)s)",
    )
    comp.add_argument("--jobs", type=positive_int, default=2, help="compiles run in parallel, at least 1 (default: %(default)s)")
    comp.add_argument("--json", type=writable_file, help="also write the report as JSON to this file")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unmatched = unmatched_names(getattr(args, "names", []), getattr(args, "arch", ()))
    if unmatched:
        uris = [v.uri for v in kernels.all_variants()]
        families = dict.fromkeys(u.split("/")[0] for u in uris)
        args.parser.error(
            f"no kernel variant matches {', '.join(map(repr, unmatched))}: names are substrings of variant "
            f"URIs such as {uris[-1]}, in the families {', '.join(families)}"
        )
    return args.fn(args)
