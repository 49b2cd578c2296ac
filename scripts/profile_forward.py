"""One forward case for a profiler: cuattn, then SDPA flash, then cuDNN, each called twice.

    ncu --clock-control none -k regex:'forward_kernel|flash_fwd|cudnn' --launch-skip 1 \
        --launch-count 1 python3 scripts/profile_forward.py --head-dim 128 --seqlen 16384
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
parser.add_argument("--peers", default="flash")
args = parser.parse_args()
d, s = args.head_dim, args.seqlen
b, h = 16384 // s, 2048 // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(2):
    cuattn.attention(q, k, v, causal=args.causal)
backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
for peer in filter(None, args.peers.split(",")):
    with sdpa_kernel(backends[peer]):
        for _ in range(2):
            sdpa(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=args.causal)
torch.cuda.synchronize()
