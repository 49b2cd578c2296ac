"""cuattn.launch: the driver structures handed to cuLaunchKernelEx match the CUDA ABI, and which
kernels take the programmatic dependent launch (no GPU needed)."""

import ctypes

from cuattn import launch
from cuattn.kernels import decode


def test_launch_structures_match_the_driver_abi():
    # CUlaunchAttribute: a 4-byte id, 4 bytes of padding, a 64-byte value union (its int first).
    assert ctypes.sizeof(launch._Attribute) == 72 and launch._Attribute.value.offset == 8
    # CUlaunchConfig: 7 unsigned ints, then the stream, the attribute pointer and their count.
    assert launch._Config.stream.offset == 32 and launch._Config.attrs.offset == 40 and launch._Config.num_attrs.offset == 48
    assert ctypes.sizeof(launch._Config) == 56
    assert launch._PROGRAMMATIC_STREAM_SERIALIZATION == 6


def test_only_the_merge_of_the_splits_is_a_dependent_launch():
    variants = decode.variants()
    assert {v.kernel for v in variants if v.dependent} == {"decode_combine"}


def test_pdl_switch(monkeypatch):
    monkeypatch.setenv("CUATTN_PDL", "0")
    assert not launch.enabled()
    assert launch.launch_dependent(None, (1, 1, 1), (32, 1, 1), 0, 0, b"") is False
    monkeypatch.setenv("CUATTN_PDL", "1")
    assert launch.enabled()
