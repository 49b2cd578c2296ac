import subprocess
import sys

import pytest

from conftest import HAS_GPU


def _run(*args):
    return subprocess.run([sys.executable, "-m", "cuattn", *args], capture_output=True, text=True)


def test_info_runs_anywhere():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    assert "cuattn" in r.stdout and "cache" in r.stdout and "sources sha256" in r.stdout


@pytest.mark.skipif(HAS_GPU, reason="checks the message on machines without a GPU")
def test_selftest_without_gpu_says_so_and_fails():
    r = _run("selftest")
    assert r.returncode != 0
    assert "needs a CUDA GPU" in r.stdout


@pytest.mark.gpu
def test_selftest_passes_on_the_gpu():
    r = _run("selftest")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "selftest passed" in r.stdout


@pytest.mark.gpu
def test_warmup_fills_the_manifest(tmp_path):
    r = _run("warmup", "merge/float")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "merge/float/vec4" in r.stdout
    info = _run("info")
    assert "merge/float/vec4" in info.stdout


def test_compile_command_reports_a_table():
    r = _run("compile", "merge/float/vec1", "--arch", "sm_80")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "merge/float/vec1" in r.stdout and "1 compiled, 0 failed" in r.stdout
