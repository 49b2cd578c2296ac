"""Programmatic dependent launch (Hopper): a kernel launched while the one before it on the
stream is still running, through the driver's ``cuLaunchKernelEx`` (CuPy's launch has no launch
attributes). The kernel waits for the earlier grid itself (``common/dependent_launch.cuh``), so
only its launch latency and prologue overlap that grid's tail. Variants marked ``dependent``
take this launch on devices of compute capability 9.0 and newer, unless their plan launches
them as ordinary grids (``CallContext.launch(..., dependent=False)``: the decode kernel over
long single splits, ``cuattn/kernels/decode.py dependent_launch``); ``CUATTN_PDL=0`` turns it off
(to compare; read when a call is planned, and part of a replayed plan's key; a refused launch
drops the replayed plans, but not the plans a JAX trace holds). Any failure of the driver call launches that kernel the
ordinary way (which raises if the error was real; a thread without a current CUDA context gets
one there). If the driver says the launch form is unsupported (``_UNSUPPORTED``), a
``RuntimeWarning`` names its error once and dependent launches stay off for the process, on
every device. ``taken`` counts the launches the driver accepted.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings

from cuattn import driver

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
taken = 0  # dependent launches the driver accepted in this process
refused: int | None = None  # the driver's error code once it refused the form; then all are off
# CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: the form itself is refused.
_UNSUPPORTED = frozenset({801, 900})


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: an enum, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint),
    ]


def enabled() -> bool:
    return refused is None and os.environ.get("CUATTN_PDL", "1") != "0"


def _driver_entry():
    """``cuLaunchKernelEx`` of the loaded driver, or None where it cannot be had."""
    return driver.function("cuLaunchKernelEx", (ctypes.c_void_p,) * 4)


@functools.cache
def supported(device_id: int) -> bool:
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability) >= 90 and _driver_entry() is not None


class DependentLaunch:
    """One kernel's launch configuration with the programmatic-serialization attribute set;
    calling it launches on a stream with a ``void*[]`` of kernel arguments at an address."""

    def __init__(self, function, grid: tuple, block: tuple, shared_mem: int):
        self._attribute = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._config = _Config((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem, None,
                               ctypes.pointer(self._attribute), 1)
        self._config_address = ctypes.addressof(self._config)
        self._function = function.ptr
        self._entry = _driver_entry()

    def __call__(self, stream: int, params_address: int) -> bool:
        """Whether the driver took the launch (False: the caller launches the ordinary way)."""
        global taken
        if refused is not None:
            return False
        self._config.stream = stream or None
        code = self._entry(self._config_address, self._function, params_address, None)
        if code == 0:
            taken += 1
            return True
        if code in _UNSUPPORTED:
            _refuse(code)
        return False


def _refuse(code: int) -> None:
    global refused
    refused = code
    from cuattn import replay

    replay.clear()  # plans recorded with dependent launches chose for them (the decode's prefetch)
    warnings.warn(f"cuattn: cuLaunchKernelEx refused a programmatic dependent launch (CUresult {code}); "
                  "kernels are launched the ordinary way from now on in this process", RuntimeWarning, stacklevel=2)


def prepared(function, grid: tuple, block: tuple, shared_mem: int, device_id: int) -> DependentLaunch | None:
    """The dependent launch of ``function`` on ``device_id``; None where it is off or unsupported
    (the caller launches the ordinary way)."""
    return DependentLaunch(function, grid, block, shared_mem) if enabled() and supported(device_id) else None


def launch_dependent(function, grid: tuple, block: tuple, shared_mem: int, stream: int, params: bytes, device_id: int) -> bool:
    """Launches ``function`` as a programmatic dependent of the stream's previous grid with the
    parameter struct ``params`` (its one argument); False where that is off, unsupported or
    refused."""
    dependent = prepared(function, grid, block, shared_mem, device_id)
    if dependent is None:
        return False
    data = ctypes.create_string_buffer(params, len(params))
    args = (ctypes.c_void_p * 1)(ctypes.addressof(data))
    return dependent(stream, ctypes.addressof(args))
