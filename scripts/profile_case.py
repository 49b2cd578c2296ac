"""One forward (or backward) case for a profiler: cuattn, then SDPA flash, then cuDNN, each
called twice.

    ncu --clock-control none -k regex:'forward_kernel|flash_fwd|cudnn' --launch-skip 1 \
        --launch-count 1 python3 scripts/profile_case.py --head-dim 128 --seqlen 16384
    ncu --clock-control none -k regex:'backward_wgmma_fused|flash_bwd' --launch-count 2 \
        python3 scripts/profile_case.py --backward --head-dim 64
"""

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuattn

parser = argparse.ArgumentParser()
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--seqlen", type=int, default=16384)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--backward", action="store_true", help="profile the backward (after one forward)")
parser.add_argument("--peers", default="flash")
args = parser.parse_args()
d, s = args.head_dim, args.seqlen
b, h = 16384 // s, 2048 // d
q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
if args.backward:
    out, lse = cuattn.attention(q, k, v, causal=args.causal, return_lse=True)
for _ in range(2):
    if args.backward:
        cuattn.attention_backward(do, q, k, v, out, lse, causal=args.causal)
    else:
        cuattn.attention(q, k, v, causal=args.causal)
backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
for peer in filter(None, args.peers.split(",")):
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_(args.backward) for x in (q, k, v))
    with sdpa_kernel(backends[peer]):
        for _ in range(2):
            ot = sdpa(qt, kt, vt, is_causal=args.causal)
            if args.backward:
                torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2))
torch.cuda.synchronize()
