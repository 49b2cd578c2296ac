"""Where the ring's host time goes before its GPU work starts, one process per rank:

    torchrun --nproc_per_node 2 scripts/ring_host_probe.py [--tokens-per-rank 8192] [--profile]

Each call of ``cuattn.dist.ring_attention`` (forward) and ``ring_attention_backward`` starts
alone (GPU idle, ranks released by a barrier). Per call, host microseconds from entering it to
its first kernel launch (``CallContext.launch``), to its first NCCL post
(``ProcessGroupExchange._exchange``) and to its return, and its GPU time (events around the
call); medians over the calls, every rank. ``--profile``: cProfile of rank 0's forward calls
(inflates Python; for the shares only). ``--pieces``: host microseconds of the forward's steps
before its first launch, each timed alone in a loop, and of posting one K/V exchange (torch's
``batch_isend_irecv``; the call alone, its transfer awaited outside the timing). Works on trees
from before the two-part send.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import torch
import torch.distributed as dist

import cuattn.dist
from cuattn import boundary
from cuattn.dist import process_group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-rank", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--label", default="")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--pieces", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("nccl", pg_options=dist.ProcessGroupNCCL.Options(is_high_priority_stream=True))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    group = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, dout = (torch.randn(1, args.tokens_per_rank, h, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for h in (32, 8, 8, 32))

    marks: dict[str, float] = {}
    launch, exchange = boundary.CallContext.launch, process_group.ProcessGroupExchange._exchange

    def timed_launch(self, *a, **kw):
        marks.setdefault("launch", time.perf_counter())
        return launch(self, *a, **kw)

    def timed_exchange(self, *a, **kw):
        marks.setdefault("post", time.perf_counter())
        return exchange(self, *a, **kw)

    boundary.CallContext.launch, process_group.ProcessGroupExchange._exchange = timed_launch, timed_exchange
    saved = {}

    def forward():
        saved["out"], saved["lse"] = cuattn.dist.ring_attention(q, k, v, comm=group, causal=True, return_lse=True)

    def backward():
        cuattn.dist.ring_attention_backward(dout, q, k, v, saved["out"], saved["lse"], comm=group, causal=True)

    rows = []
    for name, fn in (("forward", forward), ("backward", backward)):
        fn()
        samples = []
        for _ in range(args.calls):
            forward() if name == "backward" else None
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            marks.clear()
            start.record()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            stop.record()
            stop.synchronize()
            samples.append(((marks.get("launch", t1) - t0) * 1e6, (marks.get("post", t1) - t0) * 1e6, (t1 - t0) * 1e6, start.elapsed_time(stop)))
        med = [sorted(s[i] for s in samples)[len(samples) // 2] for i in range(4)]
        rows.append(f"{args.label:>6} rank {rank} {name:8} first launch {med[0]:7.1f} us  first post {med[1]:7.1f} us  "
                    f"host {med[2]:7.1f} us  gpu {med[3]:6.3f} ms")
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        for r in gathered:
            print("\n".join(r), flush=True)
    if args.pieces:
        pieces(q, k, v, group, rank, world)
    if args.profile:
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        for _ in range(10):
            torch.cuda.synchronize()
            dist.barrier()
            profiler.enable()
            forward()
            profiler.disable()
        torch.cuda.synchronize()
        if rank == 0:
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
    dist.destroy_process_group()


def pieces(q, k, v, group, rank: int, world: int) -> None:
    from cuattn.dist import ring
    from cuattn.dist.pieces import plan
    from cuattn.options import AttnOptions

    ctx, a = boundary.import_arrays(q=q, k=k, v=v)
    exchange = process_group.ProcessGroupExchange(group)
    steps = {
        "import_arrays(q, k, v)": lambda: boundary.import_arrays(q=q, k=k, v=v),
        "ProcessGroupExchange(group)": lambda: process_group.ProcessGroupExchange(group),
        "check_comm": lambda: process_group.check_comm(group),
        "_check_rank": lambda: ring._check_rank(a["q"], a["k"], a["v"], world, "zigzag"),
        "AttnOptions.from_user": lambda: AttnOptions.from_user(True, None, "bottom_right", None, None, head_dim=128),
        "ctx.empty (one K-sized buffer)": lambda: ctx.empty(a["k"].shape, a["k"].dtype),
        "plan (memoized)": lambda: plan(q.shape[1] * world, world, rank, "zigzag", -1, 0),
        "torch.cuda.current_stream": lambda: torch.cuda.current_stream(q.device),
        "Event().record()": lambda: torch.cuda.Event().record(),
    }
    lines = []
    for name, fn in steps.items():
        fn()
        t = time.perf_counter()
        for _ in range(200):
            fn()
        lines.append(f"rank {rank} {name:34} {(time.perf_counter() - t) / 200 * 1e6:7.1f} us")
    into = [torch.empty_like(k), torch.empty_like(v)]

    def post_times(back_to_back: int) -> float:
        """Median host time of posting the exchange, ``back_to_back`` posts after each sync."""
        times = []
        for _ in range(21):
            torch.cuda.synchronize()
            dist.barrier()
            for _ in range(back_to_back):
                t = time.perf_counter()
                requests = exchange._exchange([k, v], into, 0)
                times.append((time.perf_counter() - t) * 1e6)
                for r in requests:
                    r.wait()
        return sorted(times)[len(times) // 2]

    lines.append(f"rank {rank} {'batch_isend_irecv (K, V), alone':34} {post_times(1):7.1f} us (median of 21)")
    lines.append(f"rank {rank} {'batch_isend_irecv, back to back':34} {post_times(4):7.1f} us")
    gathered = [None] * world
    dist.all_gather_object(gathered, lines)
    if rank == 0:
        print("\n".join(line for g in gathered for line in g), flush=True)


if __name__ == "__main__":
    main()
