"""Kernel loader: CUDA source, specialization, NVRTC compile, per-device memo, disk cache.

Kernels are compiled at run time by ``cupy.RawModule`` with NVRTC, one module per variant
(see :mod:`cuattn.kernels`), and cached on disk by CuPy (``CUPY_CACHE_DIR``). CuPy's cache key
covers the source string but not headers found through ``-I``, so the source handed to it
starts with a hash of the whole ``cuda_src/`` tree: any edit there makes a new key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import threading
import time

from cuattn.kernels.variant import Variant

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
BASE_OPTIONS = ("-std=c++17", "-ftz=true")


@functools.cache
def source_dir() -> pathlib.Path:
    """``cuda_src/``: inside the installed package, else beside it in a source checkout."""
    for candidate in (_PACKAGE_DIR / "cuda_src", _PACKAGE_DIR.parent / "cuda_src"):
        if (candidate / "common").is_dir():
            return candidate
    raise FileNotFoundError(f"cuattn: no cuda_src/ next to {_PACKAGE_DIR}")


@functools.cache
def source_hash() -> str:
    """SHA-256 over every file of ``cuda_src/`` (paths and contents): any of them may be
    included through ``-I``, which CuPy's cache key does not see."""
    digest = hashlib.sha256()
    root = source_dir()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def translation_unit(source: str) -> str:
    """The source string for one translation unit (``Variant.source``, a path under
    ``cuda_src/``), keyed by the hash of all of ``cuda_src/``."""
    if not (source_dir() / source).is_file():
        raise FileNotFoundError(f"cuattn: no kernel source {source} in {source_dir()}")
    return f'// cuattn cuda_src sha256 {source_hash()}\n#include "{source}"\n'


def compile_options(arch: str) -> tuple[str, ...]:
    return BASE_OPTIONS + (f"-I{source_dir()}", f"-arch={arch}")


def arch_for(compute_capability: str | int) -> str:
    """Target for a device: ``sm_90a`` on Hopper (wgmma, setmaxnreg), else ``sm_XY``."""
    cc = int(compute_capability)
    if cc < 80:
        raise RuntimeError(f"cuattn needs compute capability 8.0 or newer, this device has {cc / 10:.1f}")
    return "sm_90a" if cc == 90 else f"sm_{cc}"


def device_arch(device_id: int | None = None) -> str:
    import cupy

    return _arch_of(cupy.cuda.Device(device_id).id)


@functools.cache
def _arch_of(device_id: int) -> str:
    import cupy

    return arch_for(cupy.cuda.Device(device_id).compute_capability)


@functools.cache
def device_smem_limit(device_id: int) -> int:
    """Shared memory one block of this device may opt in to, in bytes."""
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])


@functools.cache
def device_sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def wgmma_enabled() -> bool:
    """Whether Hopper devices run the wgmma kernels; ``CUATTN_WGMMA=0`` keeps them on the
    portable mma.sync kernels (to compare the two, or to rule one out)."""
    return os.environ.get("CUATTN_WGMMA", "1") != "0"


def tma_enabled() -> bool:
    """Whether dense 16-bit forwards and one-pass backwards on Hopper take the TMA kernels
    (forward/forward_tma.cu, backward/backward_tma.cu); ``CUATTN_TMA=0`` keeps them on the
    wgmma kernels that copy for themselves."""
    return os.environ.get("CUATTN_TMA", "1") != "0"


def small_backward_enabled() -> bool:
    """Whether small backward calls take the one-launch kernel (backward_small.cu);
    ``CUATTN_SMALL_BACKWARD=0`` gives them the kernels of larger calls (to compare the two)."""
    return os.environ.get("CUATTN_SMALL_BACKWARD", "1") != "0"


def cache_dir() -> pathlib.Path:
    default = pathlib.Path.home() / ".cupy" / "kernel_cache"
    return pathlib.Path(os.environ.get("CUPY_CACHE_DIR", default))


def _manifest_path() -> pathlib.Path:
    return cache_dir() / "cuattn-manifest.json"


@functools.cache
def manifest_prefix() -> str:
    """The manifest's key of this installation: what CuPy's cache key holds beyond a variant's
    source and target (this install's ``-I`` path, CuPy's and NVRTC's versions), hashed with
    the sources; kernels cached from another checkout or venv are not listed as this one's."""
    try:
        import cupy
        from cupy.cuda import nvrtc

        versions = f"{cupy.__version__}/{nvrtc.getVersion()}"
    except Exception:  # noqa: BLE001 - no CuPy or NVRTC: nothing of this install is cached
        versions = "none"
    return hashlib.sha256(f"{source_hash()}\0{source_dir()}\0{versions}".encode()).hexdigest()[:16]


def read_manifest() -> dict:
    try:
        return json.loads(_manifest_path().read_text())
    except (FileNotFoundError, ValueError):
        return {}


def record_compile(variant: Variant, arch: str, seconds: float) -> None:
    """Lists a loaded variant and how long it took in the cache's manifest (``info`` shows it)."""
    manifest = read_manifest()
    manifest[f"{manifest_prefix()}/{arch}/{variant.uri}"] = {"seconds": round(seconds, 3), "time": time.time()}
    try:
        _manifest_path().parent.mkdir(parents=True, exist_ok=True)
        tmp = _manifest_path().with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        tmp.replace(_manifest_path())
    except OSError:  # the listing is lost (CuPy itself needs a writable cache for kernels not in it yet)
        pass


@functools.cache
def _kernel_loader():
    import cupy

    @cupy.memoize(for_each_device=True)
    def load(variant: Variant):
        arch = device_arch()
        start = time.perf_counter()
        module = cupy.RawModule(
            code=translation_unit(variant.source),
            options=compile_options(arch),
            name_expressions=[variant.expression],
        )
        kernel = module.get_function(variant.expression)
        if variant.dynamic_smem > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = variant.dynamic_smem
        record_compile(variant, arch, time.perf_counter() - start)
        return kernel

    return load


def load_kernel(variant: Variant):
    """The ``cupy.RawKernel`` of a variant on the current device, compiled once per device."""
    return _kernel_loader()(variant)


@functools.cache
def resident_ctas(variant: Variant, device: int) -> int:
    """CTAs of ``variant`` one SM of ``device`` holds at once (its registers, shared memory and
    threads counted by the driver). Loads the kernel on ``device``, compiling it if need be,
    also when a traced call (JAX) sizes its outputs by it."""
    import cupy
    from cupy_backends.cuda.api import driver

    with cupy.cuda.Device(device):
        kernel = load_kernel(variant)
        return driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, variant.threads, variant.dynamic_smem)
