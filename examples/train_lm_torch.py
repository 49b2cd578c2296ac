"""A small causal transformer language model trained in PyTorch twice, from the same
initialization on the same batches: once with cuattn's attention, once with PyTorch SDPA.
The two loss curves agree within noise.

    python examples/train_lm_torch.py [--steps 300] [--out results/]

writes ``<out>/lm_torch.json`` (GPU, wall time per run, last-50-step mean losses: what the
README quotes, with ``--out docs``), ``lm_torch_losses.csv`` and ``lm_torch_losses.png``.
"""

import math
import time

import numpy as np
import torch
import torch.nn.functional as F

import cuattn.torch
from lm_data import batches, compare


def cuattn_attention(q, k, v):  # (batch, seqlen, heads, head_dim)
    return cuattn.torch.attention(q, k, v, causal=True)


def sdpa_attention(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)


class Block(torch.nn.Module):
    def __init__(self, dim, heads, attend):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        x = x + self.proj(self.attend(q, k, v).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class LanguageModel(torch.nn.Module):
    def __init__(self, vocab, attend, dim=256, heads=4, layers=4, seqlen=256):
        super().__init__()
        self.embed, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Parameter(torch.randn(seqlen, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(dim, heads, attend) for _ in range(layers))
        self.norm, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train(attend, tokens, vocab, steps, batch, seqlen, seed=0):
    torch.manual_seed(seed)
    model = LanguageModel(len(vocab), attend, seqlen=seqlen).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 30) * 0.5 * (1 + math.cos(math.pi * i / steps)))
    losses, first = [], None
    start = time.perf_counter()
    for x, y in batches(tokens, batch, seqlen, steps, seed):
        x, y = torch.from_numpy(x).long().cuda(), torch.from_numpy(y).long().cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().view(-1, len(vocab)), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        losses.append(loss.item())  # waits for the step
        if first is None:  # the first step compiles
            first = time.perf_counter() - start
    return np.array(losses), time.perf_counter() - start, first


def main():
    import cupy

    compare(__doc__, {"cuattn": cuattn_attention, "PyTorch SDPA": sdpa_attention}, train, "lm_torch", "char LM, PyTorch, bf16 autocast",
            lambda: torch.cuda.get_device_name(), {"cuattn": cuattn.__version__, "torch": torch.__version__, "cupy": cupy.__version__})


if __name__ == "__main__":
    main()
