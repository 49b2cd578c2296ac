"""What cuattn needs from its environment: package versions and a CUDA GPU, checked up front.

An adapter checks its framework (and CuPy) when it is imported, the core checks CuPy at its
first GPU use, and a call on host (NumPy) arrays checks for a GPU before it touches one: each
says plainly what is missing instead of failing later on an attribute or a CUDA status code.

The version floors live here, in :data:`FLOORS`; ``pyproject.toml``'s extras declare the same
(``tests/test_requirements.py`` checks that they agree).
"""

from __future__ import annotations

import functools
import importlib
import re

# The oldest release of each package that has everything cuattn uses:
# cupy 14: cupy.cuda.Stream.from_external (CUDA stream protocol) and bfloat16 arrays.
# torch 2.10: torch.cuda.Stream.__cuda_stream__, which from_external needs (the torch.library
#   APIs, custom ops with register_fake / register_autograd and opcheck, date from 2.4).
# jax 0.6.1: jax.experimental.buffer_callback (Buffer with __cuda_array_interface__,
#   ExecutionContext.stream).
FLOORS = {"cupy": "14", "torch": "2.10", "jax": "0.6.1"}

# How to get each one from PyPI (the extras of pyproject.toml name the same packages).
INSTALL_HINTS = {
    "cupy": "pip install 'cupy-cuda13x>=14' 'nvidia-cuda-nvrtc>=13,<14', or 'cupy-cuda12x>=14' 'nvidia-cuda-nvrtc-cu12>=12.2,<13': "
            "cuattn's cu13 / cu12 extras",
    "torch": "pip install 'torch>=2.10'",
    "jax": "pip install 'jax>=0.6.1', with JAX's CUDA plugin for the GPU ('jax[cuda13]')",
}

_CUDA_ERROR_INSUFFICIENT_DRIVER = 35
_CUDA_ERROR_NO_DEVICE = 100


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: ``"2.10.0+cu130"`` -> ``(2, 10, 0)``."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"version must start with a release number such as 2.10, got {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def at_least(version: str, floor: str) -> bool:
    found, needed = version_tuple(version), version_tuple(floor)
    width = max(len(found), len(needed))
    return found + (0,) * (width - len(found)) >= needed + (0,) * (width - len(needed))


def installed_version(package: str) -> str | None:
    """The ``__version__`` of the importable module ``package``, or None when it is missing."""
    try:
        module = importlib.import_module(package)
    except ImportError:
        return None
    return str(getattr(module, "__version__", "0"))


def require(*packages: str, by: str) -> None:
    """Raises ImportError naming the package, its floor and what was found, unless every
    package in ``packages`` (keys of :data:`FLOORS`) is installed at or above its floor.
    ``by`` names the caller in the message (``"cuattn.torch"``)."""
    for package in packages:
        if package not in FLOORS:
            raise ValueError(f"package must be one of {sorted(FLOORS)}, got {package!r}")
        floor, found = FLOORS[package], installed_version(package)
        if found is None:
            raise ImportError(f"{by} needs {package} >= {floor}, which is not installed ({INSTALL_HINTS[package]})")
        if not at_least(found, floor):
            raise ImportError(f"{by} needs {package} >= {floor}, found {found} ({INSTALL_HINTS[package]})")


@functools.cache
def check_cupy() -> None:
    """:func:`require` for CuPy, once per process (at the core's first GPU use)."""
    require("cupy", by="cuattn")


def _probe_gpu() -> tuple[str | None, BaseException | None]:
    """(None, None) when CuPy sees a CUDA device, else (why not in words, the error behind it)."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed: {INSTALL_HINTS['cupy']}", exc
    runtime = cupy.cuda.runtime
    try:
        count = runtime.getDeviceCount()
    except runtime.CUDARuntimeError as exc:
        return _driver_problem(runtime, exc), exc
    if count < 1:
        return "the NVIDIA driver sees no CUDA device (is CUDA_VISIBLE_DEVICES empty?)", None
    return None, None


def _driver_problem(runtime, exc) -> str:
    try:
        driver = runtime.driverGetVersion()  # 0 when no driver is loaded
    except runtime.CUDARuntimeError:
        driver = 0
    if driver == 0:
        return "no NVIDIA driver is loaded"
    status = getattr(exc, "status", None)
    if status == _CUDA_ERROR_INSUFFICIENT_DRIVER:
        need = runtime.runtimeGetVersion()
        return (
            f"the NVIDIA driver supports CUDA {_cuda(driver)}, older than the CUDA {_cuda(need)} this CuPy "
            "was built for: update the driver, or install the CuPy build for an older CUDA"
        )
    if status == _CUDA_ERROR_NO_DEVICE:
        return "the NVIDIA driver sees no CUDA device (is CUDA_VISIBLE_DEVICES empty?)"
    return f"CUDA reports {exc}"


def _cuda(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def gpu_problem() -> str | None:
    """None when a CUDA GPU is usable through CuPy, else why not, in words."""
    return _probe_gpu()[0]


def require_gpu() -> None:
    """Raises RuntimeError ``cuattn: no CUDA GPU found (<why>)``, the CUDA error chained,
    unless CuPy sees a CUDA device."""
    problem, cause = _probe_gpu()
    if problem is not None:
        raise RuntimeError(f"cuattn: no CUDA GPU found ({problem})") from cause
