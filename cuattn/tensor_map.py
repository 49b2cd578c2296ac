"""Tensor maps (``CUtensorMap``) for the Hopper TMA kernels, encoded by the driver's
``cuTensorMapEncodeTiled`` (CuPy has no binding for it).

A map describes one (batch, seqlen, heads, head_dim) tensor as 4-D with head_dim innermost,
(head_dim, seqlen, heads, batch), and a box of 64 columns x ``box_rows`` rows of one head, stored
with the 128-byte swizzle that ``common/wgmma.cuh`` reads; the TMA unit zero-fills what lies past
the tensor. :func:`encode` returns None where a tensor cannot be described (an address or a
stride that is not a multiple of 16 bytes, a negative stride, no driver), and the caller then
takes a kernel that copies for itself.
"""

from __future__ import annotations

import ctypes

import numpy as np

from cuattn import driver, replay

MAP_BYTES = 128
BOX_COLUMNS = 64  # 16-bit elements: one 128-byte swizzle row
_DATA_TYPES = {"f16": 6, "bf16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _BFLOAT16
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_MAX_STRIDE = 1 << 40


def _encoder():
    """The driver's ``cuTensorMapEncodeTiled``, or None where it cannot be had."""
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    return driver.function("cuTensorMapEncodeTiled", (
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ))


def available() -> bool:
    """Whether the driver can encode maps here."""
    return _encoder() is not None


def describable(ptr: int, shape: tuple, strides: tuple, itemsize: int = 2) -> bool:
    """Whether a (batch, seqlen, heads, head_dim) tensor with unit last stride can be mapped."""
    if ptr % 16 or any(s < 0 for s in strides) or strides[3] != 1:
        return False
    return all((s * itemsize) % 16 == 0 and s * itemsize < _MAX_STRIDE for s in strides[:3])


def _encode_at(c_type: str, ptr: int, shape: tuple, strides: tuple, box_rows: int) -> bytes | None:
    entry = _encoder()
    if entry is None:
        return None
    batch, seqlen, heads, head_dim = (max(1, int(n)) for n in shape)
    dims = (ctypes.c_uint64 * 4)(head_dim, seqlen, heads, batch)
    byte_strides = (ctypes.c_uint64 * 3)(strides[1] * 2, strides[2] * 2, strides[0] * 2)
    box = (ctypes.c_uint32 * 4)(BOX_COLUMNS, box_rows, 1, 1)
    ones = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    out = ctypes.create_string_buffer(MAP_BYTES + 64)
    aligned = (ctypes.addressof(out) + 63) // 64 * 64  # the driver wants the map 64-byte aligned
    code = entry(aligned, _DATA_TYPES[c_type], 4, ptr, dims, byte_strides, box, ones, 0, _SWIZZLE_128B, _L2_PROMOTION_256B, 0)
    return ctypes.string_at(aligned, MAP_BYTES) if code == 0 else None


_STAND_INS = (1 << 40, 0x7ABC_DEF1_2340)  # addresses the driver accepts, for maps whose address is written afterwards
TAGGED = 1 << 48  # device pointers lie below: addresses from here on are a recording's tags


def encode(c_type: str, ptr: int, shape: tuple, strides: tuple, box_rows: int) -> bytes | None:
    """The 128 bytes of the map of a (batch, seqlen, heads, head_dim) tensor of 16-bit elements
    (strides in elements), or None where it cannot be encoded.

    An address past the 48-bit range of device pointers (the tagged stand-ins of
    cuattn/replay.py's recordings, which the driver refuses) is written into the map of the same
    tensor encoded at an address the driver accepts, where the driver keeps the address in the
    map's first word alone: checked on this very map, encoded at two stand-in addresses that
    differ in most of their bits (else None); the plan's replay then writes each call's address
    there like any other parameter word."""
    if c_type not in _DATA_TYPES or not describable(ptr, shape, strides):
        return None
    if ptr < TAGGED:
        return _encode_at(c_type, ptr, shape, strides, box_rows)
    a, b = (_encode_at(c_type, stand_in, shape, strides, box_rows) for stand_in in _STAND_INS)
    if a is None or b is None or a[8:] != b[8:] or [int.from_bytes(m[:8], "little") for m in (a, b)] != list(_STAND_INS):
        return None
    return ptr.to_bytes(8, "little") + a[8:]


def query_shape(attn: np.void) -> tuple[int, int, int, int]:
    """The shape of an attention call's q (and out, dout) from its parameters (AttnParams)."""
    return int(attn["batch"]), int(attn["seqlen_q"]), int(attn["heads_q"]), int(attn["head_dim"])


def key_shape(attn: np.void) -> tuple[int, int, int, int]:
    """The shape of its k and v: the sequences, a contiguous KV cache's rows, or a paged
    cache's pages."""
    if attn["block_table"]:
        rows, length = int(attn["cache_rows"]), int(attn["page_size"])
    else:
        rows, length = int(attn["cache_rows"] or attn["batch"]), int(attn["seqlen_k"])
    return rows, length, int(attn["heads_kv"]), int(attn["head_dim"])


def put_maps(c_type: str, target: np.void, tensors) -> bool:
    """Writes the map of each (name, address, strides without the unit last one, shape, box
    rows) of ``tensors`` into ``target``'s ``{name}_map``; False where one cannot be described
    (the caller takes a kernel that copies for itself)."""
    for name, address, strides, shape, rows in tensors:
        strides = tuple(int(s) for s in strides) + (1,)
        address = int(address)
        encoded = encode(c_type, address, shape, strides, rows)
        if encoded is None:
            if address >= TAGGED and available() and describable(address, shape, strides):
                # A recording whose plan would take the copying kernel where the call itself takes this one.
                raise replay.Uncacheable("tensor maps cannot be recorded on this driver")
            return False
        target[f"{name}_map"] = np.frombuffer(encoded, np.uint8)
    return True
