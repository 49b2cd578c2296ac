import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# JAX takes three quarters of the GPU's memory at its first use unless told otherwise; here it
# shares the GPU with CuPy and PyTorch in one process, and shards of the suite may run side by
# side on one GPU (README).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _gpu_available()


_warmup: subprocess.Popen | None = None


def pytest_configure(config):
    """With a GPU, a background process compiles every kernel variant into CuPy's disk cache
    (``python -m cuattn warmup --all``, NVRTC on three quarters of the cores) while the tests
    run: they compile what they launch first, one at a time, and then mostly find it compiled.
    ``CUATTN_TEST_WARMUP=0`` turns it off. It dies with the test process, however that ends."""
    global _warmup, _DEADLINE
    _DEADLINE = _deadline()
    _shard()  # a malformed value stops the run before collection
    if not HAS_GPU or os.environ.get("CUATTN_TEST_WARMUP", "1") == "0" or hasattr(config, "workerinput"):
        return
    if config.option.collectonly or config.option.help or not _shared_gpu():
        return
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    jobs = max(1, (os.cpu_count() or 1) * 3 // 4)
    _warmup = subprocess.Popen([sys.executable, "-m", "cuattn", "warmup", "--all", "--jobs", str(jobs)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)


def _shared_gpu() -> bool:
    """Whether another process may use GPU 0 beside the tests (not an exclusive compute mode)."""
    import cupy

    try:
        return cupy.cuda.runtime.getDeviceProperties(0).get("computeMode", 0) == 0
    except Exception:  # a property CuPy does not report: assume the default mode
        return True


def _die_with_parent() -> None:
    """In the warmup process before it runs: SIGKILL when the test process ends (Linux)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _deadline() -> float | None:
    text = os.environ.get("CUATTN_TEST_DEADLINE_S")
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise pytest.UsageError(f"CUATTN_TEST_DEADLINE_S must be a number of seconds, got {text!r}") from None


_DEADLINE: float | None = None
_START = time.monotonic()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``CUATTN_TEST_DEADLINE_S``: start no test after that many seconds, so that a run under a
    hard time limit still ends with pytest's summary (marked interrupted) instead of none."""
    yield
    if _DEADLINE is not None and nextitem is not None and time.monotonic() - _START > _DEADLINE:
        item.session.shouldstop = f"CUATTN_TEST_DEADLINE_S={_DEADLINE:g} reached: the tests after {item.nodeid} did not run"


def pytest_unconfigure(config):
    if _warmup is not None:
        _warmup.kill()
        _warmup.wait()


_SHARD_KEY = pytest.StashKey[str]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _SHARD_KEY in config.stash:
        terminalreporter.write_line(f"cuattn: {config.stash[_SHARD_KEY]}")


def pytest_report_header(config):
    warmup = f"; kernels compiling in a background process ({_warmup.pid})" if _warmup is not None else ""
    return f"cuattn: GPU {'present' if HAS_GPU else 'absent'}; CUPY_CACHE_DIR={os.environ.get('CUPY_CACHE_DIR', '(default)')}{warmup}"


def _shard() -> tuple[int, int] | None:
    text = os.environ.get("CUATTN_TEST_SHARD")
    if not text:
        return None
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        index = count = 0
    if not 1 <= index <= count:
        raise pytest.UsageError(f"CUATTN_TEST_SHARD must be I/N with 1 <= I <= N, got {text!r}")
    return index, count


def pytest_collection_modifyitems(config, items):
    """``CUATTN_TEST_SHARD=I/N``: run every N-th collected test starting at the I-th (round robin
    over the collection order, so each shard gets a share of every file), for a suite split
    over several runs under a per-run time limit; the N shards together run every test once."""
    shard = _shard()
    if shard is not None:
        index, count = shard
        kept = [item for position, item in enumerate(items) if position % count == index - 1]
        dropped = [item for position, item in enumerate(items) if position % count != index - 1]
        config.hook.pytest_deselected(items=dropped)
        config.stash[_SHARD_KEY] = f"CUATTN_TEST_SHARD={index}/{count}: {len(kept)} of the {len(items)} collected tests"
        items[:] = kept
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_offline = pytest.mark.skip(reason="offline compile runs in CI (no GPU); here the GPU tests compile what they run")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "offline" in item.keywords and HAS_GPU:
            item.add_marker(skip_offline)


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Each test records its own launch plans (cuattn.replay), so that a test that changes
    what plans depend on (a monkeypatched device limit, a spied kernel loader) sees them made."""
    from cuattn import replay

    replay.clear()
    yield
