"""GPU time per kernel of one cuattn backward (and of SDPA flash's), from the torch profiler:
where the backward's time goes.

    PYTHONPATH=. python scripts/kernel_split.py [--head-dim 128] [--seqlen 16384] [--causal]
"""

import argparse
import collections
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.functional import scaled_dot_product_attention as sdpa  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import cuattn  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--seqlen", type=int, default=16384)
parser.add_argument("--causal", action="store_true")
args = parser.parse_args()
d, s = args.head_dim, args.seqlen
b, h = 16384 // s, 2048 // d
q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
out, lse = cuattn.attention(q, k, v, causal=args.causal, return_lse=True)
qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    ot = sdpa(qt, kt, vt, is_causal=args.causal)
runs = {
    "cuattn": lambda: cuattn.attention_backward(do, q, k, v, out, lse, causal=args.causal),
    "sdpa_flash": lambda: torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2), retain_graph=True),
}
repeat = 5
for name, fn in runs.items():
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:90]] += event.device_time / repeat
    total = sum(per_kernel.values())
    print(f"{name}: {total / 1e3:.3f} ms per backward (d{d} s{s} causal={args.causal})")
    for kernel, us in per_kernel.most_common(6):
        print(f"  {us / 1e3:8.3f} ms {100 * us / total:5.1f}%  {kernel}")
