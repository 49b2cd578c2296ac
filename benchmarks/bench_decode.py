"""Decoding against a KV cache (``attention_with_kvcache``): one new token per sequence, GQA 32:8,
head_dim 128, bf16, every cached token attended to. GB/s of K and V read, for cuattn on a
contiguous cache and on paged caches (page 16 and page 1, pages shuffled), next to PyTorch SDPA's
flash and cuDNN backends on the same contiguous cache in the same run, and the GPU's measured
copy bandwidth (read + write). Kernel time only (a sleep kernel ahead hides the host); caches
under 256 MB are timed over several copies in turn, so that, as in a decode step of a model,
K/V come from HBM and not from L2. The last table is one batch-1 step with the host included.

Bars (issue 21): >= 1.0x the best SDPA backend on every row; >= 90% of copy bandwidth whenever
K/V is at least 128 MB; page size 1 within 10% of page size 16. Also a chunked-prefill row: a
2048-token chunk against a 32k cache, TFLOP/s next to the dense forward (cuattn.attention) on
the same work. Writes the CSV and, beside it, a PNG of the table.

    PYTHONPATH=. python -m benchmarks decode [--csv docs/bench/decode.csv] [--quick]
"""

from __future__ import annotations

import argparse
import pathlib
import time

import numpy as np

import cuattn
from benchmarks.timing import copy_bandwidth_gbs, environment, torch_kernel_ms, write_csv

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
MAX_KV_BYTES = 20 << 30  # rows whose K/V exceed this are left out (three copies are resident)
ROTATE_BYTES = 256 << 20  # smaller caches are timed over copies of this much together (several L2s)


def _gbs(nbytes: int, fn, sets: int = 0) -> float:
    """GB/s of ``nbytes`` per call; with ``sets``, ``fn(i)`` cycles over that many input sets,
    every one read once per sample (so that together they are not served from L2). A first
    timing is dropped: the first one on arrays allocated right after a large row's were freed
    can run slow (benchmarks/NOTES.md, KV-cache decoding)."""
    try:
        torch_kernel_ms(fn, repeat=max(10, sets), input_sets=sets)
        return round(nbytes / torch_kernel_ms(fn, repeat=max(10, sets), input_sets=sets) / 1e6, 1)
    except RuntimeError as exc:  # a peer that refuses the case
        print(f"failed: {str(exc).splitlines()[0][:100]}")
        return float("nan")


def rotated_row(batch: int, seqlen: int, head_dim: int = HEAD_DIM):
    """One decode row's inputs as the tuning scripts time them (bf16, GQA 32:8, one new token,
    full lengths): ``sets`` copies of q and K/V, enough to pass L2 together. Returns the K/V
    bytes of one call, ``sets``, the q and (k, v) lists and the lengths."""
    import torch

    nbytes = 2 * batch * seqlen * HEADS_KV * head_dim * 2
    sets = max(1, -(-ROTATE_BYTES // nbytes))
    q = [torch.randn(batch, 1, HEADS_Q, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    kv = [tuple(torch.randn(batch, seqlen, HEADS_KV, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)) for _ in range(sets)]
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    return nbytes, sets, q, kv, lengths


def _paged(k, v, page_size: int, rng):
    """The contiguous cache's sequences as shuffled pages, and the block table."""
    import torch

    b, s = k.shape[:2]
    per_seq = s // page_size
    order = torch.from_numpy(rng.permutation(b * per_seq).astype(np.int64)).to(k.device)
    pages_k = torch.empty((b * per_seq, page_size, *k.shape[2:]), dtype=k.dtype, device=k.device)
    pages_v = torch.empty_like(pages_k)
    pages_k[order] = k.reshape(b * per_seq, page_size, *k.shape[2:])
    pages_v[order] = v.reshape(b * per_seq, page_size, *v.shape[2:])
    table = order.reshape(b, per_seq).to(torch.int32)
    return pages_k, pages_v, table


def row(batch: int, seqlen: int, rng) -> dict:
    """One row of the table. A decode step of a model reads each layer's cache from HBM, so
    caches smaller than ROTATE_BYTES are timed over several copies in turn (never from L2)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    nbytes = 2 * batch * seqlen * HEADS_KV * HEAD_DIM * 2
    sets = -(-ROTATE_BYTES // nbytes) if nbytes < ROTATE_BYTES else 0
    q = [torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(max(1, sets))]
    kv = [tuple(torch.randn(batch, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
          for _ in range(max(1, sets))]
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    result = {"batch": batch, "cached_tokens": seqlen, "kv_mb": round(nbytes / 2**20, 1)}
    result["cuattn_contiguous"] = _gbs(nbytes, lambda i: cuattn.attention_with_kvcache(q[i], *kv[i], cache_seqlens=lengths), sets or 1)
    for page_size in (16, 1):
        paged = [_paged(k, v, page_size, rng) for k, v in kv]
        result[f"cuattn_page{page_size}"] = _gbs(
            nbytes, lambda i: cuattn.attention_with_kvcache(q[i], paged[i][0], paged[i][1], cache_seqlens=lengths, block_table=paged[i][2]),
            sets or 1)
        del paged
    views = [[x.transpose(1, 2) for x in (q[i], *kv[i])] for i in range(len(q))]
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run(i, backend=backend):
            with sdpa_kernel(backend), torch.no_grad():
                return sdpa(*views[i], enable_gqa=True)

        result[name] = _gbs(nbytes, run, sets or 1)
    peers = [result[n] for n in ("sdpa_flash", "sdpa_cudnn") if result[n] == result[n]]
    result["vs_best_sdpa"] = round(result["cuattn_contiguous"] / max(peers), 2) if peers else float("nan")
    result["page1_vs_page16"] = round(result["cuattn_page1"] / result["cuattn_page16"], 2)
    return result


def step_latency_us(batch: int = 1, seqlen: int = 1024, calls: int = 200, rounds: int = 5) -> dict:
    """One decode step with the host included: back-to-back calls, synchronized at the end; the
    best of ``rounds`` rounds for each (a round that a garbage collection or another process
    lands in says nothing about the call)."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    views = [x.transpose(1, 2) for x in (q, k, v)]

    def wall(fn) -> float:
        for _ in range(20):
            fn()
        best = float("inf")
        for _ in range(rounds):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - start) / calls)
        return round(best * 1e6, 1)

    with torch.no_grad():
        return {
            "batch": batch, "cached_tokens": seqlen,
            "cuattn_us": wall(lambda: cuattn.attention_with_kvcache(q, k, v, cache_seqlens=lengths)),
            "sdpa_us": wall(lambda: sdpa(*views, enable_gqa=True)),
        }


def chunked_prefill(chunk: int = 2048, cached: int = 32768) -> dict:
    """A chunk of new tokens (already appended) against its cache: attention_with_kvcache on a
    contiguous cache and on pages of 16 next to cuattn.attention on the same q, K and V, causal,
    bottom-right aligned."""
    import torch

    q = torch.randn(1, chunk, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, cached, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((1,), cached, dtype=torch.int32, device="cuda")
    pk, pv, table = _paged(k, v, 16, np.random.default_rng(1))
    # causal work: every query sees the cache before the chunk and its own prefix
    flops = 4 * HEADS_Q * HEAD_DIM * chunk * (cached - chunk) + 2 * HEADS_Q * HEAD_DIM * chunk * chunk
    kv_ms = torch_kernel_ms(lambda: cuattn.attention_with_kvcache(q, k, v, cache_seqlens=lengths))
    paged_ms = torch_kernel_ms(lambda: cuattn.attention_with_kvcache(q, pk, pv, cache_seqlens=lengths, block_table=table))
    dense_ms = torch_kernel_ms(lambda: cuattn.attention(q, k, v, causal=True))
    return {"chunk": chunk, "cached_tokens": cached, "kvcache_tflops": round(flops / kv_ms / 1e9, 1),
            "page16_tflops": round(flops / paged_ms / 1e9, 1), "dense_tflops": round(flops / dense_ms / 1e9, 1),
            "ratio": round(dense_ms / kv_ms, 2), "page16_ratio": round(dense_ms / paged_ms, 2)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default="results/decode.csv")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 16, 8k and 32k tokens")
    args = parser.parse_args(argv)
    import torch

    rng = np.random.default_rng(0)
    copy = round(copy_bandwidth_gbs(), 1)
    batches, lengths = ((1, 16), (8192, 32768)) if args.quick else ((1, 4, 16, 64), (1024, 8192, 32768, 131072))
    rows = []
    for batch in batches:
        for seqlen in lengths:
            if 2 * batch * seqlen * HEADS_KV * HEAD_DIM * 2 > MAX_KV_BYTES:
                print(f"batch {batch} x {seqlen} tokens: K/V over {MAX_KV_BYTES >> 30} GB, left out")
                continue
            r = {**row(batch, seqlen, rng), "copy_gbs": copy}
            r["contiguous_vs_copy"] = round(r["cuattn_contiguous"] / copy, 2)
            rows.append(r)
            print(" ".join(f"{k}={v}" for k, v in r.items()), flush=True)
            torch.cuda.empty_cache()
    latency = step_latency_us()
    prefill = chunked_prefill()
    env = environment()
    write_csv(args.csv, [{**r, **env} for r in rows] + [{"latency_" + k: v for k, v in latency.items()} | env]
              + [{"prefill_" + k: v for k, v in prefill.items()} | env])
    try:
        from benchmarks.plots import plot_decode

        print(f"wrote {plot_decode(rows, copy, env, pathlib.Path(args.csv).with_suffix('.png'))}")
    except ImportError:
        print("matplotlib is not installed: no plot")
    cols = ("batch", "cached_tokens", "kv_mb", "cuattn_contiguous", "cuattn_page16", "cuattn_page1", "sdpa_flash", "sdpa_cudnn",
            "vs_best_sdpa", "contiguous_vs_copy", "page1_vs_page16")
    print(f"\nGB/s of K/V read ({env['gpu']}, copy {copy} GB/s)")
    print("".join(f"{c:>19}" for c in cols))
    for r in rows:
        print("".join(f"{r[c]:>19}" for c in cols))
    print(f"\none step, host included (batch 1, 1024 tokens): cuattn {latency['cuattn_us']} us, SDPA {latency['sdpa_us']} us")
    print(f"chunked prefill ({prefill['chunk']} new tokens, {prefill['cached_tokens']} cached): attention_with_kvcache "
          f"{prefill['kvcache_tflops']} TFLOP/s ({prefill['ratio']}x), pages of 16 {prefill['page16_tflops']} TFLOP/s "
          f"({prefill['page16_ratio']}x), dense forward {prefill['dense_tflops']} TFLOP/s")


if __name__ == "__main__":
    main()
