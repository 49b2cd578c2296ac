import json
import os
import re
import subprocess
import sys

import pytest

from conftest import HAS_GPU
from cuattn import cli


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cuattn", *args], capture_output=True, text=True, env=env)


def _usage_error(capsys, *argv) -> str:
    """Runs the command line in-process; it must stop with argparse's usage error (exit 2)."""
    with pytest.raises(SystemExit) as stop:
        cli.main(list(argv))
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert "compiled" not in captured.out  # refused before any compile
    return captured.err


def test_info_runs_anywhere():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    assert "cuattn" in r.stdout and "cache" in r.stdout and "sources sha256" in r.stdout


@pytest.mark.skipif(HAS_GPU, reason="checks the message on machines without a GPU")
def test_selftest_without_gpu_says_so_and_fails():
    r = _run("selftest")
    assert r.returncode != 0
    assert "needs a CUDA GPU" in r.stdout
    assert "insufficient" not in r.stdout  # CUDA's wording when no driver is loaded at all
    import cupy

    if cupy.cuda.runtime.driverGetVersion() == 0:
        assert "no NVIDIA driver is loaded" in r.stdout


@pytest.mark.gpu
def test_selftest_passes_on_the_gpu():
    r = _run("selftest")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "selftest passed" in r.stdout


@pytest.mark.gpu
def test_warmup_fills_the_manifest(tmp_path):
    env = {**os.environ, "CUPY_CACHE_DIR": str(tmp_path)}  # never the user's kernel cache
    r = _run("warmup", "merge/float", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "merge/float/vec4" in r.stdout
    manifest = json.loads((tmp_path / "cuattn-manifest.json").read_text())
    assert any("/merge/float/vec4/" in key for key in manifest)
    info = _run("info", env=env)
    assert str(tmp_path) in info.stdout and "merge/float/vec4" in info.stdout


def test_compile_command_reports_a_table(tmp_path):
    report = tmp_path / "report.json"
    r = _run("compile", "merge/sum_partials/float_to_f16", "--arch", "sm_80", "--json", str(report))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "merge/sum_partials/float_to_f16" in r.stdout and "1 compiled, 0 failed" in r.stdout
    assert [row["uri"] for row in json.loads(report.read_text())] == ["merge/sum_partials/float_to_f16"]


def test_a_name_that_matches_no_variant_is_an_error(capsys):
    err = _usage_error(capsys, "compile", "merge/float/vec1", "nosuch")
    assert "'nosuch'" in err and "'merge/float/vec1'" not in err
    assert "'nosuch'" in _usage_error(capsys, "warmup", "nosuch")


@pytest.mark.parametrize("jobs", ["0", "-2", "two"])
def test_compile_refuses_jobs_below_one(capsys, jobs):
    assert "--jobs" in _usage_error(capsys, "compile", "merge/float/vec1", "--jobs", jobs)


@pytest.mark.parametrize("arch", ["bogus", "sm_75", "sm_80a", "80", "sm_80,sm_9", ""])
def test_compile_refuses_an_unknown_arch(capsys, arch):
    err = _usage_error(capsys, "compile", "merge/float/vec1", "--arch", arch)
    assert "argument --arch" in err and "sm_80" in err  # names the option and shows what it accepts


def test_compile_accepts_the_targets_cuattn_builds_for():
    assert cli.arch_list("sm_80, sm_90a,sm_100f") == ("sm_80", "sm_90a", "sm_100f")


@pytest.mark.parametrize("where", ["missing_dir/report.json", "."])
def test_compile_checks_the_json_path_before_compiling(capsys, tmp_path, where):
    err = _usage_error(capsys, "compile", "merge/float/vec1", "--arch", "sm_80", "--json", str(tmp_path / where))
    assert "--json" in err


@pytest.mark.parametrize("command", [(), ("info",), ("selftest",), ("warmup",), ("compile",)])
def test_help_is_plain_text(command):
    r = _run(*command, "--help")
    assert r.returncode == 0, r.stderr
    assert not re.search(r"``|:func:|:mod:|:data:", r.stdout), r.stdout
    description = r.stdout.split("\n\n")[1]  # between the usage and the arguments
    assert not description.startswith(("positional arguments", "options")), r.stdout


def test_every_compile_option_has_help():
    text = _run("compile", "--help").stdout
    for option in ("--arch ARCH", "--jobs JOBS", "--json JSON"):
        assert re.search(re.escape(option) + r"\s+\w", text), f"{option} has no help text:\n{text}"


def test_compile_without_cupy_says_what_to_install(monkeypatch, capsys):
    """It died with a traceback from inside the offline compiler."""
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)
    assert cli.main(["compile", "merge", "--arch", "sm_80"]) == 2
    assert "compile needs CuPy and NVRTC: pip install 'cupy-cuda13x>=14'" in capsys.readouterr().err


def test_the_manifest_is_keyed_by_the_installation(monkeypatch, tmp_path):
    """CuPy's cache key holds the -I path (this install's cuda_src/) and the compiler's version:
    kernels warmed from another checkout are recompiled here, and info listed them as cached."""
    from cuattn import loader

    here = loader.manifest_prefix()
    copy = tmp_path / "cuda_src"
    import shutil

    shutil.copytree(loader.source_dir(), copy)
    monkeypatch.setattr(loader, "source_dir", lambda: copy)
    loader.manifest_prefix.cache_clear()
    loader.source_hash.cache_clear()
    try:
        assert loader.source_hash() and loader.manifest_prefix() != here
    finally:
        loader.manifest_prefix.cache_clear()
        loader.source_hash.cache_clear()
