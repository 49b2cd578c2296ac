"""The benchmark suite's host-side pieces: grid, FLOP counts, README generation."""

import json
import pathlib

import numpy as np
import pytest

from benchmarks import cases, readme


def test_flop_convention():
    c = cases.Case("fwd", 2, 1024, 1024, 16, 16, 128, False)
    assert c.flops == 4 * 2 * 16 * 1024 * 1024 * 128
    assert cases.Case("fwd", 2, 1024, 1024, 16, 16, 128, True).flops == c.flops / 2
    assert cases.Case("bwd", 2, 1024, 1024, 16, 16, 128, False).flops == 2.5 * c.flops
    assert cases.Case("fwdbwd", 2, 1024, 1024, 16, 16, 128, False).flops == 3.5 * c.flops
    decode = cases.Case("decode", 16, 1, 4096, 32, 8, 128, False)
    assert decode.kv_bytes == 2 * 16 * 4096 * 8 * 128 * 2 and decode.unit == "GB/s"
    assert decode.rate(1.0) == decode.kv_bytes / 1e6


def test_default_grid_covers_the_issue():
    grid = cases.default_grid()
    training = [c for c in grid if c.mode != "decode"]
    assert {c.head_dim for c in training} == {64, 128, 256, *cases.MIDDLE_HEAD_DIMS}
    assert {c.seqlen_k for c in training} >= {512, 1024, 4096, 16384, 32768}
    assert {c.mode for c in grid} == set(cases.MODES)
    assert any(c.heads_q != c.heads_kv for c in training) and any(c.dtype == "float16" for c in grid)
    assert all(c.batch * c.seqlen_q >= 16384 for c in training)
    assert len(cases.default_grid(quick=True)) < len(grid) / 5


def test_case_round_trips_through_a_result_row():
    c = cases.Case("bwd", 4, 4096, 4096, 16, 2, 128, True)
    assert cases.case_of({**c.__dict__, "cuattn": 1.0}) == c


def _write_suite(path: pathlib.Path, name: str = "suite.json", **env) -> None:
    row = {**cases.Case("fwd", 16, 1024, 1024, 16, 16, 128, True).__dict__, "unit": "TFLOP/s", "cuattn": 300.0, "sdpa_flash": 250.0, "sdpa_cudnn": None, "sdpa_cudnn_skip": "refused"}
    env = {"gpu": "GPU", "date": "2026-11-22", "cuattn_version": "abc", "cupy": "14", "seconds": 1.0, **env}
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(json.dumps({"environment": env, "rows": [row]}))


def test_performance_page_and_summary_are_generated_from_results(tmp_path):
    results = tmp_path / "bench"
    _write_suite(results)
    page = readme.performance_page(results, tmp_path, tmp_path / "docs" / "performance.md")
    assert "| 128 | 1024 | 16 | 16/16 | yes | bfloat16 | 300 | 250 | - | 1.20 | - |" in page
    assert "## Suite, GPU" in page and "Forward, TFLOP/s, GPU:" in page  # every table names its GPU
    assert "![fwd](../bench/suite_fwd.png)" in page  # links relative to the page
    assert f"(not measured yet: run `PYTHONPATH=. python -m benchmarks paper --out {results}`)" in page  # no file, no numbers
    block = readme.section(results, tmp_path, tmp_path / "README.md", tmp_path / "docs" / "performance.md")
    assert "| Forward | 128 | 1 | 300-300 TFLOP/s | 1.20 (1.20-1.20) | - |" in block
    assert "![fwd](bench/suite_fwd.png)" in block and "(docs/performance.md)" in block
    assert f"not measured yet: run `PYTHONPATH=. python -m benchmarks --quick --out {results}`" in block


def _lm_result(out_dir: pathlib.Path, monkeypatch) -> None:
    """docs/lm_torch.json as examples/train_lm_torch.py writes it (through its own report)."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "examples"))
    import lm_data

    monkeypatch.setattr(lm_data, "plot_curves", lambda *args: None)  # matplotlib is not needed here
    curves = {"cuattn": np.r_[np.linspace(3.0, 1.1, 50), np.full(50, 1.04)], "PyTorch SDPA": np.r_[np.linspace(3.0, 1.1, 50), np.full(50, 1.05)]}
    seconds = {"cuattn": (12.34, 2.5), "PyTorch SDPA": (10.0, 1.5)}
    lm_data.report(curves, seconds, out_dir, "lm_torch", "char LM", "GPU X", {"steps": 100, "batch": 4, "seqlen": 64, "versions": {}})


def test_readme_blocks_are_rewritten_from_result_files_only(tmp_path, monkeypatch):
    results, lm = tmp_path / "bench", tmp_path / "docs"
    target, page = tmp_path / "README.md", tmp_path / "docs" / "performance.md"
    target.write_text(f"intro\n{readme.LM_BEGIN}\nold lm\n{readme.LM_END}\nmiddle\n{readme.BEGIN}\nold\n{readme.END}\noutro\n")
    args = ["--results", str(results), "--lm", str(lm), "--readme", str(target), "--performance", str(page)]
    readme.main(args)
    text = target.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert f"(not measured yet: run `python examples/train_lm_torch.py --out {lm}`)" in text
    assert f"not measured yet: run `PYTHONPATH=. python -m benchmarks --out {results}`" in text

    _write_suite(results)
    _write_suite(results, "suite_quick.json", seconds=21.5, gpu="GPU Q", quick=True, options=f"--quick --out {results}")
    _lm_result(lm, monkeypatch)
    readme.main(args)
    text, first_page = target.read_text(), page.read_text()
    assert f"`python -m benchmarks --quick --out {results}`: 21.5 s on the GPU Q" in text
    assert "GPU X (" in text and "last-50-step mean loss 1.0400 (cuattn) vs 1.0500 (PyTorch SDPA)" in text
    assert "wall time per run 12.3 s vs 10.0 s (2.5 s / 1.5 s of it the first step" in text
    assert "| 128 | 1024 | 16 | 16/16 | yes | bfloat16 | 300 |" in first_page
    readme.main(args)  # deterministic: a second run changes nothing
    assert target.read_text() == text and page.read_text() == first_page

    with pytest.raises(SystemExit):
        (tmp_path / "plain.md").write_text(f"{readme.BEGIN}\n{readme.END}\n")  # no language-model block
        readme.main([*args[:4], "--readme", str(tmp_path / "plain.md"), *args[6:]])


def test_committed_results_keep_measurements_apart_from_environment():
    data = json.loads((pathlib.Path(__file__).parents[1] / "docs" / "bench" / "suite.json").read_text())
    columns = {k for row in data["rows"] for k in row}
    assert not columns & set(data["environment"]), "an environment key would overwrite a measured column in suite.csv"
    assert all(isinstance(row["cuattn"], float) for row in data["rows"] if row["cuattn"] is not None)
