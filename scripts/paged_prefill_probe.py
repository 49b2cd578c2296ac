"""Chunked prefill (2k new tokens on a 32k cache, d128 GQA 32:8, bf16, causal) on shuffled
paged caches of 1-128 tokens a page and a contiguous one, next to the dense forward (TFLOP/s of
the same work); one line per tree, for A/B runs in one lease:

    PYTHONPATH=<tree>:. python scripts/paged_prefill_probe.py <tag> [box_min_page [head_dim]]

``box_min_page``: the TMA forward's TMA_BOX_MIN_PAGE for this process (0: pages of
8 and 16 by TMA boxes, as before the producer's copies; the copies take the rest); ``head_dim``: 128 unless
given.
"""
import sys

import numpy as np
import torch

import cuattn
from benchmarks.bench_decode import HEAD_DIM, HEADS_KV, HEADS_Q, _paged
from benchmarks.timing import torch_kernel_ms

HEAD_DIM = int(sys.argv[3]) if len(sys.argv) > 3 else HEAD_DIM

tag = sys.argv[1]
if len(sys.argv) > 2:
    from cuattn.kernels import forward
    if hasattr(forward, "TMA_BOX_MIN_PAGE"):
        forward.TMA_BOX_MIN_PAGE = int(sys.argv[2]) if isinstance(forward.TMA_BOX_MIN_PAGE, int) else dict.fromkeys(forward.TMA_BOX_MIN_PAGE, int(sys.argv[2]))
chunk, cached = 2048, 32768
torch.manual_seed(0)
q = torch.randn(1, chunk, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, cached, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lengths = torch.full((1,), cached, dtype=torch.int32, device="cuda")
flops = 4 * HEADS_Q * HEAD_DIM * chunk * (cached - chunk) + 2 * HEADS_Q * HEAD_DIM * chunk * chunk
ref = cuattn.attention(q, k, v, causal=True)
res = {"dense": flops / torch_kernel_ms(lambda: cuattn.attention(q, k, v, causal=True)) / 1e9,
       "contig": flops / torch_kernel_ms(lambda: cuattn.attention_with_kvcache(q, k, v, cache_seqlens=lengths)) / 1e9}
for page in (1, 8, 16, 32, 64, 128):
    pk, pv, table = _paged(k, v, page, np.random.default_rng(1))
    out = cuattn.attention_with_kvcache(q, pk, pv, cache_seqlens=lengths, block_table=table)
    err = (out.float() - ref.float()).abs().max().item()
    assert err < 2e-2, (page, err)
    res[f"p{page}"] = flops / torch_kernel_ms(lambda pk=pk, pv=pv, table=table: cuattn.attention_with_kvcache(q, pk, pv, cache_seqlens=lengths, block_table=table)) / 1e9
print(tag, f"d{HEAD_DIM}", " ".join(f"{k} {v:.1f}" for k, v in res.items()), " ratio_p16 %.3f" % (res["p16"] / res["dense"]), flush=True)
