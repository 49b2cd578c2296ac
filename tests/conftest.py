import os

import pytest


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _gpu_available()


def pytest_report_header(config):
    return f"cuattn: GPU {'present' if HAS_GPU else 'absent'}; CUPY_CACHE_DIR={os.environ.get('CUPY_CACHE_DIR', '(default)')}"


def pytest_collection_modifyitems(config, items):
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
