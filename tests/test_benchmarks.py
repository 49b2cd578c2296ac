"""The benchmark suite's host-side pieces: grid, FLOP counts, README generation."""

import json
import pathlib

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
    assert {c.head_dim for c in training} == {64, 128, 256}
    assert {c.seqlen_k for c in training} >= {512, 1024, 4096, 16384, 32768}
    assert {c.mode for c in grid} == set(cases.MODES)
    assert any(c.heads_q != c.heads_kv for c in training) and any(c.dtype == "float16" for c in grid)
    assert all(c.batch * c.seqlen_q >= 16384 for c in training)
    assert len(cases.default_grid(quick=True)) < len(grid) / 5


def test_case_round_trips_through_a_result_row():
    c = cases.Case("bwd", 4, 4096, 4096, 16, 2, 128, True)
    assert cases.case_of({**c.__dict__, "cuattn": 1.0}) == c


def test_readme_section_is_generated_from_results(tmp_path):
    row = {**cases.Case("fwd", 16, 1024, 1024, 16, 16, 128, True).__dict__, "unit": "TFLOP/s", "cuattn": 300.0, "sdpa_flash": 250.0, "sdpa_cudnn": None, "sdpa_cudnn_skip": "refused"}
    env = {"gpu": "GPU", "date": "2026-11-22", "cuattn_version": "abc", "cupy": "14", "seconds": 1.0}
    (tmp_path / "suite.json").write_text(json.dumps({"environment": env, "rows": [row]}))
    text = readme.section(tmp_path)
    assert "| 128 | 1024 | 16 | 16/16 | yes | bfloat16 | 300 | 250 | - | 1.20 | - |" in text
    assert "suite_fwd.png" in text and "no results yet" in text  # the paper / accuracy files are absent
    target = tmp_path / "README.md"
    target.write_text(f"intro\n{readme.BEGIN}\nold\n{readme.END}\noutro\n")
    readme.main(["--results", str(tmp_path), "--readme", str(target)])
    assert "old" not in target.read_text() and "300" in target.read_text() and target.read_text().endswith("outro\n")
    with pytest.raises(SystemExit):
        (tmp_path / "plain.md").write_text("no markers")
        readme.main(["--results", str(tmp_path), "--readme", str(tmp_path / "plain.md")])


def test_committed_results_keep_measurements_apart_from_environment():
    data = json.loads((pathlib.Path(__file__).parents[1] / "docs" / "bench" / "suite.json").read_text())
    columns = {k for row in data["rows"] for k in row}
    assert not columns & set(data["environment"]), "an environment key would overwrite a measured column in suite.csv"
    assert all(isinstance(row["cuattn"], float) for row in data["rows"] if row["cuattn"] is not None)
