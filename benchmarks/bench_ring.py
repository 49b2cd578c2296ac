"""Ring attention's efficiency over a process group, forward + backward, one process per rank:

    torchrun --nproc_per_node W benchmarks/bench_ring.py [--csv docs/bench/ring/ring_nccl.csv]

For T tokens per rank (W T in all), rank 0 first times single-GPU attention forward + backward
over the whole W T tokens; then every rank times its part of the ring (``cuattn.dist``, with the
ranks started together by a barrier, the slowest rank's time kept). Efficiency = (single-GPU
time / W) / ring time: 1.0 when the ring's work splits evenly and its exchange hides under
compute. ``ring_ms`` / ``single_gpu_ms``: each call started alone, its host work included
(the GPU idles until the first kernel is queued); ``*_queued_ms``: ``--queued`` calls issued back
to back between two events, per call (a training loop's steady state, where the host runs ahead
of the GPU; ring-flash-attention's benchmark times its iterations so), with
``efficiency_queued`` from them. ``exchange_ms``: the same transfers alone, one after another (the forward's K/V for
W - 1 steps, the backward's K/V again, its fp32 dK / dV accumulators for W - 1 hops and the
rounded sums for the last), for judging how much of the ring's time they could account for. TFLOP/s by the FlashAttention convention (causal halved, backward x2.5).
``--backend gloo`` stages each exchange through host memory (for a smoke test on one GPU;
its times say nothing about the ring over NCCL).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import cuattn
import cuattn.dist


def _ms(fn, repeat: int) -> float:
    """Median wall time of ``fn()`` over the ranks' slowest, each call started by a barrier."""
    fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        dist.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        t = torch.tensor([start.elapsed_time(stop)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return sorted(times)[len(times) // 2]


def _queued_ms(fn, calls: int, repeat: int, distributed: bool = True) -> float:
    """Median over ``repeat`` runs of ``calls`` back-to-back calls' time per call (over the
    ranks' slowest when ``distributed``)."""
    fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        if distributed:
            dist.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        t = start.elapsed_time(stop) / calls
        if distributed:
            t = torch.tensor([t], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            t = t.item()
        times.append(t)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-rank", default="8192,16384,32768")
    parser.add_argument("--layouts", default="zigzag,contiguous")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--queued", type=int, default=4, help="calls issued back to back for the *_queued_ms columns")
    parser.add_argument("--nccl-stream", default="high", choices=["high", "default"],
                        help="the priority of NCCL's streams (high: ProcessGroupNCCL.Options(is_high_priority_stream=True))")
    parser.add_argument("--csv", default="results/ring.csv")
    args = parser.parse_args(argv)
    dist.init_process_group(args.backend, pg_options=nccl_options(args.backend, args.nccl_stream == "high"))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    group, dtype = dist.group.WORLD, torch.bfloat16
    rows = []
    for tokens in map(int, args.tokens_per_rank.split(",")):
        total = tokens * world
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        full = [torch.randn(1, total, h, args.head_dim, device="cuda", generator=gen, dtype=dtype)
                for h in (args.heads, args.kv_heads, args.kv_heads)]
        dout_full = torch.randn(1, total, args.heads, args.head_dim, device="cuda", generator=gen, dtype=dtype)
        single_ms = single_queued_ms = float("nan")
        if rank == 0:
            def single():
                out, lse = cuattn.attention(*full, causal=args.causal, return_lse=True)
                cuattn.attention_backward(dout_full, *full, out, lse, causal=args.causal)

            single_ms = _single_ms(single, args.repeat)
            single_queued_ms = _queued_ms(single, args.queued, args.repeat, distributed=False)
        dist.barrier()
        for layout in args.layouts.split(","):
            q, k, v, dout = (cuattn.dist.shard(x, world, rank, layout).contiguous() for x in (*full, dout_full))

            def ring():
                out, lse = cuattn.dist.ring_attention(q, k, v, comm=group, layout=layout, causal=args.causal, return_lse=True)
                cuattn.dist.ring_attention_backward(dout, q, k, v, out, lse, comm=group, layout=layout, causal=args.causal)

            ring_ms = _ms(ring, args.repeat)
            ring_queued_ms = _queued_ms(ring, args.queued, args.repeat)
            accs = (k.float(), v.float())
            exchange_ms = _ms(lambda: _exchanges((k, v), accs, group), args.repeat)
            t = torch.tensor([single_ms, single_queued_ms], device="cuda")
            dist.broadcast(t, 0)
            single_ms_all, single_queued_all = t.tolist()
            flops = 4 * total * total * args.heads * args.head_dim * (0.5 if args.causal else 1.0) * 3.5
            row = {
                "world": world, "backend": args.backend, "layout": layout, "tokens_per_rank": tokens, "heads": args.heads,
                "kv_heads": args.kv_heads, "head_dim": args.head_dim, "causal": args.causal, "ring_ms": round(ring_ms, 3),
                "exchange_ms": round(exchange_ms, 3),
                "single_gpu_ms": round(single_ms_all, 3), "efficiency": round(single_ms_all / world / ring_ms, 3),
                "ring_queued_ms": round(ring_queued_ms, 3), "single_gpu_queued_ms": round(single_queued_all, 3),
                "efficiency_queued": round(single_queued_all / world / ring_queued_ms, 3),
                "ring_tflops_per_gpu": round(flops / world / ring_ms / 1e9, 1), "nccl_stream": args.nccl_stream,
                "gpu": torch.cuda.get_device_name(),
            }
            rows.append(row)
            if rank == 0:
                print(", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        full = dout_full = q = k = v = dout = accs = None  # freed before the next size is allocated
    if rank == 0:
        from benchmarks.timing import write_csv

        write_csv(args.csv, rows)
    dist.destroy_process_group()


def nccl_options(backend: str, high_priority: bool):
    """Options for an NCCL group whose streams have high priority (None: the defaults). With
    them NCCL's kernels take the first SMs that free up; at the default priority a transfer that
    becomes ready together with a kernel whose CTAs fill every SM can wait for its whole run."""
    if backend != "nccl" or not high_priority:
        return None
    return dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)


def _exchanges(kv, accs, group) -> None:
    """The ring's transfers of one forward + backward, without its kernels, one after another
    (the ring overlaps the backward's K/V and accumulators): K/V for W - 1 steps in each pass,
    the fp32 dK / dV accumulators for W - 1 hops and the last hop rounded to K/V's dtype."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prev = (rank + 1) % world, (rank - 1) % world

    def step(sent):
        into = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, nxt, group) for t in sent] + [dist.P2POp(dist.irecv, t, prev, group) for t in into]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return into

    for _ in range(2 * (world - 1)):
        kv = step(kv)
    for _ in range(world - 1):
        accs = step(accs)
    step(kv)  # the last hop: the rounded sums, K/V's size


def _single_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
