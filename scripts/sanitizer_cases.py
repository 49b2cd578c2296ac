"""One small launch of each kernel family, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python scripts/sanitizer_cases.py [small]
    compute-sanitizer --tool racecheck python scripts/sanitizer_cases.py [small]

``small``: only the one-launch backward of small calls (backward_small.cu); without it the
backward kernels of larger calls serve the small cases too (CUATTN_SMALL_BACKWARD=0).
``forward``: only the forward, over several key blocks at every Hopper tile (the padded
buckets included), dense by both Hopper kernels (TMA and copying), the accumulating form, the
TMA kernel's CTAs taking several row blocks, and over contiguous and paged caches, so that its
K/V rings, mbarriers, key-offset buffers and named barriers turn over. ``wide``: only the
Hopper backward above head_dim 128 (its warpgroups' column shares at the 192 and 256 tiles, the
dQ pieces staged in the spent Q / dO tiles or the 64-column share's stage, the causal launch
order) over several key and query blocks. ``decode``: only the KV-cache family (decode.cu, its
merge, append_kv.cu): contiguous caches (rows picked by cache_batch_idx, one out of range) and
paged ones (pages of 16, 7 and 1, shuffled tables, one entry out of range), appends across
pages, lengths at and past the capacity, one split over a whole paged sequence, calls back to
back (so each one's prefetch runs under the grid before it). ``prefill``: only the chunked
prefill over paged caches whose pages the TMA forward's producer copies (pages of 16, 3 and 1,
shuffled, one entry out of range; head dims 64, 128, 192 and 256, softcap, a window).
"""

import os
import sys

import cupy
import numpy as np

import cuattn
from cuattn.dtypes import BFLOAT16

rng = np.random.default_rng(0)
SMALL_ONLY = sys.argv[1:] == ["small"]
FORWARD_ONLY = sys.argv[1:] == ["forward"]
WIDE_ONLY = sys.argv[1:] == ["wide"]
DECODE_ONLY = sys.argv[1:] == ["decode"]
PREFILL_ONLY = sys.argv[1:] == ["prefill"]
os.environ["CUATTN_SMALL_BACKWARD"] = "1" if SMALL_ONLY else "0"


def arr(shape, dtype):
    return cupy.asarray(rng.standard_normal(shape).astype(dtype))


# The one-launch small backward: GQA, ragged rows past the tiles, masks, softcap, dlse, the
# head-dim buckets it serves.
for dtype in (np.float16, BFLOAT16) if SMALL_ONLY else ():
    for d, (sq, sk) in ((40, (70, 90)), (64, (1, 256)), (96, (200, 33)), (128, (113, 130))):
        q, k, v, do = arr((2, sq, 6, d), dtype), arr((2, sk, 2, d), dtype), arr((2, sk, 2, d), dtype), arr((2, sq, 6, d), dtype)
        for kw in ({}, {"causal": True, "window": (30, None), "softcap": 10.0}):
            out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
            cuattn.attention_backward(do, q, k, v, out, lse, dlse=lse, **kw)

for dtype in (np.float16, BFLOAT16) if FORWARD_ONLY else ():
    for d in (64, 96, 128, 200, 256):
        q, k, v = arr((1, 200, 4, d), dtype), arr((1, 333, 2, d), dtype), arr((1, 333, 2, d), dtype)
        for tma in ("1", "0"):  # the TMA kernel (forward_tma.cu), then the one that copies its own tiles
            os.environ["CUATTN_TMA"] = tma
            for kw in ({}, {"causal": True}, {"causal": True, "window": (100, None), "softcap": 10.0}):
                cuattn.attention(q, k, v, return_lse=True, **kw)
        del os.environ["CUATTN_TMA"]
        # The accumulating form over two device pieces of K/V (ring steps, streamed K/V).
        halves = [(k[:, :170], v[:, :170]), (k[:, 170:], v[:, 170:])]
        cuattn.attention_chunked(q, halves, causal=True, return_lse=True, seqlen_k=k.shape[1])
        # Chunked prefill (the forward kernel over a cache): contiguous, then pages of 16 in a
        # shuffled block table, where each key block's offsets come from shared memory.
        q, lengths = arr((1, 128, 4, d), dtype), cupy.asarray([700], dtype=np.int32)
        cuattn.attention_with_kvcache(q, arr((1, 704, 2, d), dtype), arr((1, 704, 2, d), dtype), cache_seqlens=lengths)
        table = cupy.asarray(rng.permutation(48)[:44][None].astype(np.int32))
        cuattn.attention_with_kvcache(q, arr((48, 16, 2, d), dtype), arr((48, 16, 2, d), dtype), cache_seqlens=lengths, block_table=table)

for dtype in (np.float16, BFLOAT16) if WIDE_ONLY else ():
    for d in (160, 192, 200, 256):
        q, k, v, do = arr((1, 300, 4, d), dtype), arr((1, 333, 2, d), dtype), arr((1, 333, 2, d), dtype), arr((1, 300, 4, d), dtype)
        for kw in ({}, {"causal": True}, {"causal": True, "window": (100, None), "softcap": 10.0}):
            out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
            cuattn.attention_backward(do, q, k, v, out, lse, dlse=lse, **kw)

# The TMA forward's CTAs taking several row blocks in turn (its SEVERAL form, where the host
# picks it: here forced at every tile that has it), over rows that end inside a block.
if FORWARD_ONLY:
    from cuattn.kernels import forward as forward_kernels

    forward_kernels.tma_row_blocks_per_cta = lambda *args: 2
    for dtype in (np.float16, BFLOAT16):
        for d in (64, 128, 192, 256):
            q, k, v = arr((1, 700, 2, d), dtype), arr((1, 650, 1, d), dtype), arr((1, 650, 1, d), dtype)
            for kw in ({}, {"causal": True}):
                cuattn.attention(q, k, v, return_lse=True, **kw)

# The 16-bit cases run twice on Hopper: the wgmma kernels (default), then the portable ones.
cases = () if SMALL_ONLY or FORWARD_ONLY or WIDE_ONLY or DECODE_ONLY or PREFILL_ONLY else ((np.float16, "1"), (BFLOAT16, "1"), (np.float16, "0"), (BFLOAT16, "0"), (np.float32, "1"))
for dtype, wgmma in cases:
    os.environ["CUATTN_WGMMA"] = wgmma
    for d in (40, 128, 200, 240):
        q, k, v = arr((1, 70, 4, d), dtype), arr((1, 90, 2, d), dtype), arr((1, 90, 2, d), dtype)
        out, lse = cuattn.attention(q, k, v, causal=True, window=(30, None), softcap=10.0, return_lse=True)
        cuattn.attention(q, k, v)
        do = arr(q.shape, dtype)
        cuattn.attention_backward(do, q, k, v, out, lse, causal=True, window=(30, None), softcap=10.0, dlse=lse)
        out, lse = cuattn.attention(q, k, v, return_lse=True)
        cuattn.attention_backward(do, q, k, v, out, lse)
    # Several key and query blocks: the K/V (Q/dO) rings turn over; the default backward (on
    # Hopper the fused kernel) and the deterministic one.
    for d in (64, 128, 256):
        q, k, v, do = arr((1, 300, 2, d), dtype), arr((1, 333, 1, d), dtype), arr((1, 333, 1, d), dtype), arr((1, 300, 2, d), dtype)
        out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
        for deterministic in (False, True):
            cuattn.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=deterministic)
    outs, lses = arr((3, 1, 33, 2, 64), dtype), arr((3, 1, 2, 33), np.float32)
    cuattn.merge(outs, lses)
    cuattn.merge_(outs[0], lses[0], outs[1], lses[1])
for dtype in (np.float16, BFLOAT16) if DECODE_ONLY else ():
    for d in (64, 128, 256):
        for seqlen_q in (1, 4):
            q, lengths = arr((3, seqlen_q, 8, d), dtype), cupy.asarray([0, 650, 1000], dtype=np.int32)
            k_new, v_new = arr((3, 2, 2, d), dtype), arr((3, 2, 2, d), dtype)
            cache = arr((4, 1000, 2, d), dtype), arr((4, 1000, 2, d), dtype)
            rows = cupy.asarray([2, 0, 7], dtype=np.int32)  # 7: outside the cache (reads clamp, appends skip)
            for _ in range(2):
                cuattn.attention_with_kvcache(q, *cache, cache_seqlens=lengths, cache_batch_idx=rows, k_new=k_new, v_new=v_new)
                cuattn.attention_with_kvcache(q, *cache, cache_seqlens=lengths, cache_batch_idx=rows, num_splits=5, window=(300, None))
            for page in (16, 7, 1):
                pages = -(-1000 // page)
                paged = arr((3 * pages + 2, page, 2, d), dtype), arr((3 * pages + 2, page, 2, d), dtype)
                table = rng.permutation(3 * pages + 2)[: 3 * pages].reshape(3, pages).astype(np.int32)
                table[2, pages // 2] = 10**6  # out of range
                table = cupy.asarray(table)
                for _ in range(2):
                    cuattn.attention_with_kvcache(q, *paged, cache_seqlens=lengths, block_table=table, k_new=k_new, v_new=v_new)
                    cuattn.attention_with_kvcache(q, *paged, cache_seqlens=lengths, block_table=table, softcap=20.0)
                    # one split: a CTA streams every key block, so its ring and table-entry slots turn over
                    cuattn.attention_with_kvcache(q, *paged, cache_seqlens=lengths, block_table=table, num_splits=1)
for dtype in (np.float16, BFLOAT16) if PREFILL_ONLY else ():
    for d in (64, 128, 192, 256):
        q, lengths = arr((2, 200, 4, d), dtype), cupy.asarray([0, 650], dtype=np.int32)
        k_new, v_new = arr((2, 200, 2, d), dtype), arr((2, 200, 2, d), dtype)
        for page in (16, 3, 1):
            pages = -(-1000 // page)
            paged = arr((2 * pages + 2, page, 2, d), dtype), arr((2 * pages + 2, page, 2, d), dtype)
            table = rng.permutation(2 * pages + 2)[: 2 * pages].reshape(2, pages).astype(np.int32)
            table[1, 880 // page] = 10**6  # out of range: in the last key block read (850 keys), past the sequence
            table = cupy.asarray(table)
            for kw in ({}, {"softcap": 20.0, "window": (300, None)}):
                cuattn.attention_with_kvcache(q, *paged, cache_seqlens=lengths, block_table=table, k_new=k_new, v_new=v_new, **kw)
                cuattn.attention_with_kvcache(q, *paged, cache_seqlens=lengths, block_table=table, **kw)
cupy.cuda.Device().synchronize()
print("sanitizer cases ran")
