"""cuattn.launch: the driver structures handed to cuLaunchKernelEx match the CUDA ABI, and which
kernels take the programmatic dependent launch (no GPU needed)."""

import ctypes

from cuattn import launch


def test_launch_structures_match_the_driver_abi():
    # CUlaunchAttribute: a 4-byte id, 4 bytes of padding, a 64-byte value union (its int first).
    assert ctypes.sizeof(launch._Attribute) == 72 and launch._Attribute.value.offset == 8
    # CUlaunchConfig: 7 unsigned ints, then the stream, the attribute pointer and their count.
    assert launch._Config.stream.offset == 32 and launch._Config.attrs.offset == 40 and launch._Config.num_attrs.offset == 48
    assert ctypes.sizeof(launch._Config) == 56
    assert launch._PROGRAMMATIC_STREAM_SERIALIZATION == 6


def test_the_decode_family_takes_dependent_launches():
    """Each kernel of the family waits for the grid before it (common/dependent_launch.cuh), so
    every one may take the programmatic launch; no kernel of another family does (they do not wait)."""
    from cuattn.kernels import all_variants

    dependent = {v.kernel for v in all_variants() if v.dependent}
    assert dependent == {"decode", "decode_combine", "append_kv"}


def test_pdl_switch(monkeypatch):
    monkeypatch.setenv("CUATTN_PDL", "0")
    assert not launch.enabled()
    assert launch.launch_dependent(None, (1, 1, 1), (32, 1, 1), 0, 0, b"", 0) is False
    monkeypatch.setenv("CUATTN_PDL", "1")
    assert launch.enabled()


def test_a_refused_dependent_launch_warns_once_and_turns_them_off(monkeypatch):
    """The driver's refusal is not silent: one RuntimeWarning with its code, then every later
    launch goes the ordinary way without asking the driver again."""
    import warnings

    import pytest

    calls = []

    def refusing_entry(config, function, params, extra):
        calls.append(function)
        return 801  # CUDA_ERROR_NOT_SUPPORTED

    class Function:
        ptr = 1234

    monkeypatch.setattr(launch, "refused", None)
    monkeypatch.setattr(launch, "_driver_entry", lambda: refusing_entry)
    monkeypatch.setattr(launch, "supported", lambda device_id: True)
    monkeypatch.setenv("CUATTN_PDL", "1")
    taken = launch.taken
    with pytest.warns(RuntimeWarning, match=r"CUresult 801"):
        assert launch.launch_dependent(Function(), (1, 1, 1), (32, 1, 1), 0, 0, b"\0" * 8, 0) is False
    assert launch.refused == 801 and not launch.enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launch.launch_dependent(Function(), (1, 1, 1), (32, 1, 1), 0, 0, b"\0" * 8, 0) is False
        assert launch.DependentLaunch(Function(), (1, 1, 1), (32, 1, 1), 0)(0, 0) is False
    assert calls == [1234] and launch.taken == taken


def test_other_driver_failures_fall_back_for_that_launch_only(monkeypatch):
    """A failure that is not a refusal of the launch form (here CUDA_ERROR_INVALID_CONTEXT, a
    thread without a current context) launches that kernel the ordinary way, silently, and the
    next launch asks the driver again."""
    import warnings

    codes = iter([201, 0])

    class Function:
        ptr = 1234

    monkeypatch.setattr(launch, "refused", None)
    monkeypatch.setattr(launch, "_driver_entry", lambda: lambda config, function, params, extra: next(codes))
    monkeypatch.setattr(launch, "supported", lambda device_id: True)
    monkeypatch.setenv("CUATTN_PDL", "1")
    taken = launch.taken
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launch.launch_dependent(Function(), (1, 1, 1), (32, 1, 1), 0, 0, b"\0" * 8, 0) is False
    assert launch.refused is None and launch.enabled()
    assert launch.launch_dependent(Function(), (1, 1, 1), (32, 1, 1), 0, 0, b"\0" * 8, 0) is True
    assert launch.taken == taken + 1


def test_every_dependent_kernel_waits_for_the_grid_before_it():
    """A kernel marked dependent starts while the one before it on the stream may still run: its
    source must wait for it (wait_for_previous_grid) before touching memory."""
    import pathlib

    from cuattn.kernels import all_variants
    from cuattn.loader import source_dir

    for v in {v.source: v for v in all_variants() if v.dependent}.values():
        text = (pathlib.Path(source_dir()) / v.source).read_text()
        assert "wait_for_previous_grid();" in text, v.source
