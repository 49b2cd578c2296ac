"""One rank of a multi-process ring test (tests/test_ring_process_group.py starts one process per
rank): ``python ring_worker.py MODE WORLD RANK STORE_FILE``. Exits non-zero on a failed check.

- ``transport``: host tensors over gloo through ProcessGroupExchange, both channels in flight.
- ``attention``: the same, then ring attention and its gradients on CUDA against float64 attention
  over the whole sequence: over NCCL with a GPU per rank where the machine has enough, else
  every rank on GPU 0 over gloo (staged through host memory).
"""

import sys

import torch
import torch.distributed as dist


def toy_steps(rank: int, world: int):
    """A rank's exchanges shaped like the ring backward's: "kv" (two bf16 arrays) and "acc" (fp32,
    another size) in flight together, for ``world`` steps; checks what each step received."""
    def kv(owner):
        return [torch.full((3, 5), owner + 1, dtype=torch.bfloat16), torch.full((7,), -owner - 1, dtype=torch.bfloat16)]

    cur, acc = kv(rank), [torch.full((4, 2), float(rank))]
    for s in range(world):
        nxt = [torch.empty_like(t) for t in cur]
        yield ("send", "kv", cur, nxt)
        acc[0] += 1000  # this rank's contribution, before the accumulator travels on
        received = [torch.empty_like(acc[0])]
        yield ("send", "acc", acc, received)
        yield ("wait", "kv")
        yield ("wait", "acc")
        assert all(torch.equal(a, b) for a, b in zip(nxt, kv((rank - s - 1) % world))), (rank, s, nxt)
        cur, acc = nxt, received
    # back with its owner, having gained every rank's contribution
    assert torch.equal(acc[0], torch.full((4, 2), float(rank) + 1000 * world)), (rank, acc)


def transport(rank: int, world: int) -> None:
    """The toy exchanges over a gloo group of every rank, then (W >= 3) over the sub-group of
    ranks 0 and 2, whose neighbours are global ranks other than its own ranks."""
    from cuattn.dist.process_group import ProcessGroupExchange, check_comm

    group = dist.group.WORLD if dist.get_backend(dist.group.WORLD) == "gloo" else dist.new_group(backend="gloo")
    exchange = ProcessGroupExchange(check_comm(group))
    assert (exchange.rank, exchange.world, exchange.staged) == (rank, world, True)
    exchange.drive(None, toy_steps(rank, world))
    if world >= 3:
        sub = dist.new_group([0, 2], backend="gloo")  # every rank takes part in making it
        if rank in (0, 2):
            exchange = ProcessGroupExchange(sub)
            assert (exchange.rank, exchange.world, exchange.next, exchange.prev) == (rank // 2, 2, 1 - rank // 2, 1 - rank // 2)
            exchange.drive(None, toy_steps(rank // 2, 2))


def reference(q, k, v, causal: bool, window, scale: float):
    """float64 attention over the whole sequence (positions 0..S-1), GQA by repetition."""
    q, k, v = (x.double() for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    i = torch.arange(q.shape[1], device=q.device)[:, None]
    j = torch.arange(k.shape[1], device=q.device)[None, :]
    visible = torch.ones_like(s[0, 0], dtype=torch.bool)
    if causal:
        visible &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v), lse


def attention(rank: int, world: int) -> None:
    import cuattn.torch
    from cuattn import dist as cdist
    from cuattn.dist.process_group import ProcessGroupExchange

    transport(rank, world)
    torch.cuda.set_device(_device(rank, world))
    staged = ProcessGroupExchange(dist.group.WORLD).staged
    assert staged == (dist.get_backend(dist.group.WORLD) != "nccl"), staged
    cases = [  # layout, causal, window, dtype, heads_q, heads_kv, head_dim, seqlen
        ("zigzag", True, None, torch.bfloat16, 4, 2, 64, 256 * world),
        ("contiguous", False, (48, 0), torch.float16, 2, 2, 128, 96 * world),
        ("stripe", False, None, torch.bfloat16, 4, 1, 64, 80 * world),
    ]
    for layout, causal, window, dtype, hq, hkv, d, seqlen in cases:
        gen = torch.Generator(device="cuda").manual_seed(seqlen + d)
        full = [torch.randn(2, seqlen, h, d, device="cuda", generator=gen).to(dtype) for h in (hq, hkv, hkv)]
        dout_full = torch.randn(2, seqlen, hq, d, device="cuda", generator=gen).to(dtype)
        scale = d ** -0.5
        leaves = [x.double().requires_grad_() for x in full]
        want, want_lse = reference(*leaves, causal, window, scale)
        want.backward(dout_full.double())

        # the same computation in one process, as the bar for the ring's error
        single = [x.clone().requires_grad_() for x in full]
        got_single = cuattn.torch.attention(*single, causal=causal, window=window, align="top_left")
        got_single.backward(dout_full)

        shards = [cdist.shard(x, world, rank, layout).contiguous().requires_grad_() for x in full]
        out, lse = cdist.ring_attention(*[x.detach() for x in shards], comm=dist.group.WORLD, layout=layout, causal=causal, window=window,
                                        return_lse=True)
        ring_out = cuattn.torch.ring_attention(*shards, comm=dist.group.WORLD, layout=layout, causal=causal, window=window)
        ring_out.backward(cdist.shard(dout_full, world, rank, layout).contiguous())
        assert torch.equal(out, ring_out), "ring_attention and its autograd form differ"

        mine = lambda x: cdist.shard(x, world, rank, layout)  # noqa: E731
        lse_err = (lse.double() - mine(want_lse.transpose(1, 2)).transpose(1, 2)).abs().max().item()
        assert lse_err < 1e-4, (layout, "lse", lse_err)
        pairs = [("out", ring_out, got_single, want)] + [
            (name, s.grad, mine(x.grad), mine(w.grad)) for name, s, x, w in zip(("dq", "dk", "dv"), shards, single, leaves)
        ]
        for name, got, same, exact in pairs:
            exact = mine(exact) if name == "out" else exact
            same = mine(same) if name == "out" else same
            err = (got.double() - exact).abs().max().item()
            bar = (same.double() - exact).abs().max().item()
            assert torch.isfinite(got).all() and err <= 2 * bar + 1e-5, (layout, name, err, bar)
        print(f"rank {rank}/{world} {dist.get_backend(dist.group.WORLD)} {layout} causal={causal} window={window} {dtype}: ok", flush=True)


def _device(rank: int, world: int) -> int:
    """A GPU per rank where there are enough (NCCL), else every rank on GPU 0 (gloo)."""
    return rank if torch.cuda.device_count() >= world else 0


def main() -> None:
    mode, world, rank, store = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    nccl = mode == "attention" and world > 1 and torch.cuda.device_count() >= world
    if nccl:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if nccl else "gloo", init_method=f"file://{store}", world_size=world, rank=rank)
    try:
        {"transport": transport, "attention": attention}[mode](rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
