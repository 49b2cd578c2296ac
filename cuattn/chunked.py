"""Attention over K/V that live in host memory: chunks streamed through the device.

The "K/V streamed from host memory" schedule (benchmarks/NOTES.md). Each chunk of keys is uploaded
on a copy stream into one of two device slots while the caller's stream computes the previous
chunk; the forward kernels fold each chunk's partial result into an fp32 accumulator by its
lse (AttnParams::accum); the sum is rounded to the output dtype once, at the end. The backward
streams the same chunks again with the global ``out`` and ``lse``, sends each chunk's dK / dV
back to host memory on a second copy stream, and has the kernels add each chunk's dQ into an
fp32 sum (BackwardParams::sum_grads), rounded once. Masks are computed from
key positions: a chunk starting at key ``start`` sees the diagonal moved by ``-start``, and
chunks that no query row sees are neither uploaded nor computed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cuattn import boundary, validation
from cuattn.attention import _LAYOUT, MAX_HEADS_KV, attn_params, check_qkv, launch_forward, require_arrays, set_mask
from cuattn.backward import _LSE_LAYOUT, SUM_DQ, backward_params, check_dout, launch_backward
from cuattn.merge import sum_rows
from cuattn.kernels.backward import BackwardGrid
from cuattn.options import AttnOptions, shifted
from cuattn.validation import check_bool

DEFAULT_CHUNK_BYTES = 128 << 20  # K and V of one chunk, when chunk_tokens is not given (benchmarks/NOTES.md)
_INT32_REACH = 2**31 - 1


@dataclasses.dataclass
class HostArray:
    """A host array as the copy engine sees it: address, shape, strides (elements), dtype."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype
    pinned: bool
    native: object  # keeps the memory alive

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def rows(self, start: int, stop: int) -> HostArray:
        """Key rows [start, stop) of a (batch, seqlen, heads, head_dim) array."""
        shape = (self.shape[0], stop - start, *self.shape[2:])
        return HostArray(self.ptr + start * self.strides[1] * self.dtype.itemsize, shape, self.strides, self.dtype, self.pinned, self.native)


def host_array(x) -> HostArray | None:
    """``x`` as a :class:`HostArray` if it is a NumPy array or a CPU torch tensor, else None."""
    if isinstance(x, np.ndarray):
        item = x.dtype.itemsize
        ptr = int(x.__array_interface__["data"][0])
        return HostArray(ptr, x.shape, tuple(s // item for s in x.strides), x.dtype, _is_pinned(ptr), x)
    if type(x).__module__.startswith("torch") and getattr(x, "device", None) is not None and x.device.type == "cpu":
        from cuattn.boundary import _numpy_dtype_of_torch

        return HostArray(int(x.data_ptr()), tuple(x.shape), tuple(x.stride()), _numpy_dtype_of_torch(x.dtype), bool(x.is_pinned()), x)
    return None


def _is_pinned(ptr: int) -> bool:
    """Whether a host address is page-locked (cudaHostAlloc / cudaHostRegister): what the copy
    engine reads asynchronously. Pageable memory is first copied into page-locked buffers."""
    try:
        import cupy

        return cupy.cuda.runtime.pointerGetAttributes(ptr).type == cupy.cuda.runtime.cudaMemoryTypeHost
    except Exception:
        return False


@dataclasses.dataclass
class Chunk:
    """Keys [start, start + length) of the sequence: host arrays to upload, or device arrays."""

    start: int
    length: int
    k: HostArray | boundary.DeviceArray
    v: HostArray | boundary.DeviceArray
    on_host: bool
    index: int = 0  # position in the iterable


def visible_keys(seqlen_q: int, seqlen_k: int, fields: dict) -> tuple[int, int]:
    """(first, last) key that any query row sees under the kernel mask ``fields``
    (:meth:`AttnOptions.kernel_fields`); last < first when none does."""
    if seqlen_q == 0 or seqlen_k == 0:
        return 0, -1
    left, right, offset = fields["window_left"], fields["window_right"], fields["diagonal_offset"]
    first = 0 if left < 0 else max(0, offset - left)
    last = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, seqlen_q - 1 + offset + right)
    return first, last


def split_keys(seqlen_k: int, chunk_tokens: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_tokens, seqlen_k)) for s in range(0, seqlen_k, chunk_tokens)]


def default_chunk_tokens(batch: int, heads_kv: int, head_dim: int, itemsize: int) -> int:
    per_key = 2 * batch * heads_kv * head_dim * itemsize
    return max(128, DEFAULT_CHUNK_BYTES // max(per_key, 1) // 128 * 128)


class _Source:
    """The chunks of ``kv_chunks`` in order, with their positions, checked against q."""

    def __init__(self, kv_chunks, q: boundary.DeviceArray, ctx, chunk_tokens, seqlen_k, needs_total: bool):
        self.q, self.ctx = q, ctx
        self.pair = _is_pair(kv_chunks)
        if self.pair:
            k, v = (self._host("kv_chunks[%d]" % i, x) for i, x in enumerate(kv_chunks))
            self._check_kv("kv_chunks[0]", k)
            validation.check_shape("kv_chunks[1]", v, k.shape, "(the shape of the keys)")
            self._check_kv("kv_chunks[1]", v)
            self.k, self.v = k, v
            total = k.shape[1]
            if seqlen_k is not None and _positive_int("seqlen_k", seqlen_k, allow_zero=True) != total:
                raise ValueError(f"seqlen_k ({seqlen_k}) differs from the keys' length ({total})")
            if chunk_tokens is None:
                chunk_tokens = default_chunk_tokens(k.shape[0], k.shape[2], k.shape[3], k.dtype.itemsize)
            self.chunk_tokens = _positive_int("chunk_tokens", chunk_tokens)
            self.total = total
            self.heads_kv = k.shape[2]
        else:
            if chunk_tokens is not None:
                raise ValueError("chunk_tokens applies to a (k, v) pair of host arrays; an iterable of chunks is taken as it comes")
            if seqlen_k is None and needs_total:
                raise ValueError(
                    "seqlen_k (the total number of keys) is required with an iterable of chunks under a causal or window mask"
                )
            self.total = None if seqlen_k is None else _positive_int("seqlen_k", seqlen_k, allow_zero=True)
            if type(kv_chunks) is tuple and len(kv_chunks) == 2 and all(type(x) is list for x in kv_chunks):
                # (k chunks, v chunks) would read as the chunks (k0, k1) and (v0, v1) when each holds two
                raise TypeError("kv_chunks is a tuple of two lists, which reads as (k chunks, v chunks): pass an iterable of (k, v) "
                                "pairs, such as list(zip(k_chunks, v_chunks)) (two chunks: a list of tuples), or one (k, v) pair of "
                                "host arrays")
            self.items = iter(kv_chunks)
            self.heads_kv = None

    def _host(self, name, x) -> HostArray:
        h = host_array(x)
        if h is None:
            raise TypeError(f"{name} must be a host array (NumPy or a CPU torch tensor) in a (k, v) pair, got {type(x).__name__}")
        return h

    def _check_kv(self, name: str, a) -> None:
        """A chunk's keys or values: (batch, n, heads_kv, head_dim) of q's dtype."""
        q = self.q
        validation.check_rank(name, a, 4, _LAYOUT)
        validation.check_same_dtype(name, a, "q", q)
        if a.shape[0] != q.shape[0] or a.shape[3] != q.shape[3]:
            raise ValueError(f"{name} has shape {a.shape}; expected (batch={q.shape[0]}, seqlen, heads_kv, head_dim={q.shape[3]})")
        heads_kv = a.shape[2]
        if heads_kv == 0 or q.shape[2] % heads_kv:
            raise ValueError(f"heads_q ({q.shape[2]}, from q) must be a multiple of heads_kv ({heads_kv}, from {name})")
        if getattr(self, "heads_kv", None) not in (None, heads_kv):
            raise ValueError(f"{name} has {heads_kv} KV heads but the earlier chunks have {self.heads_kv}")
        if heads_kv > MAX_HEADS_KV:
            raise ValueError(f"at most {MAX_HEADS_KV} KV heads are supported, got {heads_kv} ({name})")
        row_elems = a.shape[1] * a.shape[2] * a.shape[3]
        if isinstance(a, HostArray) and row_elems and (
            a.strides[1:] != (a.shape[2] * a.shape[3], a.shape[3], 1) or (a.shape[0] > 1 and a.strides[0] < row_elems)
        ):
            raise ValueError(
                f"{name} has strides {a.strides} (elements); host keys and values are copied row by row and must be contiguous "
                "in (seqlen, heads, head_dim), batches apart by at least one sequence"
            )

    def __iter__(self):
        if self.pair:
            for start, stop in split_keys(self.total, self.chunk_tokens):
                yield Chunk(start, stop - start, self.k.rows(start, stop), self.v.rows(start, stop), True, start // self.chunk_tokens)
            return
        start = 0
        for i, item in enumerate(self.items):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(f"kv_chunks[{i}] must be a (k, v) pair, got {type(item).__name__}")
            names = (f"kv_chunks[{i}][0]", f"kv_chunks[{i}][1]")
            hosts = [host_array(x) for x in item]
            if all(h is not None for h in hosts):
                k, v, on_host = hosts[0], hosts[1], True
            elif any(h is not None for h in hosts):
                raise TypeError(f"kv_chunks[{i}] mixes host and device arrays")
            else:
                k, v = self._device(names, item)
                on_host = False
            self._check_kv(names[0], k)
            validation.check_shape(names[1], v, k.shape, "(the shape of the keys)")
            self._check_kv(names[1], v)
            self.heads_kv = k.shape[2]
            if self.total is not None and start + k.shape[1] > self.total:
                raise ValueError(f"the chunks hold more than seqlen_k ({self.total}) keys")
            yield Chunk(start, k.shape[1], k, v, on_host, i)
            start += k.shape[1]
        if self.total is not None and start != self.total:
            raise ValueError(f"the chunks hold {start} keys but seqlen_k is {self.total}")
        self.total = start

    def _device(self, names, item):
        ctx, a = boundary.import_arrays(k=item[0], v=item[1])
        if ctx.framework != self.ctx.framework or ctx.device_id != self.ctx.device_id:
            raise TypeError(f"{names[0]} is a {ctx.framework} array on device {ctx.device_id}; q is a {self.ctx.framework} array on device "
                            f"{self.ctx.device_id}")
        check_qkv(self.q, a["k"], a["v"], None)
        return a["k"], a["v"]


def _is_pair(kv_chunks) -> bool:
    """A (k, v) pair of arrays, rather than an iterable of (k, v) chunks."""
    return isinstance(kv_chunks, (tuple, list)) and len(kv_chunks) == 2 and hasattr(kv_chunks[0], "shape")


def _positive_int(name: str, x, allow_zero=False) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < (0 if allow_zero else 1):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else 'positive'}, got {x}")
    return int(x)


class _Streams:
    """The copy streams and the two device slots of a streamed call, on the call's device."""

    def __init__(self, ctx, downloads: bool):
        import cupy

        self.ctx = ctx
        with ctx.device:
            self.up = cupy.cuda.Stream(non_blocking=True)
            self.down = cupy.cuda.Stream(non_blocking=True) if downloads else None
        self.buffers = 4 if downloads else 2  # k, v (, dk, dv)
        self.slots: list[tuple | None] = [None, None]
        self.free = [None, None]  # per slot: the event after which its k, v may be overwritten
        self.downloaded = [None, None]  # per slot: the event after which its dk, dv may be overwritten
        self.staged = [None, None]  # per slot: the event after its upload (its staging buffers are free again)
        self.staging = [[None, None], [None, None]]  # per slot: page-locked copies of pageable K, V

    def event(self, stream):
        import cupy

        with self.ctx.device:
            e = cupy.cuda.Event(disable_timing=True)
            e.record(stream)
        return e

    def _buffers(self, slot: int, like: HostArray, length: int) -> tuple:
        """The slot's buffers, (re)allocated to hold ``length`` keys shaped like ``like``. A
        new buffer may be memory the caller's stream released and has not finished with: the
        copy stream waits for everything queued there so far."""
        bufs = self.slots[slot]
        if bufs is None or bufs[0].shape[1] < length or bufs[0].shape[2:] != like.shape[2:]:
            batch, _, heads_kv, head_dim = like.shape
            bufs = tuple(self.ctx.empty((batch, length, heads_kv, head_dim), like.dtype) for _ in range(self.buffers))
            self.slots[slot] = bufs
            self.free[slot] = self.event(self.ctx.stream)
        return bufs

    @staticmethod
    def view(buf: boundary.DeviceArray, length: int) -> boundary.DeviceArray:
        return buf.span(1, 0, length)

    def upload(self, slot: int, chunk: Chunk) -> list[boundary.DeviceArray]:
        """Queues the chunk's upload into ``slot`` and makes the caller's stream wait for it;
        returns the slot's views (k, v, and dk, dv when downloading)."""
        bufs = self._buffers(slot, chunk.k, chunk.length)
        hosts = (chunk.k, chunk.v) if chunk.k.pinned and chunk.v.pinned else self._stage(slot, chunk)
        with self.ctx.device:
            if self.free[slot] is not None:
                self.up.wait_event(self.free[slot])
            for host, buf in zip(hosts, bufs):
                _copy_rows(buf.ptr, buf.strides[0], host.ptr, host.strides[0], chunk.length * host.strides[1], host.shape[0],
                           host.dtype.itemsize, "h2d", self.up)
            self.staged[slot] = self.event(self.up)
            self.ctx.stream.wait_event(self.staged[slot])
            if self.downloaded[slot] is not None:
                self.ctx.stream.wait_event(self.downloaded[slot])
        return [self.view(b, chunk.length) for b in bufs]

    def _stage(self, slot: int, chunk: Chunk) -> tuple[HostArray, HostArray]:
        """Pageable rows copied by host threads into the slot's page-locked staging buffers, once
        the copy engine has finished reading them (the DMA of the chunk before last)."""
        import cupyx

        if self.staged[slot] is not None:
            self.staged[slot].synchronize()
        out = []
        for i, host in enumerate((chunk.k, chunk.v)):
            row_bytes = chunk.length * host.strides[1] * host.dtype.itemsize
            staging = self.staging[slot][i]
            if staging is None or staging.nbytes < row_bytes * host.shape[0]:
                staging = self.staging[slot][i] = cupyx.empty_pinned(row_bytes * host.shape[0], np.uint8)
            base = int(staging.ctypes.data)
            _parallel_copy([(base + b * row_bytes, host.ptr + b * host.strides[0] * host.dtype.itemsize, row_bytes) for b in range(host.shape[0])])
            strides = (chunk.length * host.strides[1], *host.strides[1:])
            out.append(HostArray(base, host.shape, strides, host.dtype, True, staging))
        return out[0], out[1]

    def consumed(self, slot: int, chunk: Chunk, pair: bool) -> None:
        """Before the next chunk of an iterable is drawn: the host waits until this chunk's
        page-locked arrays have been read (a producer may refill the same buffer). Device chunks
        are read in the caller's stream order; a (k, v) pair is not changed during the call."""
        if chunk.on_host and not pair and chunk.k.pinned and chunk.v.pinned:
            self.staged[slot].synchronize()

    def computed(self, slot: int) -> None:
        """The caller's stream has queued its work on ``slot``'s inputs."""
        self.free[slot] = self.event(self.ctx.stream)

    def download(self, slot: int, grads, hosts, length: int) -> None:
        """Queues the copy of the slot's dK, dV (after the work queued so far) to host rows."""
        with self.ctx.device:
            self.down.wait_event(self.free[slot])
            for g, h in zip(grads, hosts):
                _copy_rows(h.ptr, h.strides[0], g.ptr, g.strides[0], length * g.strides[1], g.shape[0], g.dtype.itemsize, "d2h", self.down)
            self.downloaded[slot] = self.event(self.down)

    def finish(self) -> None:
        """The caller's stream waits for every copy (buffers are released in its order), and the
        host for the copies (the host arrays may then change, host results are complete)."""
        with self.ctx.device:
            for s in (self.up, self.down):
                if s is not None:
                    self.ctx.stream.wait_event(self.event(s))
                    s.synchronize()


def _copy_rows(dst: int, dst_pitch: int, src: int, src_pitch: int, row_elems: int, rows: int, itemsize: int, kind: str, stream) -> None:
    """``rows`` runs of ``row_elems`` elements, pitches in elements, on ``stream``."""
    import cupy

    rt = cupy.cuda.runtime
    width = row_elems * itemsize
    if width == 0 or rows == 0:
        return
    spitch = src_pitch * itemsize if rows > 1 else width
    dpitch = dst_pitch * itemsize if rows > 1 else width
    direction = rt.memcpyHostToDevice if kind == "h2d" else rt.memcpyDeviceToHost
    if max(spitch, dpitch, width) > MAX_COPY_PITCH:  # a sequence of 2 GB or more: one copy a row
        for r in range(rows):
            rt.memcpyAsync(dst + r * dst_pitch * itemsize, src + r * src_pitch * itemsize, width, direction, stream.ptr)
        return
    rt.memcpy2DAsync(dst, dpitch, src, spitch, width, rows, direction, stream.ptr)


# cudaMemcpy2DAsync refuses pitches (and widths) past the device's cudaDevAttrMaxPitch, 2**31 - 1
# bytes on NVIDIA GPUs: a batch whose rows are 2 GB apart (a million keys of 8 KV heads at
# head_dim 128) is copied row by row.
MAX_COPY_PITCH = 2**31 - 1


_COPY_WORKERS = 8
_copy_pool = None


def _parallel_copy(runs) -> None:
    """Host memcpy of (dst, src, nbytes) runs, in pieces over a few threads (ctypes.memmove
    releases the GIL): one thread's memcpy is well below the PCIe rate."""
    import concurrent.futures
    import ctypes
    import os

    global _copy_pool
    if _copy_pool is None:
        _copy_pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(_COPY_WORKERS, os.cpu_count() or 1), thread_name_prefix="cuattn-stage")
    piece = max(1 << 20, -(-sum(n for _, _, n in runs) // _COPY_WORKERS))  # every thread busy, pieces of at least 1 MiB
    pieces = [(d + o, s + o, min(piece, n - o)) for d, s, n in runs for o in range(0, n, piece)]
    for f in [_copy_pool.submit(ctypes.memmove, *piece) for piece in pieces]:
        f.result()


def _fill(ctx, a: boundary.DeviceArray, value: float) -> None:
    if a.size == 0:
        return
    if ctx.framework == boundary.TORCH:
        a.native.fill_(value)
    else:
        with ctx.device, ctx.stream:
            a.native.fill(value)


def _prepare(q, kv_chunks, causal, window, align, scale, softcap, chunk_tokens, seqlen_k, extra: dict):
    require_arrays({"q": q, "kv_chunks": kv_chunks})
    ctx, a = boundary.import_arrays(q=q, **extra)
    if ctx.framework == boundary.NUMPY:
        raise TypeError("q must be a device array (CuPy, PyTorch, JAX or DLPack); the streamed keys and values are the host arrays")
    validation.check_rank("q", a["q"], 4, _LAYOUT)
    batch, _, heads_q, head_dim = a["q"].shape
    no_keys = boundary.DeviceArray(None, (batch, 0, heads_q, head_dim), (0, 0, 0, 1), a["q"].dtype, None)
    c_type = check_qkv(a["q"], no_keys, no_keys, None)  # q's dtype, head_dim, heads, alignment
    options = AttnOptions.from_user(causal, window, align, scale, softcap, head_dim=a["q"].shape[3])
    source = _Source(kv_chunks, a["q"], ctx, chunk_tokens, seqlen_k, _masked(options))
    if source.pair:  # as one kernel sees it: a chunk (the pair's length has no bound without a mask)
        rows = min(source.total, source.chunk_tokens)
        check_qkv(a["q"], _shape_only(source.k, rows), _shape_only(source.v, rows), None)
    return ctx, a, c_type, options, source


def _seen(chunk: Chunk, rows: int, first_key: int, last_key: int) -> bool:
    """Whether some query row sees a key of the chunk (first_key..last_key from visible_keys)."""
    return bool(rows and chunk.length and chunk.start + chunk.length > first_key and chunk.start <= last_key)


def _shape_only(h: HostArray, rows: int) -> boundary.DeviceArray:
    """The shape and dtype of ``rows`` keys of a host array, for check_qkv (its strides are
    checked by _Source)."""
    return boundary.DeviceArray(None, (h.shape[0], rows, *h.shape[2:]), (0, 0, 0, 1), h.dtype, None)


def _masked(options: AttnOptions) -> bool:
    """Whether key positions matter (a causal mask or a window)."""
    return options.causal or options.window_left >= 0 or options.window_right >= 0


def _mask_fields(options: AttnOptions, seqlen_q: int, total: int | None) -> dict:
    """The kernels' mask fields for the whole key sequence. Without a mask the positions do not
    matter: the fields are those of no keys and stay as they are for every chunk
    (:func:`_at_chunk`), so any number of keys streams."""
    if total is None or not _masked(options):  # an iterable of unknown length has no mask (_Source)
        total = 0
    if seqlen_q + total > _INT32_REACH // 2:
        raise ValueError(f"with a mask, seqlen_q + seqlen_k must be at most {_INT32_REACH // 2}, got {seqlen_q} + {total}")
    return options.kernel_fields(seqlen_q, total)


def _at_chunk(fields: dict, start: int) -> dict:
    """``fields`` for a kernel whose key 0 is key ``start``: the diagonal moves with it (unmasked,
    nothing moves: the offset would pass int32 past 2**31 keys, and no kernel reads it)."""
    return shifted(fields, start) if fields["window_left"] >= 0 or fields["window_right"] >= 0 else fields


def attention_chunked(
    q, kv_chunks, *, causal=False, window=None, align="bottom_right", scale=None, softcap=None, return_lse=False,
    chunk_tokens=None, seqlen_k=None, progress=None,
):
    """Exact attention of device-resident ``q`` over keys and values streamed from host memory.

    Device memory used is two chunks of K/V plus ``q``, ``out``, ``lse`` and one fp32
    accumulator like ``out``, whatever the total number of keys.

    Parameters
    ----------
    q : ``(batch, seqlen_q, heads_q, head_dim)`` device array (CuPy, PyTorch, JAX, DLPack).
    kv_chunks : either a pair ``(k, v)`` of host arrays ``(batch, seqlen_k, heads_kv,
        head_dim)`` (NumPy, or CPU torch tensors), contiguous in ``(seqlen, heads, head_dim)``,
        cut into chunks of ``chunk_tokens`` keys; or an iterable of ``(k, v)`` chunk pairs of
        ``(batch, n_i, heads_kv, head_dim)`` (host arrays, or device arrays of q's framework and
        device), chunk ``i`` holding the keys that follow chunk ``i - 1``. The next chunk is
        drawn once the previous one's host memory has been read, so a producer may refill one
        buffer; device chunks are read in the caller's stream order. Page-locked host
        memory (``cupyx.empty_pinned``, ``torch.empty(..., pin_memory=True)``) is copied
        while the GPU computes; pageable memory is first copied by host threads into two
        page-locked staging buffers, overlapped with the copy and compute of the chunk before.
    causal, window, align, scale, softcap : as :func:`cuattn.attention`, over the positions of
        the whole key sequence. Chunks that no query row sees are not uploaded.
    return_lse : bool. Also return ``lse`` ``(batch, heads_q, seqlen_q)`` float32.
    chunk_tokens : keys per chunk for a ``(k, v)`` pair; default: 128 MiB of K and V per chunk.
    seqlen_k : the total number of keys; required for an iterable of chunks under a causal or
        window mask (where the diagonal sits depends on it), checked against the chunks.
    progress : optional callable ``progress(keys_done, keys_total)``, called as chunks finish
        on the GPU (``keys_total`` is None for an iterable of unknown length).

    Returns
    -------
    ``out`` like ``q`` (or ``(out, lse)``), in q's framework. Each chunk's partial result is
    folded into the fp32 accumulator by the forward kernel's epilogue and the sum is rounded
    to q's dtype once. The call returns when every chunk has been uploaded (host arrays may
    then be reused); the computation finishes in order on the caller's stream.
    """
    return_lse = check_bool("return_lse", return_lse)
    _check_progress(progress)
    ctx, a, c_type, options, source = _prepare(q, kv_chunks, causal, window, align, scale, softcap, chunk_tokens, seqlen_k, {})
    qa = a["q"]
    batch, seqlen_q, heads_q, head_dim = qa.shape
    ctx.stage(qa)
    out = ctx.empty(qa.shape, qa.dtype)
    lse = ctx.empty((batch, heads_q, seqlen_q), np.float32)
    acc = ctx.empty(qa.shape, np.float32)
    fields = _mask_fields(options, seqlen_q, source.total)
    first_key, last_key = visible_keys(seqlen_q, source.total, fields) if source.total is not None else (0, 2**62)

    streams = _Streams(ctx, downloads=False)
    launched, slot, done = 0, 0, []
    total, reported, end = source.total, 0, 0  # total: None for an iterable of unknown length, also once it is read
    try:
        for chunk in source:
            end = chunk.start + chunk.length
            if not _seen(chunk, seqlen_q * heads_q, first_key, last_key):
                continue
            k, v = streams.upload(slot, chunk) if chunk.on_host else (chunk.k, chunk.v)
            p = attn_params(qa, k, v, out.unwritten(), lse, options)
            set_mask(p, _at_chunk(fields, chunk.start))
            p["accum"], p["accum_strides"], p["accum_fresh"] = acc.ptr, acc.strides[:3], int(launched == 0)
            launch_forward(ctx, c_type, p, seqlen_q, heads_q, batch)
            launched += 1
            streams.computed(slot)
            done.append((streams.free[slot], chunk.start + chunk.length, chunk))
            streams.consumed(slot, chunk, source.pair)
            reported = _report(progress, done, total, len(done) - 2, reported)
            slot ^= 1
    finally:
        streams.finish()
        _release_device_chunks(ctx, done)  # also where a chunk raised: the kernels queued may still read the others
    if launched:
        sum_rows(ctx, None, acc, out)  # the sum of every chunk, rounded once
    else:  # no chunk, or no key any row sees: out = 0, lse = -inf
        ctx.zero(out)
        _fill(ctx, lse, -np.inf)
    _report_last(progress, done, total, reported, end)
    result = ctx.export(out)
    return (result, ctx.export(lse)) if return_lse else result


def _check_progress(progress) -> None:
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable progress(keys_done, keys_total) or None, got {type(progress).__name__}")


def _any_finite(ctx, x: boundary.DeviceArray) -> bool:
    """Whether a float32 device array holds a finite value (waits for the call's stream)."""
    import cupy

    if x.size == 0:
        return False
    nbytes = (sum((n - 1) * st for n, st in zip(x.shape, x.strides)) + 1) * 4
    memory = cupy.cuda.UnownedMemory(x.ptr, nbytes, x.native, ctx.device_id)
    with ctx.device, ctx.stream:
        view = cupy.ndarray(x.shape, np.float32, cupy.cuda.MemoryPointer(memory, 0), strides=tuple(st * 4 for st in x.strides))
        return bool(cupy.isfinite(view).any())


def _release_device_chunks(ctx, done: list) -> None:
    """``done`` holds the chunks still in flight (their arrays with them). CuPy's and torch's
    pools hand memory out again in the caller's stream order; other frameworks (JAX) may reuse
    a chunk's memory once it is dropped, so the host waits for the kernels that read it."""
    if done and ctx.framework not in (boundary.CUPY, boundary.TORCH) and not all(chunk.on_host for _, _, chunk in done):
        done[-1][0].synchronize()


def _report(progress, done: list, total, wait_before: int, reported: int) -> int:
    """Waits for the chunks before index ``wait_before`` (at most two chunks in flight) and
    reports them to ``progress``; returns the keys reported last (``reported`` if none now).
    Each entry of ``done`` (event, keys, chunk) holds its chunk until then."""
    while done and wait_before > 0:
        event, keys, _ = done.pop(0)
        wait_before -= 1
        event.synchronize()
        if progress is not None:
            progress(keys, total)
        reported = keys
    return reported


def _report_last(progress, done: list, total, reported: int, end: int) -> None:
    """The last reports: the chunks still in flight, then ``end`` (the keys of every chunk)
    where the chunks after the last one computed were skipped (no row sees them)."""
    if progress is None:  # nothing to wait for: the caller's stream orders what comes after
        return
    if _report(progress, done, total, len(done), reported) < end:
        progress(end, total)


def attention_chunked_backward(
    dout, q, kv_chunks, out, lse, *, causal=False, window=None, align="bottom_right", scale=None, softcap=None, dlse=None,
    chunk_tokens=None, seqlen_k=None, deterministic=False, progress=None,
):
    """Gradients of :func:`attention_chunked`, streaming the same chunks of K/V again.

    Each chunk's backward uses the global ``out`` and ``lse`` (the forward's results over all
    keys), so it gives that chunk's exact dK / dV and its share of dQ; dK / dV go back to host
    memory chunk by chunk on a second copy stream, and the kernels add the dQ shares into an
    fp32 sum, rounded once. Device memory: two chunks of K/V and of dK/dV, plus the arrays of q's size.

    Parameters
    ----------
    dout, q, out, lse : device arrays; ``lse`` from ``return_lse=True``.
    kv_chunks, causal, window, align, scale, softcap, chunk_tokens, seqlen_k, progress : exactly
        as given to the forward (an iterable of chunks must yield the same chunks again).
    dlse : optional ``(batch, heads_q, seqlen_q)`` float32 gradient flowing into ``lse``.
    deterministic : as :func:`cuattn.attention_backward`.

    Returns
    -------
    ``(dq, dk, dv)``: ``dq`` like ``q`` in q's framework. For a ``(k, v)`` pair of host arrays,
    ``dk`` and ``dv`` are host arrays of their shape and type (NumPy, or CPU torch tensors) in
    page-locked memory, complete when the call returns. For an iterable, ``dk`` and ``dv`` are
    lists with one array per chunk, where that chunk was (host chunks: page-locked host arrays).
    Chunks no query row sees get zero gradients.
    """
    deterministic = check_bool("deterministic", deterministic)
    _check_progress(progress)
    require_arrays({"dout": dout, "out": out, "lse": lse})
    ctx, a, c_type, options, source = _prepare(
        q, kv_chunks, causal, window, align, scale, softcap, chunk_tokens, seqlen_k, dict(dout=dout, out=out, lse=lse, dlse=dlse),
    )
    qa = a["q"]
    batch, seqlen_q, heads_q, head_dim = qa.shape
    check_dout(a["dout"], qa, c_type, _LAYOUT)
    check_dout(a["out"], qa, c_type, _LAYOUT, name="out")  # aligned too: backward_prep reads 16 bytes at a time
    check_row_stats(a, ("lse", "dlse"), (batch, heads_q, seqlen_q))
    ctx.stage(*a.values())

    dq = ctx.empty(qa.shape, qa.dtype)
    dq_sum = ctx.empty(qa.shape, np.float32)  # the backward kernels add each chunk's dQ into it (sum_grads)
    ctx.zero(dq_sum)
    delta = ctx.empty((batch, heads_q, seqlen_q), np.float32)
    fields = _mask_fields(options, seqlen_q, source.total)
    first_key, last_key = visible_keys(seqlen_q, source.total, fields) if source.total is not None else (0, 2**62)
    host_grads = _host_outputs(source) if source.pair else None
    results: dict[int, tuple] = {}  # an iterable's gradients by chunk index

    streams = _Streams(ctx, downloads=True)
    launched, slot, done = 0, 0, []
    total, reported, end = source.total, 0, 0  # as in attention_chunked
    try:
        for chunk in source:
            end = chunk.start + chunk.length
            if not _seen(chunk, seqlen_q * heads_q, first_key, last_key):
                results[chunk.index] = _zero_grads(ctx, chunk, host_grads)
                continue
            if chunk.on_host:
                k, v, dk, dv = streams.upload(slot, chunk)
            else:
                k, v = chunk.k, chunk.v
                dk, dv = ctx.empty(k.shape, k.dtype), ctx.empty(v.shape, v.dtype)
            attn = attn_params(qa, k, v, a["out"], a["lse"], options)
            set_mask(attn, _at_chunk(fields, chunk.start))
            p = backward_params({"dout": a["dout"], "dlse": a["dlse"]}, [dq_sum, dk, dv], delta, attn)
            p["sum_grads"] = SUM_DQ
            grid = BackwardGrid("dense", batch, seqlen_q, chunk.length, heads_q, k.shape[2], head_dim, batch * seqlen_q, batch * chunk.length)
            launch_backward(ctx, c_type, p, grid, deterministic)
            launched += 1
            streams.computed(slot)
            if chunk.on_host:
                hosts = _host_rows(host_grads, chunk) if host_grads is not None else _new_host_grads(chunk)
                streams.download(slot, (dk, dv), hosts, chunk.length)
                if host_grads is None:
                    results[chunk.index] = tuple(h.native for h in hosts)
            else:
                results[chunk.index] = (ctx.export(dk), ctx.export(dv))
            done.append((streams.free[slot], chunk.start + chunk.length, chunk))
            streams.consumed(slot, chunk, source.pair)
            reported = _report(progress, done, total, len(done) - 2, reported)
            slot ^= 1
    finally:
        streams.finish()
        _release_device_chunks(ctx, done)  # also where a chunk raised: the kernels queued may still read the others
    if not source.pair and not results and _any_finite(ctx, a["lse"]):
        raise ValueError("kv_chunks yielded no chunk, but lse has rows that saw keys: an iterable must yield the forward's chunks "
                         "again (an iterator the forward consumed yields nothing)")
    sum_rows(ctx, None, dq_sum, dq)  # every chunk's share, rounded once (zeros when none ran)
    _report_last(progress, done, total, reported, end)
    if host_grads is not None:
        return ctx.export(dq), host_grads[0].native, host_grads[1].native
    ordered = [results[i] for i in range(len(results))]
    return ctx.export(dq), [g[0] for g in ordered], [g[1] for g in ordered]


def check_row_stats(a: dict, names, shape: tuple) -> None:
    """Per-row float32 statistics (lse, dlse) ``(batch, heads_q, seqlen_q)`` with unit row stride."""
    for name in names:
        x = a[name]
        if x is None:
            continue
        validation.check_rank(name, x, 3, _LSE_LAYOUT)
        validation.check_shape(name, x, shape, _LSE_LAYOUT)
        validation.check_float32(name, x)
        validation.check_unit_last_stride(name, x)


def _pinned_like(h: HostArray, shape) -> HostArray:
    """A page-locked host array of ``shape`` and h's dtype, of h's kind (NumPy or torch)."""
    if isinstance(h.native, np.ndarray):
        import cupyx

        return host_array(cupyx.empty_pinned(shape, h.dtype))
    import torch

    return host_array(torch.empty(shape, dtype=h.native.dtype, pin_memory=True))


def _host_outputs(source: _Source) -> tuple[HostArray, HostArray]:
    return _pinned_like(source.k, source.k.shape), _pinned_like(source.v, source.v.shape)


def _host_rows(host_grads, chunk: Chunk) -> tuple[HostArray, HostArray]:
    return tuple(g.rows(chunk.start, chunk.start + chunk.length) for g in host_grads)


def _new_host_grads(chunk: Chunk) -> tuple[HostArray, HostArray]:
    return _pinned_like(chunk.k, chunk.k.shape), _pinned_like(chunk.v, chunk.v.shape)


def _zero_grads(ctx, chunk: Chunk, host_grads):
    """Zero dK, dV of a chunk no query row sees (rows of the pair's outputs, or new arrays)."""
    if host_grads is not None:
        for g in host_grads:
            g.native[:, chunk.start:chunk.start + chunk.length] = 0
        return None
    if chunk.on_host:
        grads = [h.native for h in _new_host_grads(chunk)]
        for g in grads:
            g[...] = 0
        return tuple(grads)
    grads = [ctx.empty(x.shape, x.dtype) for x in (chunk.k, chunk.v)]
    ctx.zero(*grads)
    return tuple(ctx.export(g) for g in grads)
