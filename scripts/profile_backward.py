"""One backward case for a profiler: cuattn, then SDPA flash, then cuDNN, each called twice.

    ncu --clock-control none -k regex:'backward_wgmma|flash_bwd|cudnn' --launch-skip 1 \
        --launch-count 1 python3 scripts/profile_backward.py --head-dim 64 --seqlen 16384
"""

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuattn

parser = argparse.ArgumentParser()
parser.add_argument("--head-dim", type=int, default=64)
parser.add_argument("--seqlen", type=int, default=16384)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--peers", default="flash")
args = parser.parse_args()
d, s = args.head_dim, args.seqlen
b, h = 16384 // s, 2048 // d
q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
out, lse = cuattn.attention(q, k, v, causal=args.causal, return_lse=True)
for _ in range(2):
    cuattn.attention_backward(do, q, k, v, out, lse, causal=args.causal)
backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
for peer in filter(None, args.peers.split(",")):
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(backends[peer]):
        ot = sdpa(qt, kt, vt, is_causal=args.causal)
    for _ in range(2):
        torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2), retain_graph=True)
torch.cuda.synchronize()
