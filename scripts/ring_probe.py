"""Where the ring's time goes at one size: the ring forward alone and forward + backward over
the process group, against the same pieces run standalone with cuattn.attention on one GPU
(the own shard causal, the later step's rectangle unmasked). torchrun --nproc_per_node 2.
RING_PROFILE=trace_RANK.json: a torch.profiler trace of each rank (scripts/trace_timeline.py
reads the last round: RING_QUEUED forward + backward calls back to back, default 1);
RING_NCCL_STREAM=default: NCCL's streams at default priority (else high, as bench_ring.py)."""

import os
import sys

import torch
import torch.distributed as dist

import cuattn
import cuattn.dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_ring import _ms, _single_ms, nccl_options  # noqa: E402


def main():
    dist.init_process_group("nccl", pg_options=nccl_options("nccl", os.environ.get("RING_NCCL_STREAM", "high") == "high"))
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    group = dist.group.WORLD
    for tokens in map(int, (sys.argv[1] if len(sys.argv) > 1 else "8192,16384").split(",")):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(1, tokens, h, 128, device="cuda", generator=g, dtype=torch.bfloat16) for h in (32, 8, 8, 32))

        def fwd():
            cuattn.dist.ring_attention(q, k, v, comm=group, layout="zigzag", causal=True, return_lse=True)

        out, lse = cuattn.dist.ring_attention(q, k, v, comm=group, layout="zigzag", causal=True, return_lse=True)

        def bwd():
            cuattn.dist.ring_attention_backward(dout, q, k, v, out, lse, comm=group, layout="zigzag", causal=True)

        res = {"fwd": _ms(fwd, 7), "bwd": _ms(bwd, 7)}
        if rank == 0:
            half = tokens // 2

            def piece_fwd(qq, causal):
                return cuattn.attention(qq, k, v, causal=causal, return_lse=True)

            for name, qq, causal in (("own_causal", q, True), ("later_full", q[:, half:], False)):
                o, l = piece_fwd(qq, causal)
                d = dout[:, :qq.shape[1]]
                res[name + "_fwd"] = _single_ms(lambda: piece_fwd(qq, causal), 7)
                res[name + "_bwd"] = _single_ms(lambda: cuattn.attention_backward(d, qq, k, v, o, l, causal=causal), 7)
            print(tokens, {k_: round(t, 3) for k_, t in res.items()},
                  "pieces sum", round(sum(t for n, t in res.items() if n.startswith(("own", "later"))), 3), flush=True)
    if os.environ.get("RING_CPROFILE") and rank == 0:  # the host's share, rank 0 (rank 1 runs the same calls unprofiled)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            fwd()
            bwd()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    elif os.environ.get("RING_CPROFILE"):
        for _ in range(20):
            fwd()
            bwd()
    if os.environ.get("RING_PROFILE"):
        from torch.profiler import ProfilerActivity, profile

        for _ in range(2):
            fwd(), bwd()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):  # the last round is the one to read: the profiler's start skews the first
                torch.cuda.synchronize()
                dist.barrier()
                for _ in range(int(os.environ.get("RING_QUEUED", "1"))):
                    fwd()
                    bwd()
            torch.cuda.synchronize()
        prof.export_chrome_trace(os.environ["RING_PROFILE"].replace("RANK", str(rank)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
