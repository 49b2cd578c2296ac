"""Launch plans replayed per call signature: the host fast path.

A call is determined, up to its array addresses, by its *signature*: the op, the shapes,
strides and dtypes of its arrays, their device, and its options. The first call of a signature
runs the op's own code (every check, variant choice and launch plan) under a recording context
whose arrays carry tagged fake addresses, twice with different tags, and keeps what it would
allocate and launch. Words of a parameter struct that differ between the two recordings are
addresses (tag + byte offset); the rest is constant. Later calls of that signature allocate the
outputs and launch the recorded kernels with only the addresses written in.

A call takes the fast path only when its arrays are all of one supported type (exactly
``cupy.ndarray``, exactly ``torch.Tensor`` / ``Parameter`` on CUDA, or XLA's buffers in a JAX
callback), on one device, and every address is 16-byte aligned; anything else (NumPy, other
DLPack producers, misaligned views) runs the full path every time, as do ops whose plan depends
on more than the signature (they raise :class:`Uncacheable` while recording). Arrays an op
writes (``out=``, ``dq=``) are sources like the others; whether they overlap another array
depends on addresses, so each call checks that against the ranges its signature fixes (an
overlap takes the full path, which raises).
A bad argument raises while recording, from the same code, so errors are those of the full
path; a signature is cached only once its recording succeeded.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import struct
import threading
from typing import Any

import numpy as np

from cuattn import boundary, validation

MISS = object()  # run() found no fast path: the caller runs its full path
MAX_PLANS = 4096  # signatures kept per process (the cache is emptied when full)
_TAG_BASES = (0x5EED << 48, 0x7AC0 << 48)
_TAG_SHIFT = 40  # source i is tagged base + (i << 40) + 2**39: an offset into it, either sign,
_TAG_MIDDLE = 1 << (_TAG_SHIFT - 1)  # stays within its 2**40 range (a negative stride points below)
_U64 = struct.Struct("<Q")
# CUATTN_WGMMA, CUATTN_TMA, CUATTN_SMALL_BACKWARD and CUATTN_PDL, read per call, change the variants
# (and launches) a plan holds: read from os.environ's underlying dict where CPython has one (a
# C-level lookup), else through os.environ.
_BYTES_ENV = isinstance(getattr(os.environ, "_data", None), dict) and os.name == "posix"
_ENV = os.environ._data if _BYTES_ENV else os.environ
_WGMMA, _TMA, _SMALL, _PDL = (
    (b"CUATTN_WGMMA", b"CUATTN_TMA", b"CUATTN_SMALL_BACKWARD", b"CUATTN_PDL") if _BYTES_ENV
    else ("CUATTN_WGMMA", "CUATTN_TMA", "CUATTN_SMALL_BACKWARD", "CUATTN_PDL")
)

enabled = os.environ.get("CUATTN_REPLAY", "1") != "0"
_plans: dict[tuple, Plan | None] = {}
_scope = boundary._SCOPE.get


@dataclasses.dataclass
class Counters:
    """What the host did, for tests that pin the work of a repeated call."""

    recordings: int = 0  # op bodies run under the recorder (two per new signature)
    replays: int = 0
    allocations: int = 0
    launches: int = 0


counters = Counters()


class Uncacheable(Exception):
    """Raised while recording by an op whose launches depend on more than the signature."""


generation = 0  # bumped by clear(): the plans JAX's traces keep (run_preallocated) are keyed by it


def clear() -> None:
    """Forgets every recorded plan (after changing what plans depend on besides the
    signature, such as a monkeypatched device limit in a test, or a refused dependent launch),
    the cache here and the plans of JAX's traces alike."""
    global generation
    _plans.clear()
    generation += 1


@dataclasses.dataclass
class _Buffer:
    """One parameter struct: its bytes (constants filled in), the address words to patch
    (byte offset, source index, byte offset into the source), and the kernel argument."""

    data: Any  # ctypes char array (a fixed address)
    slots: tuple[tuple[int, int, int], ...]
    arg: Any  # cupy.cuda.function.CPointer to ``data``


@dataclasses.dataclass
class _Launch:
    function: Any  # cupy.cuda.function.Function, loaded on the plan's device
    grid: tuple  # (x, y, z)
    block: tuple  # (x, y, z)
    shared_mem: int
    buffer: _Buffer
    dependent: Any = None  # cuattn.launch.DependentLaunch where the variant is a programmatic dependent
    kernel_params: Any = None  # void*[1] -> buffer.data, as cuLaunchKernel takes it

    def __post_init__(self):
        import ctypes

        self.kernel_params = (ctypes.c_void_p * 1)(self.buffer.arg.ptr)
        self.args = (self.function.ptr, *self.grid, *self.block, self.shared_mem)
        self.params_address = ctypes.addressof(self.kernel_params)

    def __call__(self, stream: int) -> None:
        if self.dependent is not None and self.dependent(stream, self.params_address):
            return
        try:
            _launch_kernel(*self.args, stream, self.params_address, 0)
        except _DriverError:
            # No CUDA context current on this thread yet (CuPy's launch makes one), or a real
            # error, which CuPy's launch then raises again.
            self.function(self.grid, self.block, (self.buffer.arg,), shared_mem=self.shared_mem, stream=_RawStream(stream))


@dataclasses.dataclass
class Plan:
    """Sources are numbered: the op's arrays, then the arrays it returns (``outputs``), then
    its scratch arrays, which share one buffer of ``scratch_bytes`` at ``scratch_offsets``."""

    device_id: int
    allocations: tuple[tuple[tuple[int, ...], np.dtype], ...]  # every allocation, in the op's order
    outputs: tuple[tuple[tuple[int, ...], np.dtype], ...]
    scratch_offsets: tuple[int, ...]
    scratch_bytes: int
    buffers: tuple[_Buffer, ...]
    launches: tuple[_Launch, ...]
    results: Any  # int (source index) or tuple of them: what the op returns
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    writes: tuple = ()  # (pack_into, buffer bytes, byte offset, pointers -> addresses): _address_writes
    # Per written source: (index, the other sources' (index, bounds, whether it may be the very
    # same array)); their ranges overlap where below < other's address - this one's < above
    # (_overlap_checks, from run()'s ``written``).
    checks: tuple = ()
    disjoint: dict = dataclasses.field(default_factory=dict)  # (index, other, delta) -> bool: interleaved()

    def __post_init__(self):
        self.writes = _address_writes(self.buffers)

    def interleaved(self, index: int, other: int, delta: int, arrays, framework) -> bool:
        """Whether sources ``index`` and ``other``, whose address ranges overlap with ``other``
        ``delta`` bytes from ``index``, share no element (slices of one packed buffer): solved
        exactly once per delta, which alone decides it at fixed shapes and strides."""
        key = (index, other, delta)
        known = self.disjoint.get(key)
        if known is None:
            from cuattn.validation import _may_overlap

            if len(self.disjoint) >= 64:
                self.disjoint.clear()
            known = self.disjoint[key] = not _may_overlap(framework.wrap(arrays[index]), framework.wrap(arrays[other]))
        return known

    def run(self, pointers: list[int], stream: int) -> None:
        """Writes the sources' addresses and launches every kernel on ``stream`` (a handle)."""
        with self.lock:  # the buffers are shared by every call of this plan
            for pack, data, offset, addresses in self.writes:
                pack(data, offset, *addresses(pointers))
            for launch in self.launches:
                launch(stream)
        counters.replays += 1
        counters.launches += len(self.launches)


def _address_writes(buffers) -> tuple:
    """The address slots of ``buffers`` as few writes as they allow: each run of adjacent words
    that hold sources' addresses themselves (no offset into them) is one ``pack_into`` of the
    pointers an ``itemgetter`` picks; a slot with an offset is a write of its own."""
    writes = []
    for buffer in buffers:
        run: list[tuple[int, int]] = []  # (byte offset, source) of the current run
        for offset, source, delta in sorted(buffer.slots) + [(-1, -1, 0)]:
            if run and (offset != run[-1][0] + 8 or delta or offset < 0):
                sources = [src for _, src in run]
                addresses = operator.itemgetter(*sources) if len(sources) > 1 else (lambda p, s=sources[0]: (p[s],))
                writes.append((struct.Struct(f"<{len(run)}Q").pack_into, buffer.data, run[0][0], addresses))
                run = []
            if offset < 0:
                break
            if delta:
                writes.append((_U64.pack_into, buffer.data, offset, lambda p, s=source, d=delta: (p[s] + d,)))
            else:
                run.append((offset, source))
    return tuple(writes)


def option_key(values: tuple) -> tuple:
    """A hashable key of option values that tells apart values that compare equal but are
    checked differently (``True`` and ``1``, ``1`` and ``1.0``); a list or tuple (``window``)
    is keyed by its items and their types. Raises TypeError for an unhashable value."""
    types = tuple(map(type, values))
    if _SCALAR_TYPES.issuperset(types):
        return values, types
    key = []
    for v in values:
        if isinstance(v, (tuple, list)):  # subclasses too (a namedtuple window): by items and their types
            key.append((type(v), tuple(v), tuple(map(type, v))))
        else:
            key.append((type(v), v))
    return tuple(key)


_SCALAR_TYPES = frozenset((bool, int, float, str, type(None)))


# --- recording -------------------------------------------------------------------------------


class _Recorder(boundary.CallContext):
    """Runs an op on arrays with tagged addresses: records allocations, decisions and launches
    instead of doing them."""

    def __init__(self, framework, device_id, base, sources, wrap, decisions):
        super().__init__(framework, device_id, None)
        self._base = base
        self._sources, self._next = sources, 0
        self._index = {id(x): i for i, x in reversed(list(enumerate(sources)))}
        self._wrap = wrap
        self._given = decisions
        self.n_inputs = len(sources)
        self.allocations: list[tuple[tuple[int, ...], np.dtype]] = []
        self.allocated: dict[int, int] = {}  # id(DeviceArray) -> source index
        self.launches: list[tuple] = []
        self.decisions: dict[str, bool | int] = {}

    def tag(self, index: int) -> int:
        return self._base + (index << _TAG_SHIFT) + _TAG_MIDDLE

    def wrap(self, x) -> boundary.DeviceArray:
        """The op imports its arrays in source order (None ones skipped): each position gets
        its own tag, so that an array passed twice (self-attention's q, k, v) makes a plan
        that also serves distinct arrays."""
        while self._next < len(self._sources) and self._sources[self._next] is None:
            self._next += 1
        if self._next == len(self._sources) or self._sources[self._next] is not x:
            raise Uncacheable("the op imported its arrays out of source order")
        self._next += 1
        return dataclasses.replace(self._wrap(x), ptr=self.tag(self._next - 1))

    def decide(self, name: str, choose):
        value = self._given[name] if self._given and name in self._given else choose()
        self.decisions[name] = value
        return value

    def stage(self, *arrays) -> None:
        pass

    def empty(self, shape, dtype) -> boundary.DeviceArray:
        shape = tuple(int(s) for s in shape)
        index = self.n_inputs + len(self.allocations)
        self.allocations.append((shape, np.dtype(dtype)))
        a = boundary.DeviceArray(self.tag(index), shape, boundary._contiguous_strides(shape), np.dtype(dtype), None)
        self.allocated[id(a)] = index
        return a

    def zero(self, *arrays) -> None:
        raise Uncacheable("memset")

    def export(self, array):
        return array

    def launch(self, variant, grid, block, p, dependent: bool = True) -> None:
        from cuattn.loader import load_kernel

        function = load_kernel(variant).kernel  # compiled and loaded for the current device
        grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        self.launches.append((function, grid, block, int(variant.dynamic_smem), p.tobytes(), variant.dependent and dependent))

    def result_index(self, x) -> int:
        if isinstance(x, boundary.DeviceArray) and id(x) in self.allocated:
            return self.allocated[id(x)]
        if id(x) in self._index:
            return self._index[id(x)]
        raise Uncacheable("the op returned an array it neither allocated nor was given")


def record(call, sources: list, framework: str, device_id: int, wrap, decisions=None, scratch: bool = True) -> Plan:
    """Runs ``call()`` twice under recorders over ``sources`` (the array arguments, in source
    order; ``wrap`` reads one as a DeviceArray) and returns its plan. The op's own errors pass
    through; :class:`Uncacheable` when the two recordings disagree beyond the tags. With
    ``scratch=False`` every allocation is an output, in the op's order (the caller provides
    them all, as XLA does)."""
    recorders, results = [], []
    for base in _TAG_BASES:
        recorder = _Recorder(framework, device_id, base, sources, wrap, decisions)
        token = boundary._SCOPE.set(recorder)
        try:
            result = call()
        finally:
            boundary._SCOPE.reset(token)
        counters.recordings += 1
        recorders.append(recorder)
        results.append(_result_spec(recorder, result))
    a, b = recorders
    n_sources = a.n_inputs + len(a.allocations)
    if a.allocations != b.allocations or a.decisions != b.decisions or results[0] != results[1] or len(a.launches) != len(b.launches):
        raise Uncacheable("recordings differ")
    import ctypes

    from cupy.cuda.function import CPointer

    from cuattn import launch

    _driver_launch()
    # Renumber the allocations: returned ones first (in allocation order), then scratch.
    n_in = a.n_inputs
    returned = set(_flat(results[0])) if scratch else set(range(n_in, n_sources))
    order = [i for i in range(n_in, n_sources) if i in returned] + [i for i in range(n_in, n_sources) if i not in returned]
    renumber = {**{i: i for i in range(n_in)}, **{old: n_in + new for new, old in enumerate(order)}}
    outputs = tuple(a.allocations[i - n_in] for i in order if i in returned)
    offsets, total = [], 0
    for i in order[len(outputs):]:
        shape, dtype = a.allocations[i - n_in]
        offsets.append(total)
        total += -(-(dtype.itemsize * int(np.prod(shape))) // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
    buffers: dict[tuple, _Buffer] = {}
    launches = []
    for la, lb in zip(a.launches, b.launches):
        if la[:4] != lb[:4]:
            raise Uncacheable("recordings differ")
        template, slots = _address_slots(la[4], lb[4], n_sources)
        slots = tuple((offset, renumber[source], delta) for offset, source, delta in slots)
        if (template, slots) not in buffers:
            data = ctypes.create_string_buffer(template, len(template))
            buffers[template, slots] = _Buffer(data, slots, CPointer(ctypes.addressof(data)))
        dependent = launch.prepared(*la[:4], device_id) if la[5] else None
        launches.append(_Launch(*la[:4], buffers[template, slots], dependent))
    spec = results[0]
    spec = tuple(renumber[i] for i in spec) if isinstance(spec, tuple) else renumber[spec]
    if spec == tuple(range(n_in, n_in + len(outputs))):
        spec = _ALL_OUTPUTS
    return Plan(device_id, tuple(a.allocations), outputs, tuple(offsets), total, tuple(buffers.values()), tuple(launches), spec)


_SCRATCH_ALIGN = 256
_launch_kernel = _DriverError = None


def _driver_launch() -> None:
    global _launch_kernel, _DriverError
    from cupy_backends.cuda.api import driver

    _launch_kernel, _DriverError = driver.launchKernel, driver.CUDADriverError


def _flat(spec) -> tuple:
    return spec if isinstance(spec, tuple) else (spec,)


def _result_spec(recorder: _Recorder, result):
    if isinstance(result, tuple):
        return tuple(recorder.result_index(x) for x in result)
    return recorder.result_index(result)


def _address_slots(a: bytes, b: bytes, n_sources: int) -> tuple[bytes, tuple]:
    """The constant bytes (address words zeroed) and address slots of one parameter struct
    recorded with the two tag bases."""
    if len(a) != len(b) or len(a) % 8:
        raise Uncacheable("parameter struct is not a whole number of words")
    wa, wb = np.frombuffer(a, np.uint64), np.frombuffer(b, np.uint64)
    template, slots = wa.copy(), []
    for word in np.flatnonzero(wa != wb):
        ta, tb = int(wa[word]) - _TAG_BASES[0], int(wb[word]) - _TAG_BASES[1]
        if ta != tb or not 0 <= ta < n_sources << _TAG_SHIFT:
            raise Uncacheable("a parameter word depends on an address other than by an offset")
        slots.append((int(word) * 8, ta >> _TAG_SHIFT, (ta & ((1 << _TAG_SHIFT) - 1)) - _TAG_MIDDLE))
        template[word] = 0
    return template.tobytes(), tuple(slots)


# --- the frameworks ----------------------------------------------------------------------------


class _RawStream:
    """A CUDA stream handle as CuPy's launch takes it (anything with ``ptr``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


@dataclasses.dataclass(frozen=True)
class _Framework:
    name: str
    read: Any  # x -> (shape, strides, dtype, device, address); device < 0 when not a CUDA array
    wrap: Any  # x -> DeviceArray
    allocate: Any  # (shape, dtype, device) -> (native array, address)
    scratch: Any  # (bytes, device) -> (object that owns the memory, address)
    stream: Any  # device -> the current stream's handle
    mark_written: Any = None  # (arrays written in place) -> None: what the framework's autograd must know


_frameworks: dict[type, _Framework] = {}


def _cupy_framework() -> None:
    import cupy

    def read(x):
        memory = x.data
        return x.shape, x.strides, x.dtype, memory.device_id, memory.ptr

    def allocate(shape, dtype, device):
        a = cupy.ndarray(shape, dtype)
        return a, a.data.ptr

    def scratch(nbytes, device):
        memory = cupy.cuda.alloc(nbytes)
        boundary.hold_if_captured(get_stream(), memory)  # a captured graph keeps writing it
        return memory, memory.ptr

    get_stream = cupy.cuda.get_current_stream
    _frameworks[cupy.ndarray] = _Framework(boundary.CUPY, read, boundary._from_cupy, allocate, scratch, lambda device: get_stream().ptr)


def _torch_framework() -> None:
    import sys

    torch = sys.modules["torch"]
    devices: dict[int, Any] = {}
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def read(x):
        return x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr()

    def place(device):
        where = devices.get(device)
        if where is None:
            where = devices[device] = torch.device("cuda", device)
        return where

    def allocate(shape, dtype, device):
        key = (shape, dtype)
        layout = layouts.get(key)
        if layout is None:
            layout = layouts[key] = (boundary._contiguous_strides(shape), boundary._torch_dtype(dtype))
        t = torch.empty_strided(shape, layout[0], dtype=layout[1], device=place(device))
        return t, t.data_ptr()

    def scratch(nbytes, device):
        t = torch.empty_strided((nbytes,), (1,), dtype=torch.uint8, device=place(device))
        return t, t.data_ptr()

    def stream(device):
        return raw_stream(device) if raw_stream is not None else torch.cuda.current_stream(device).cuda_stream

    layouts: dict[tuple, tuple] = {}
    framework = _Framework(boundary.TORCH, read, boundary._from_torch, allocate, scratch, stream, boundary.mark_written)
    _frameworks[torch.Tensor] = _frameworks[torch.nn.Parameter] = framework


def _framework_of(x) -> _Framework | None:
    """The framework of ``x``'s type, registered on first sight (CuPy, PyTorch), or None."""
    framework = _frameworks.get(type(x))
    if framework is not None:
        return framework
    module = type(x).__module__
    if module.startswith("cupy") and not any(f.name == boundary.CUPY for f in _frameworks.values()):
        _cupy_framework()
    elif module.startswith("torch") and not any(f.name == boundary.TORCH for f in _frameworks.values()):
        _torch_framework()
    else:
        return None
    return _frameworks.get(type(x))


def run(op: str, call, arrays: tuple, options: tuple, written: tuple = ()):
    """``call()``'s result through the plan of this signature (recorded on first use), or
    :data:`MISS` when the call does not qualify (the caller then runs its full path).

    ``arrays``: the op's array arguments in a fixed order (None for an absent optional one);
    ``options``: its other arguments' values, in a fixed order; ``written``: ``(index, alias)``
    of each array the op writes (``alias``: the index of an array it may be exactly, or None).
    A call whose written arrays overlap another array misses."""
    if not enabled or not arrays or _scope() is not None:
        return MISS
    framework = _frameworks.get(type(arrays[0])) or _framework_of(arrays[0])
    if framework is None:
        return MISS
    read, kind = framework.read, type(arrays[0])
    parts, pointers, device, bits = [], [], None, 0
    add_part, add_pointer = parts.append, pointers.append
    for x in arrays:
        if x is None:
            add_part(None)
            add_pointer(0)
            continue
        if type(x) is not kind and _frameworks.get(type(x)) is not framework:
            return MISS
        try:
            shape, strides, dtype, where, address = read(x)
        except RuntimeError:  # a tensor without strides or data (sparse): the full path names it
            return MISS
        if where != device:
            if device is not None or where < 0:
                return MISS
            device = where
        add_part((shape, strides, dtype))
        add_pointer(address)
        bits |= address
    if bits & 15:
        return MISS
    try:
        key = (op, framework.name, device, _ENV.get(_WGMMA), _ENV.get(_TMA), _ENV.get(_SMALL), _ENV.get(_PDL), tuple(parts), option_key(options))
        plan = _plans.get(key, MISS)
    except TypeError:  # an unhashable option: the full path reports it
        return MISS
    if plan is None:
        return MISS
    switch = _current_device() != device
    if switch:
        import cupy

        scope = cupy.cuda.Device(device)
        scope.__enter__()
    try:
        if plan is MISS:
            plan = _record(key, call, arrays, framework, device, written)
            if plan is None:
                return MISS
        for index, others in plan.checks:
            at = pointers[index]
            for other, below, above, alias in others:
                if below < pointers[other] - at < above and not (alias and pointers[other] == at):
                    if not plan.interleaved(index, other, pointers[other] - at, arrays, framework):
                        return MISS
        allocate, outputs = framework.allocate, []
        for shape, dtype in plan.outputs:
            native, address = allocate(shape, dtype, device)
            outputs.append(native)
            add_pointer(address)
        if plan.scratch_bytes:
            scratch, base = framework.scratch(plan.scratch_bytes, device)  # freed after the launches, stream-ordered
            for offset in plan.scratch_offsets:
                add_pointer(base + offset)
        else:  # scratch arrays that are all empty (delta of no query rows) still take a slot
            pointers.extend(plan.scratch_offsets)
        counters.allocations += len(outputs) + (plan.scratch_bytes > 0)
        plan.run(pointers, framework.stream(device))
        if written and framework.mark_written is not None:
            framework.mark_written(*(arrays[i] for i, _ in written if arrays[i] is not None))
    finally:
        if switch:
            scope.__exit__(None, None, None)
    return _results(plan.results, arrays, outputs)


def _record(key, call, arrays, framework: _Framework, device: int, written: tuple = ()) -> Plan | None:
    try:
        plan = record(call, list(arrays), framework.name, device, framework.wrap)
    except Uncacheable:
        plan = None
    if plan is not None and written:
        plan.checks = _overlap_checks([None if x is None else framework.wrap(x) for x in arrays], written)
        plan.results = _written_results(plan.results, arrays, written)
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[key] = plan
    return plan


def _written_results(spec, arrays, written: tuple):
    """Plan.results with a returned written array named by its own position: recorded with the
    array also passed elsewhere (``out=q``), the recorder found its first position, which a
    later call with a distinct ``out`` would have returned instead."""
    if spec == _ALL_OUTPUTS:
        return spec
    moved = {}
    for index, _ in written:
        index %= len(arrays)
        for other, x in enumerate(arrays):
            if x is not None and x is arrays[index] and other != index:
                moved[other] = index
    if type(spec) is int:
        return moved.get(spec, spec)
    return tuple(moved.get(i, i) for i in spec)


def _overlap_checks(arrays: list, written: tuple) -> tuple:
    """Plan.checks of ``arrays`` (DeviceArrays, None where absent) for ``written``: byte ranges
    relative to each address, which the signature (shapes, strides, dtypes) fixes."""
    present = [(i, a) for i, a in enumerate(arrays) if a is not None and a.size]
    checks = []
    for index, alias in written:
        index %= len(arrays)
        w = arrays[index]
        if w is None or not w.size:
            continue
        low, high = validation.byte_extent(w)
        others = []
        for i, a in present:
            if i != index:
                other_low, other_high = validation.byte_extent(a)
                # [at + low, at + high) and [there + other_low, there + other_high) meet where
                # low - other_high < there - at < high - other_low.
                same = i == alias and (a.shape, a.strides, a.dtype) == (w.shape, w.strides, w.dtype)
                others.append((i, low - other_high, high - other_low, same))
        checks.append((index, tuple(others)))
    return tuple(checks)


def run_preallocated(plans: dict, call, sources: list, outputs: list, device: int, stream_handle: int, decisions) -> bool:
    """Runs ``call()`` (whose arrays are ``sources``, XLA buffers) into XLA's ``outputs``
    through the plan kept in ``plans`` (one per device and alignment), recording it on first
    use. False when it cannot (the caller runs the full path)."""
    if not enabled:
        return False
    pointers = [0 if x is None else int(x.__cuda_array_interface__["data"][0]) for x in sources]  # None: an absent optional array
    out_pointers = [int(x.__cuda_array_interface__["data"][0]) for x in outputs]
    aligned = not any(p & 15 for p in pointers + out_pointers)
    key = (device, aligned, _ENV.get(_WGMMA), _ENV.get(_TMA), _ENV.get(_SMALL), _ENV.get(_PDL), generation)
    plan = plans.get(key, MISS)
    if plan is MISS:
        plan = None
        if aligned:
            import cupy

            with cupy.cuda.Device(device):
                try:
                    plan = record(call, sources, boundary.DLPACK, device, boundary._from_cuda_array_interface, decisions, scratch=False)
                except Uncacheable:
                    pass
            if plan is not None and list(plan.allocations) != [(o.shape, o.dtype) for o in map(boundary._from_cuda_array_interface, outputs)]:
                plan = None
        plans[key] = plan
    if plan is None:
        return False
    if _current_device() != device:
        import cupy

        with cupy.cuda.Device(device):
            plan.run(pointers + out_pointers, stream_handle)
    else:
        plan.run(pointers + out_pointers, stream_handle)
    return True


def _current_device() -> int:
    global _get_device
    if _get_device is None:
        from cupy.cuda import runtime

        _get_device = runtime.getDevice
    return _get_device()


_get_device = None


def _results(spec, arrays, outputs):
    """What the op returns, from its arrays and the outputs allocated for this call."""
    if spec == _ALL_OUTPUTS:
        return tuple(outputs)
    if type(spec) is int:
        return arrays[spec] if spec < len(arrays) else outputs[spec - len(arrays)]
    n = len(arrays)
    return tuple([arrays[i] if i < n else outputs[i - n] for i in spec])


_ALL_OUTPUTS = "all outputs"  # Plan.results when the op returns exactly its outputs, in order
