"""The array boundary: caller arrays in, device buffers for the kernels, caller arrays out.

Device arrays cross zero-copy (CuPy directly, PyTorch through its data pointer and strides,
JAX and any other ``__dlpack__`` producer through ``cupy.from_dlpack``). NumPy arrays are
uploaded, computed on, and the results downloaded (documented copies). Kernels run on the
caller's current stream: PyTorch's for torch tensors, CuPy's otherwise. Outputs are allocated
by the caller's framework where it can allocate (PyTorch, CuPy) so that its memory accounting
and stream-ordered allocator see them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Any

import numpy as np

from cuattn.dtypes import BFLOAT16

CUPY, TORCH, JAX, NUMPY, DLPACK = "cupy", "torch", "jax", "numpy", "dlpack"
_KDL_CUDA = 2


@dataclasses.dataclass
class DeviceArray:
    """One device buffer as the kernels see it: address, shape, strides in elements, dtype.

    ``native`` is the object that owns the memory (a cupy.ndarray or torch.Tensor).
    """

    ptr: int | None  # None for a host array not yet staged
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype
    native: Any

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def span(self, axis: int, start: int, stop: int) -> DeviceArray:
        """Entries ``start .. stop - 1`` along ``axis``: a view, same strides and owner."""
        ptr = None if self.ptr is None else self.ptr + start * self.strides[axis] * self.dtype.itemsize
        shape = (*self.shape[:axis], stop - start, *self.shape[axis + 1:])
        return DeviceArray(ptr, shape, self.strides, self.dtype, self.native)

    def unwritten(self) -> DeviceArray:
        """This view with a null address: an output the kernels skip (a fold's partial launches)."""
        return DeviceArray(0, self.shape, self.strides, self.dtype, None)


def framework_of(x, name: str = "array argument") -> str:
    if isinstance(x, np.ndarray):
        return NUMPY
    module = type(x).__module__
    if module.startswith("cupy"):
        return CUPY
    if module.startswith("torch"):
        return TORCH
    if module.startswith(("jax", "jaxlib")):
        return JAX
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return DLPACK
    raise TypeError(f"{name} must be a CuPy, NumPy, PyTorch or JAX array (or any __dlpack__ object), got {type(x).__name__}")


@functools.cache
def _numpy_dtype_of_torch(dtype) -> np.dtype:
    name = str(dtype).removeprefix("torch.")
    if name == "bfloat16":
        return BFLOAT16
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(object)


def _torch_dtype(dtype: np.dtype):
    import torch

    return torch.bfloat16 if dtype == BFLOAT16 else getattr(torch, np.dtype(dtype).name)


def _from_cupy(x) -> DeviceArray:
    item = x.dtype.itemsize
    strides = tuple(s // item for s in x.strides)
    return DeviceArray(int(x.data.ptr), tuple(x.shape), strides, np.dtype(x.dtype), x)


def _from_torch(x) -> DeviceArray:
    return DeviceArray(int(x.data_ptr()), tuple(x.shape), tuple(x.stride()), _numpy_dtype_of_torch(x.dtype), x)


# CuPy's memory pool knows nothing of graph capture: memory allocated while a stream is being
# captured and freed after the call would go to the next allocation, while the graph writes it
# on every replay. What cuattn allocates for itself during a capture is held here instead, for
# the life of the process (a graph may be replayed at any time). PyTorch keeps a captured
# graph's memory in a private pool; JAX allocates through XLA.
_HELD_FOR_GRAPHS: list = []


def hold_if_captured(stream, memory) -> None:
    """Keeps ``memory`` (a CuPy array or allocation) for good when ``stream`` is being captured."""
    if stream.is_capturing():
        _HELD_FOR_GRAPHS.append(memory)


class CallContext:
    """The framework, device and stream shared by all array arguments of one call.

    Nothing here touches the GPU until :meth:`stage` or a launch scope, so arguments can be
    validated first (and on machines without one).
    """

    def __init__(self, framework: str, device_id: int | None, external_stream=None):
        self.framework = framework
        self.device_id = device_id
        self._external = external_stream  # a foreign stream object (torch.cuda.Stream)
        self._device = self._stream = None
        self._written = ()  # torch tensors to mark written at the first launch (check_writes)

    @property
    def device(self):
        if self._device is None:
            from cuattn import requirements

            requirements.check_cupy()
            import cupy

            if self.device_id is None:  # host (NumPy) arguments: the only path that may find no GPU
                requirements.require_gpu()
                self.device_id = cupy.cuda.runtime.getDevice()
            self._device = cupy.cuda.Device(self.device_id)
        return self._device

    @property
    def stream(self):
        if self._stream is None:
            import cupy

            device = self.device
            self._stream = (
                cupy.cuda.get_current_stream(device.id) if self._external is None
                else _external_stream(self._external, device.id)
            )
        return self._stream

    def arch(self) -> str:
        """The compile target of this call's device (``sm_80``, ``sm_90a``, ...)."""
        from cuattn.loader import device_arch

        return device_arch(self.device.id)

    def device_index(self) -> int:
        """This call's device (where a traced call is expected to run: the current one)."""
        return self.device.id

    def decide(self, name: str, choose):
        """A choice that shapes what the op allocates (``choose()``, a bool or an int). A traced
        call records it and the run-time call of the same trace replays it (see :func:`trace`),
        so the buffers XLA allocated always match, whatever the device or environment then says."""
        return choose()

    def check_writes(self, what: str, *arrays: DeviceArray | None) -> None:
        """``what`` (``"out= is"``, ...) names ``arrays``, which the call writes in place: a
        TypeError before any launch where this call's framework has no mutable arrays (JAX,
        NumPy); PyTorch tensors are marked written (:func:`mark_written`) at the call's first
        launch, so that a call refused before it writes leaves their version counters alone."""
        if self.framework in (JAX, NUMPY):
            raise TypeError(f"{what} written in place, which {self.framework} arrays cannot be")
        if self.framework == TORCH:  # marked at the first launch: a call refused before it writes nothing
            self._written += tuple(a.native for a in arrays if a is not None)

    def stage(self, *arrays: DeviceArray | None) -> None:
        """Uploads host (NumPy) arguments; device arguments are already in place."""
        from cuattn import requirements

        requirements.check_cupy()  # its message, not a bare ModuleNotFoundError, where CuPy is missing
        import cupy

        for a in arrays:
            if a is not None and a.ptr is None:
                with self.device, self.stream:
                    staged = _from_cupy(cupy.asarray(a.native))
                a.ptr, a.strides, a.native = staged.ptr, staged.strides, staged.native

    def empty(self, shape, dtype) -> DeviceArray:
        shape = tuple(int(s) for s in shape)
        if self.framework == TORCH:
            import torch

            return _from_torch(torch.empty(shape, dtype=_torch_dtype(dtype), device=f"cuda:{self.device_id}"))
        import cupy

        with self.device, self.stream:
            a = cupy.empty(shape, dtype=dtype)
        hold_if_captured(self.stream, a)
        return _from_cupy(a)

    def launch(self, variant, grid, block, p, dependent: bool = True) -> None:
        """Launches ``variant`` with the parameter struct ``p`` (inside ``with self.device,
        self.stream``); ``dependent=False`` launches a dependent variant as an ordinary grid."""
        from cuattn.loader import load_kernel

        self._mark_written()
        kernel = load_kernel(variant)
        if variant.dependent and dependent:
            from cuattn import launch

            grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
            if launch.launch_dependent(kernel.kernel, grid, block, variant.dynamic_smem, self.stream.ptr, p.tobytes(), self.device_id):
                return
        kernel(grid, block, (p,), shared_mem=variant.dynamic_smem)

    def _mark_written(self) -> None:
        if self._written:
            mark_written(*self._written)
            self._written = ()

    def zero(self, *arrays: DeviceArray) -> None:
        """Fills arrays this call allocated (contiguous) with zeros, on the call's stream."""
        import cupy

        self._mark_written()
        with self.device, self.stream:
            for a in arrays:
                cupy.cuda.runtime.memsetAsync(a.ptr, 0, a.size * a.dtype.itemsize, self.stream.ptr)

    def export(self, array: DeviceArray):
        """The caller's array type for a result."""
        if self.framework in (TORCH, CUPY, DLPACK):
            return array.native
        if self.framework == NUMPY:
            with self.device:
                return array.native.get(stream=self.stream)
        import jax.dlpack  # JAX arrays are immutable: results are handed over, never written later

        with self.device, self.stream:
            return jax.dlpack.from_dlpack(array.native)


_external_streams: dict[tuple[int, int], Any] = {}


def mark_written(*tensors) -> None:
    """Bumps the version counters of torch tensors a call writes in place, as torch's in-place
    ops do, so that autograd raises for a backward that saved their old values (instead of
    reading the new ones); inference tensors have none."""
    import torch

    live = [t for t in tensors if not t.is_inference()]
    if live:
        torch.autograd.graph.increment_version(live)


def _external_stream(stream, device_id: int):
    """CuPy's view of a foreign stream (CUDA stream protocol) on ``device_id``, made there (CuPy
    records the current device as the stream's) and cached by device and handle (a default
    stream's handle is 0 on every device)."""
    key = (device_id, int(stream.cuda_stream))
    if key not in _external_streams:
        import cupy

        with cupy.cuda.Device(device_id):
            _external_streams[key] = cupy.cuda.Stream.from_external(stream)
    return _external_streams[key]


def _device_of(name: str, x, framework: str) -> int:
    if framework == NUMPY:
        return -1
    if framework == TORCH:
        if x.device.type != "cuda":
            raise ValueError(f"{name} is on device '{x.device}'; cuattn computes on CUDA devices (move it with .cuda(), or pass a NumPy array)")
        return int(x.device.index)
    if framework == CUPY:
        return int(x.device.id)
    kind, index = x.__dlpack_device__()
    if int(kind) != _KDL_CUDA:
        raise ValueError(f"{name} is not in CUDA device memory (DLPack device type {int(kind)}); cuattn computes on CUDA devices")
    return int(index)


def _from_numpy(x: np.ndarray) -> DeviceArray:
    """Host array: metadata now, device buffer at CallContext.stage (ptr None until then)."""
    item = x.dtype.itemsize
    return DeviceArray(None, tuple(x.shape), tuple(st // item for st in x.strides), np.dtype(x.dtype), x)


def import_arrays(**arrays) -> tuple[CallContext, dict[str, DeviceArray | None]]:
    """Checks that every given array comes from one framework and device, then wraps each
    without copying (NumPy arrays are uploaded later, by ``CallContext.stage``).

    ``None`` values pass through. Raises TypeError / ValueError naming the argument. Inside
    :func:`preallocated_outputs` the arrays are device buffers described by
    ``__cuda_array_interface__`` and the outputs come from that scope.
    """
    present = {k: v for k, v in arrays.items() if v is not None}
    if not present:
        raise TypeError("no array arguments given")
    scope = _SCOPE.get()
    if scope is not None:
        for k, v in present.items():
            if not hasattr(v, "shape"):
                raise TypeError(f"{k} must be an array, got {type(v).__name__}")
        return scope, {k: None if v is None else scope.wrap(v) for k, v in arrays.items()}
    frameworks = {k: framework_of(v, k) for k, v in present.items()}
    first = next(iter(present))
    framework = frameworks[first]
    for k, f in frameworks.items():
        if f != framework:
            raise TypeError(f"{k} is a {f} array but {first} is a {framework} array; pass arrays of one framework")
    if framework == TORCH:
        import torch

        for k, v in present.items():
            if v.layout != torch.strided:  # sparse COO / CSR, mkldnn: no strides to read
                raise TypeError(f"{k} is a torch tensor of layout {v.layout}; cuattn takes strided (dense) tensors")
    devices = {k: _device_of(k, v, framework) for k, v in present.items()}
    for k, d in devices.items():
        if d != devices[first]:
            raise ValueError(f"{k} is on device {d} but {first} is on device {devices[first]}")

    stream = None
    if framework == TORCH:
        import torch

        stream = torch.cuda.current_stream(devices[first])
    ctx = CallContext(framework, None if framework == NUMPY else devices[first], stream)

    wrapped: dict[str, DeviceArray | None] = {k: None for k in arrays}
    for k, v in present.items():
        if framework == TORCH:
            wrapped[k] = _from_torch(v)
        elif framework == CUPY:
            wrapped[k] = _from_cupy(v)
        elif framework == NUMPY:
            wrapped[k] = _from_numpy(v)
        else:  # JAX and other DLPack producers: zero-copy, synchronized to our stream
            import cupy

            with ctx.device, ctx.stream:
                wrapped[k] = _from_cupy(cupy.from_dlpack(v))
    return ctx, wrapped


class _StreamHandle:
    """A raw CUDA stream handle (XLA's) under the CUDA stream protocol."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


class PreallocatedContext(CallContext):
    """A call whose outputs were allocated by the caller (XLA, in a JAX buffer callback):
    ``empty`` hands them out in the order the op allocates, checking shape and dtype."""

    def __init__(self, device_id: int, stream_handle: int, outputs, decisions=None):
        import cupy

        super().__init__(DLPACK, device_id, None)
        with cupy.cuda.Device(device_id):
            self._stream = cupy.cuda.Stream.from_external(_StreamHandle(stream_handle))
        self._outputs = [_from_cuda_array_interface(o) for o in outputs]
        self._next = 0
        self._decisions = dict(decisions or {})

    def decide(self, name: str, choose):
        return self._decisions[name] if name in self._decisions else choose()

    wrap = staticmethod(lambda x: _from_cuda_array_interface(x))

    def empty(self, shape, dtype) -> DeviceArray:
        if self._next == len(self._outputs):
            raise RuntimeError("cuattn: the op allocated more arrays than the caller provided")
        out = self._outputs[self._next]
        self._next += 1
        if out.shape != tuple(int(s) for s in shape) or out.dtype != np.dtype(dtype):
            raise RuntimeError(f"cuattn: output {self._next - 1} is {out.shape} {out.dtype}, the op needs {tuple(shape)} {np.dtype(dtype)}")
        return out

    def export(self, array: DeviceArray):
        return array

    def check_all_used(self) -> None:
        if self._next != len(self._outputs):
            raise RuntimeError(f"cuattn: the op filled {self._next} of the {len(self._outputs)} outputs provided")


class ValidationDone(Exception):
    """Raised by a validation-only call when the op reaches its first launch."""


class _ValidationContext(CallContext):
    """Arguments known only by shape and dtype (JAX tracers): the op validates them, allocates
    (recorded, nothing is allocated) and stops at its first launch."""

    wrap = staticmethod(lambda x: DeviceArray(0, tuple(int(s) for s in x.shape), _contiguous_strides(x.shape), _dtype_of(x), None))

    def __init__(self):
        super().__init__(DLPACK, None, None)
        self.allocations: list[tuple[tuple[int, ...], np.dtype]] = []
        self.decisions: dict[str, bool | int] = {}

    def decide(self, name: str, choose):
        self.decisions[name] = choose()
        return self.decisions[name]

    def device_index(self) -> int:
        """The current device, where the real call is expected to run. Without one, tracing
        cannot size what depends on the device: ValidationDone ends it there."""
        try:
            import cupy

            return cupy.cuda.runtime.getDevice()
        except (ImportError, RuntimeError) as exc:  # CuPy's CUDARuntimeError is a RuntimeError
            raise ValidationDone from exc

    def stage(self, *arrays) -> None:
        pass

    def empty(self, shape, dtype) -> DeviceArray:
        shape = tuple(int(s) for s in shape)
        self.allocations.append((shape, np.dtype(dtype)))
        return DeviceArray(0, shape, _contiguous_strides(shape), np.dtype(dtype), None)

    @property
    def device(self):
        raise ValidationDone

    def arch(self) -> str:
        """The current device's target, where the real call is expected to run ("" without a GPU):
        it decides which scratch arrays the op allocates."""
        try:
            from cuattn.loader import device_arch

            return device_arch()
        except (ImportError, RuntimeError):
            return ""


_SCOPE: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar("cuattn_call_scope", default=None)


@contextlib.contextmanager
def preallocated_outputs(device_id: int, stream_handle: int, outputs, decisions=None):
    """Runs cuattn ops on ``stream_handle`` with inputs and outputs that are raw device buffers
    (``__cuda_array_interface__``), the outputs handed out in allocation order; ``decisions``
    (from :func:`trace`) replays the choices made when they were sized."""
    ctx = PreallocatedContext(device_id, stream_handle, outputs, decisions)
    token = _SCOPE.set(ctx)
    try:
        yield ctx
        ctx.check_all_used()
    finally:
        _SCOPE.reset(token)


@dataclasses.dataclass(frozen=True)
class Trace:
    allocations: list[tuple[tuple[int, ...], np.dtype]]  # (shape, dtype) of each, outputs first
    decisions: dict[str, bool | int]  # the choices that sized them (CallContext.decide)


def trace(call, *args, **kwargs) -> Trace:
    """Runs ``call`` (a cuattn op) on arguments that have only ``shape`` and ``dtype`` up to its
    first launch: its TypeError / ValueError come out, nothing is launched. Returns every array
    the op allocates, in order (outputs, then scratch), and the choices that decided them."""
    ctx = _ValidationContext()
    token = _SCOPE.set(ctx)
    try:
        call(*args, **kwargs)
    except ValidationDone:
        pass
    finally:
        _SCOPE.reset(token)
    return Trace(ctx.allocations, ctx.decisions)


def validate(call, *args, **kwargs) -> list[tuple[tuple[int, ...], np.dtype]]:
    """:func:`trace`'s allocations."""
    return trace(call, *args, **kwargs).allocations


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(tuple(shape)):
        strides.append(step)
        step *= int(extent)
    return tuple(reversed(strides))


def _dtype_of(x) -> np.dtype:
    dtype = np.dtype(x.dtype)
    return BFLOAT16 if dtype.kind == "V" and dtype.itemsize == 2 and BFLOAT16 is not None else dtype


def _from_cuda_array_interface(x) -> DeviceArray:
    """A device buffer from ``__cuda_array_interface__``; dtype from ``x.dtype`` when present
    (the interface cannot spell bfloat16)."""
    cai = x.__cuda_array_interface__
    dtype = _dtype_of(x if getattr(x, "dtype", None) is not None else np.dtype(cai["typestr"]))
    shape = tuple(int(s) for s in cai["shape"])
    strides = _contiguous_strides(shape) if cai.get("strides") is None else tuple(s // dtype.itemsize for s in cai["strides"])
    return DeviceArray(int(cai["data"][0]), shape, strides, dtype, x)
