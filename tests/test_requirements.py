"""cuattn.requirements: version floors (one table, the same in pyproject.toml) and plain
messages when a package is too old or no CUDA GPU is there."""

import pathlib
import sys
import types

import numpy as np
import pytest

tomllib = pytest.importorskip("tomllib", reason="pyproject.toml is read with tomllib (Python 3.11+)")
from packaging.requirements import Requirement
from packaging.version import Version

import cuattn
from conftest import HAS_GPU
from cuattn import requirements

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
MODULE_OF = {"cupy-cuda12x": "cupy", "cupy-cuda13x": "cupy", "torch": "torch", "jax": "jax"}


def _extras() -> dict[str, list[Requirement]]:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in extras.items()}


def test_pyproject_extras_declare_the_floors_of_the_requirements_module():
    declared = {}
    for extra, reqs in _extras().items():
        for req in reqs:
            if req.name in MODULE_OF:
                floors = [s.version for s in req.specifier if s.operator == ">="]
                assert floors, f"extra {extra!r}: {req} declares no floor"
                declared[(extra, req.name)] = floors[0]
    expected = {
        ("cu12", "cupy-cuda12x"): "cupy", ("cu13", "cupy-cuda13x"): "cupy", ("torch", "torch"): "torch", ("jax", "jax"): "jax",
    }
    assert set(declared) == set(expected)
    for key, module in expected.items():
        assert Version(declared[key]) == Version(requirements.FLOORS[module]), f"{key}: {declared[key]} vs FLOORS {requirements.FLOORS[module]}"


@pytest.mark.parametrize(
    "found, ok", [("14.0.0", True), ("14.2.0", True), ("13.6.0", False), ("13.3", False), ("15", True)]
)
def test_cupy_floor(monkeypatch, found, ok):
    monkeypatch.setattr(requirements, "installed_version", lambda package: found)
    if ok:
        requirements.require("cupy", by="cuattn")
    else:
        with pytest.raises(ImportError, match=rf"^cuattn needs cupy >= 14, found {found} \(pip install 'cupy-cuda13x>=14'"):
            requirements.require("cupy", by="cuattn")


@pytest.mark.parametrize("found", ["2.9.1", "2.4.0", "1.13.1+cu117"])
def test_too_old_torch_is_named(monkeypatch, found):
    monkeypatch.setattr(requirements, "installed_version", lambda package: found)
    with pytest.raises(ImportError, match=rf"^cuattn.torch needs torch >= 2.10, found {found.replace('+', '[+]')} "):
        requirements.require("torch", by="cuattn.torch")


def test_versions_at_or_above_the_floor_pass(monkeypatch):
    for package, found in [("torch", "2.10.0+cu130"), ("torch", "2.11.0"), ("jax", "0.6.1"), ("jax", "0.11.2"), ("cupy", "14.0.0rc1")]:
        monkeypatch.setattr(requirements, "installed_version", lambda p, found=found: found)
        requirements.require(package, by="cuattn")


def test_a_missing_package_is_named_with_what_to_install(monkeypatch):
    """The hints name packages on PyPI (cuattn itself is installed from its source tree)."""
    monkeypatch.setattr(requirements, "installed_version", lambda package: None)
    with pytest.raises(ImportError, match=r"cuattn.jax needs jax >= 0.6.1, which is not installed \(pip install 'jax>=0.6.1'"):
        requirements.require("jax", by="cuattn.jax")
    assert all("cuattn[" not in hint for hint in requirements.INSTALL_HINTS.values())


def test_a_call_without_cupy_names_it(monkeypatch):
    """NumPy inputs reach the upload before anything else imports CuPy: that import raised a
    bare ModuleNotFoundError, not the message with the hint."""
    import sys

    import numpy as np

    import cuattn

    monkeypatch.setitem(sys.modules, "cupy", None)
    requirements.check_cupy.cache_clear()  # an earlier call in this process found CuPy (the check runs once)
    one = np.ones((1, 4, 1, 8), np.float16)
    try:
        with pytest.raises(ImportError, match="cuattn needs cupy >= 14, which is not installed"):
            cuattn.attention(one, one, one)
    finally:
        requirements.check_cupy.cache_clear()


def test_unknown_package_and_version_are_refused():
    with pytest.raises(ValueError, match="package must be one of"):
        requirements.require("tensorflow", by="cuattn")
    with pytest.raises(ValueError, match="version must start with a release number"):
        requirements.version_tuple("latest")


def _import_fresh(monkeypatch, name: str):
    monkeypatch.delitem(sys.modules, name, raising=False)
    __import__(name)


def test_torch_adapter_checks_the_version_at_import(monkeypatch):
    """A too-old torch is named at import, before any torch.library API is touched."""
    fake = types.ModuleType("torch")
    fake.__version__ = "2.3.1"
    monkeypatch.setitem(sys.modules, "torch", fake)
    with pytest.raises(ImportError, match=r"^cuattn.torch needs torch >= 2.10, found 2.3.1"):
        _import_fresh(monkeypatch, "cuattn.torch")


def test_jax_adapter_checks_the_version_at_import(monkeypatch):
    """A JAX without jax.experimental.buffer_callback is named at import."""
    fake, fake_numpy = types.ModuleType("jax"), types.ModuleType("jax.numpy")
    fake.__version__, fake.numpy = "0.5.3", fake_numpy
    monkeypatch.setitem(sys.modules, "jax", fake)
    monkeypatch.setitem(sys.modules, "jax.numpy", fake_numpy)
    with pytest.raises(ImportError, match=r"^cuattn.jax needs jax >= 0.6.1, found 0.5.3"):
        _import_fresh(monkeypatch, "cuattn.jax")


def _qkv():
    q = np.ones((1, 16, 2, 64), np.float16)
    return q, q.copy(), q.copy()


def test_too_old_cupy_is_named_at_the_first_gpu_use(monkeypatch):
    monkeypatch.setattr(requirements, "installed_version", lambda package: "13.6.0")
    requirements.check_cupy.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"^cuattn needs cupy >= 14, found 13.6.0"):
            cuattn.attention(*_qkv())
    finally:
        requirements.check_cupy.cache_clear()


def test_bad_arguments_are_named_before_any_gpu_check():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="v has dtype float32"):
        cuattn.attention(q, k, v.astype(np.float32))
    with pytest.raises(ValueError):
        cuattn.attention(q, k[:, :, :, :32], v)


@pytest.mark.skipif(HAS_GPU, reason="checks the message on machines without a GPU")
def test_numpy_call_without_gpu_says_so_plainly():
    with pytest.raises(RuntimeError, match=r"^cuattn: no CUDA GPU found \(") as caught:
        cuattn.attention(*_qkv())
    assert "cudaError" not in str(caught.value) and "insufficient" not in str(caught.value)
    assert caught.value.__cause__ is not None  # CUDA's own error stays chained


class _Runtime:
    """Stands in for cupy.cuda.runtime: a device count or a CUDA status, and a driver version."""

    def __init__(self, count=1, status=None, driver=13000, runtime=13020):
        import cupy

        self.CUDARuntimeError = cupy.cuda.runtime.CUDARuntimeError
        self._count, self._status, self._driver, self._runtime = count, status, driver, runtime

    def getDeviceCount(self):
        if self._status is not None:
            raise self.CUDARuntimeError(self._status)
        return self._count

    def driverGetVersion(self):
        return self._driver

    def runtimeGetVersion(self):
        return self._runtime


@pytest.mark.parametrize(
    "runtime, expected",
    [
        (_Runtime(status=35, driver=0), "no NVIDIA driver is loaded"),
        (_Runtime(status=35, driver=11080), "the NVIDIA driver supports CUDA 11.8, older than the CUDA 13.2 this CuPy"),
        (_Runtime(status=100), "the NVIDIA driver sees no CUDA device"),
        (_Runtime(count=0), "the NVIDIA driver sees no CUDA device"),
        (_Runtime(status=999), "CUDA reports cudaErrorUnknown"),
        (_Runtime(count=1), None),
    ],
)
def test_gpu_problem_in_words(monkeypatch, runtime, expected):
    import cupy

    monkeypatch.setattr(cupy.cuda, "runtime", runtime)
    problem = requirements.gpu_problem()
    assert problem == expected if expected is None else problem.startswith(expected), problem
    if expected is None:
        requirements.require_gpu()
    else:
        with pytest.raises(RuntimeError, match=r"^cuattn: no CUDA GPU found \(" + expected[:20]):
            requirements.require_gpu()
