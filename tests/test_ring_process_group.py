"""Ring attention with one process per rank (cuattn.dist.ring_attention over a torch.distributed
process group): the exchange driver over gloo on host tensors (no GPU), and on one GPU with W = 2
and 4 processes sharing it (gloo staging through host memory) against float64, forward and
backward through cuattn.torch.ring_attention. NCCL itself needs one GPU per rank: not run here."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cuattn
import cuattn.dist
from conftest import HAS_GPU

WORKER = Path(__file__).with_name("ring_worker.py")


def _run_ranks(mode: str, worlds: list[int], tmp_path, timeout: int = 240) -> list[str]:
    """Starts ``world`` worker processes for each of ``worlds`` (all at once, one ring each) and
    returns their outputs; fails with their logs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(cuattn.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    procs = [
        (world, r, subprocess.Popen([sys.executable, str(WORKER), mode, str(world), str(r), str(tmp_path / f"store-{mode}-{world}")],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for world in worlds for r in range(world)
    ]
    logs = []
    try:
        for _, _, p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for _, _, p in procs:
            p.kill()
    failed = [f"W={w} rank {r} (exit {p.returncode}):\n{log}" for (w, r, p), log in zip(procs, logs) if p.returncode]
    assert not failed, "\n".join(failed)
    return logs


def test_comm_must_be_a_process_group():
    q = np.ones((1, 8, 2, 64), np.float16)
    with pytest.raises(TypeError, match="comm must be a torch.distributed ProcessGroup"):
        cuattn.dist.ring_attention(q, q, q, comm="nccl")
    with pytest.raises(TypeError, match="comm must be a torch.distributed ProcessGroup"):
        cuattn.dist.ring_attention_backward(q, q, q, q, q, np.zeros((1, 2, 8), np.float32), comm=None)


@pytest.mark.skipif(HAS_GPU, reason="the GPU test runs the same exchanges in its workers")
def test_exchanges_over_gloo(tmp_path):
    """Both channels in flight at once, each arriving from the previous rank, the accumulator
    back with its owner after W steps (host tensors, gloo; W = 1 sends to itself)."""
    pytest.importorskip("torch.distributed")
    _run_ranks("transport", [1, 3], tmp_path)


@pytest.mark.gpu
def test_ring_processes_on_one_gpu_match_float64(tmp_path):
    """W = 2 and 4 processes (two rings at once): the exchanges above, then zigzag causal GQA
    bf16, contiguous window fp16 (d128), stripe MQA bf16: out, lse and dq/dk/dv of each rank's
    shard within 2x the single-process error against float64."""
    pytest.importorskip("torch")
    logs = _run_ranks("attention", [2, 4], tmp_path)
    assert all(log.count(": ok") == 3 for log in logs), logs
