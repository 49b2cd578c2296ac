"""Ring attention with one process per rank (cuattn.dist.ring_attention over a torch.distributed
process group): the exchange driver over gloo on host tensors (no GPU), then W = 2 and 4 processes
against float64, forward and backward through cuattn.torch.ring_attention: over NCCL where the
machine has a GPU per rank, else sharing one GPU over gloo (staged through host memory)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cuattn
import cuattn.dist
from conftest import HAS_GPU
from cuattn.dist.process_group import nccl_moves_cuda

WORKER = Path(__file__).with_name("ring_worker.py")


def _run_ranks(mode: str, worlds: list[int], tmp_path, timeout: int = 240) -> list[str]:
    """Starts ``world`` worker processes for each of ``worlds`` (all at once, one ring each) and
    returns their outputs; fails with their logs. One failed rank ends its peers (which would
    otherwise wait for it until the timeout) after a grace period to print what they saw."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(cuattn.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    procs = []
    for world in worlds:
        for r in range(world):
            log = tmp_path / f"{mode}-{world}-{r}.log"
            with open(log, "w") as out:
                args = [sys.executable, str(WORKER), mode, str(world), str(r), str(tmp_path / f"store-{mode}-{world}")]
                procs.append((world, r, log, subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)))
    deadline, failed_at = time.monotonic() + timeout, None
    try:
        while any([p.poll() is None for *_, p in procs]):  # a list: every process polled
            now = time.monotonic()
            if failed_at is None and any(p.returncode for *_, p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + 10):
                break
            time.sleep(0.1)
    finally:
        for *_, p in procs:
            p.kill()
            p.wait()
    logs = [log.read_text() for _, _, log, _ in procs]
    failed = [f"W={w} rank {r} ({'ended by the test' if p.returncode < 0 else f'exit {p.returncode}'}):\n{text}"
              for (w, r, _, p), text in zip(procs, logs) if p.returncode]
    assert not failed, "\n".join(failed)
    return logs


def test_nccl_is_recognized_in_every_backend_spelling():
    """NCCL moves the CUDA tensors of a group made with "nccl", "cuda:nccl" or none named
    ("cpu:gloo,cuda:nccl" on a CUDA build); gloo alone, or NCCL for another device, is staged."""
    for config in ("nccl", "NCCL", "cuda:nccl", "cpu:gloo,cuda:nccl", "cpu:gloo, cuda:nccl"):
        assert nccl_moves_cuda(config), config
    for config in ("gloo", "cpu:gloo", "cuda:gloo", "undefined", "cpu:gloo,cuda:gloo", "xpu:nccl", ""):
        assert not nccl_moves_cuda(config), config


def test_comm_must_be_a_process_group():
    q = np.ones((1, 8, 2, 64), np.float16)
    with pytest.raises(TypeError, match="comm must be a torch.distributed ProcessGroup"):
        cuattn.dist.ring_attention(q, q, q, comm="nccl")
    with pytest.raises(TypeError, match="comm must be a torch.distributed ProcessGroup"):
        cuattn.dist.ring_attention_backward(q, q, q, q, q, np.zeros((1, 2, 8), np.float32), comm=None)


@pytest.mark.skipif(HAS_GPU, reason="the GPU test runs the same exchanges in its workers")
def test_exchanges_over_gloo(tmp_path):
    """Both channels in flight at once, each arriving from the previous rank, the accumulator
    back with its owner after W steps (host tensors, gloo; W = 1 sends to itself), also over a
    sub-group of ranks 0 and 2 of 3."""
    pytest.importorskip("torch.distributed")
    _run_ranks("transport", [1, 3], tmp_path)


@pytest.mark.gpu
def test_ring_processes_match_float64(tmp_path):
    """W = 2 and 4 processes (two rings at once; NCCL for a ring with a GPU per rank, else
    gloo on GPU 0): the exchanges above, then zigzag causal GQA bf16, contiguous window fp16
    (d128), stripe MQA bf16: out, lse and dq/dk/dv of each rank's shard within 2x the
    single-process error against float64."""
    pytest.importorskip("torch")
    logs = _run_ranks("attention", [2, 4], tmp_path)
    assert all(log.count(": ok") == 3 for log in logs), logs
