"""CUATTN_TEST_SHARD (tests/conftest.py): N runs of the suite together run every test once."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _collected(shard: str | None, path: str = "tests/test_validation.py") -> tuple[int, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "CUATTN_TEST_SHARD"}
    if shard is not None:
        env["CUATTN_TEST_SHARD"] = shard
    done = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", path], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, [line for line in done.stdout.splitlines() if "::" in line]


def test_shards_cover_the_suite_once():
    code, everything = _collected(None)
    assert code == 0 and len(everything) > 10
    shards = [_collected(f"{i}/3")[1] for i in (1, 2, 3)]
    assert sorted(sum(shards, [])) == sorted(everything)
    assert all(abs(len(s) - len(everything) / 3) < 1 for s in shards)  # round robin: sizes within one


@pytest.mark.parametrize("shard", ["0/3", "4/3", "1", "a/b"])
def test_a_malformed_shard_is_a_usage_error(shard):
    code, items = _collected(shard)
    assert code == 4 and not items  # pytest's usage-error exit status
