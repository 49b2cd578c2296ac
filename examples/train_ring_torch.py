"""Context parallelism: a small causal language model trained with each sequence split across
ranks (zigzag layout), attention by cuattn's ring over a torch.distributed process group.

    torchrun --nproc_per_node 2 examples/train_ring_torch.py                  # a GPU per rank, NCCL
    torchrun --nproc_per_node 2 examples/train_ring_torch.py --backend gloo   # ranks may share a GPU

Every rank holds the same parameters and the same batches; it embeds only its shard of each
sequence (the tokens at :func:`cuattn.dist.positions`), attends to the whole sequence through
the ring, and its gradients are averaged over the ranks after each backward. The first step is
checked against the same model on the whole sequence in one process (``--check``, rank 0).
"""

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cuattn.dist
import cuattn.torch
from lm_data import batches, corpus, encode


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x, attend):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        x = x + self.proj(attend(q, k.contiguous(), v.contiguous()).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class LanguageModel(torch.nn.Module):
    def __init__(self, vocab, seqlen, dim=256, heads=4, layers=4):
        super().__init__()
        self.embed, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Parameter(torch.randn(seqlen, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab)

    def forward(self, tokens, positions, attend):
        """``tokens`` (batch, n) at sequence ``positions`` (n,): this rank's shard, or the whole."""
        x = self.embed(tokens) + self.pos[positions]
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    # NCCL's streams at high priority: its transfers take the first SMs that free up instead of
    # waiting behind a kernel that fills the GPU (README, "Context parallelism").
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True) if args.backend == "nccl" else None
    dist.init_process_group(args.backend, pg_options=options)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    group, layout = dist.group.WORLD, "zigzag"

    def ring(q, k, v):
        return cuattn.torch.ring_attention(q, k, v, comm=group, layout=layout, causal=True)

    def whole(q, k, v):
        return cuattn.torch.attention(q, k, v, causal=True)

    tokens, vocab = encode(corpus())
    torch.manual_seed(0)  # the same initialization on every rank
    model = LanguageModel(len(vocab), args.seqlen).cuda()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 30) * 0.5 * (1 + math.cos(math.pi * i / args.steps)))
    mine = torch.as_tensor(cuattn.dist.positions(args.seqlen, world, rank, layout), device="cuda")
    start = time.perf_counter()
    for step, (x, y) in enumerate(batches(tokens, args.batch, args.seqlen, args.steps)):
        x, y = torch.from_numpy(x).long().cuda(), torch.from_numpy(y).long().cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, mine], mine, ring)
            loss = F.cross_entropy(logits.float().view(-1, len(vocab)), y[:, mine].reshape(-1))  # mean over this rank's tokens
        opt.zero_grad(set_to_none=True)
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in params]) / world  # every rank holds as many tokens: the mean of means
        dist.all_reduce(flat)
        for p, g in zip(params, torch._utils._unflatten_dense_tensors(flat, [p.grad for p in params])):
            p.grad.copy_(g)
        total = loss.detach() / world
        dist.all_reduce(total)
        if step == 0 and args.check and rank == 0:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                everything = torch.arange(args.seqlen, device="cuda")
                full = F.cross_entropy(model(x, everything, whole).float().view(-1, len(vocab)), y.view(-1))
            print(f"step 0 loss: ring over {world} ranks {total.item():.5f}, whole sequence in one process {full.item():.5f}", flush=True)
            if abs(total.item() - full.item()) > 1e-2 * full.item():
                raise SystemExit("the ring's loss differs from the whole sequence's")
        opt.step()
        schedule.step()
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {total.item():.4f}  {time.perf_counter() - start:.1f} s", flush=True)
    if rank == 0:
        seconds = time.perf_counter() - start
        print(f"{args.steps} steps of {args.batch} x {args.seqlen} tokens over {world} ranks ({args.backend}): {seconds:.1f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
