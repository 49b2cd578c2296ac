"""How fast the bare copy patterns a decode kernel could use stream a contiguous KV cache
(batch, seqlen, heads_kv, head_dim) bf16, no attention math: each warp streams 16-key chunks of
one KV head through its own cp.async ring (evict-first L2 policy, as decode.cu copies) and only
touches what landed. Two ways to hand chunks to warps:

- ``head``: a CTA per (KV head, sequence), its warps taking turns over the key chunks (the
  decode kernel's mapping: the 8 CTAs of a sequence read the 256-byte pieces of the same rows).
- ``warp_heads``: a CTA per (key split, group of WARPS KV heads, sequence), warp w streaming
  KV head w of the group over the split's consecutive chunks (the CTA reads whole rows when
  WARPS = heads_kv).

Beside them, cuattn's decode call and SDPA's cuDNN backend on the same cache, in the same run.

    PYTHONPATH=. python scripts/decode_copy_pattern_probe.py --rows 16x32768,16x131072,4x8192 [--spin 0,1000] [--pdl]

``--spin``: each warp also spins that many cycles per chunk after touching it, standing in for
the attention math (rows labelled batch x seqlen / spin).
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import cuattn  # noqa: E402
from benchmarks.bench_decode import HEAD_DIM, HEADS_KV, HEADS_Q, _gbs, rotated_row  # noqa: E402

SOURCE = r"""
typedef unsigned long long u64;
template <int WARPS, int STAGES, int MODE>
__global__ void __launch_bounds__(WARPS * 32, 1)
stream(const unsigned short* k, const unsigned short* v, int seqlen, int heads, int splits, unsigned* sink, int spin, int tlb_ahead) {
  extern __shared__ uint4 smem[];
#if __CUDA_ARCH__ >= 900  // no-ops unless launched as a programmatic dependent (--pdl)
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, seq = blockIdx.y;
  uint4* ring = smem + warp * STAGES * 512;  // a slot: 16 K rows then 16 V rows of 256 bytes
  int head, first, step, count;
  if (MODE == 0) {
    head = blockIdx.x; first = warp; step = WARPS; count = seqlen / 16 / WARPS;
  } else {
    const int groups = heads / WARPS, split = blockIdx.x / groups;
    head = blockIdx.x % groups * WARPS + warp;
    count = seqlen / 16 / splits; first = split * count; step = 1;
  }
  const long row_stride = long(heads) * 128;
  const unsigned short* kh = k + long(seq) * seqlen * row_stride + head * 128 + (lane % 16) * 8;
  const unsigned short* vh = v + long(seq) * seqlen * row_stride + head * 128 + (lane % 16) * 8;
  u64 policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  u64 last_page = ~0ull;
  auto issue = [&](int i) {
    if (tlb_ahead > 0 && lane == 0) {  // touch the 2 MB page tlb_ahead rows on, once a page
      const long row = long(first + i * step) * 16 + tlb_ahead;
      const u64 page = u64(kh + row * row_stride) >> 21;
      if (row < seqlen && page != last_page) {
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(kh + row * row_stride));
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(vh + row * row_stride));
        last_page = page;
      }
    }
    if (i < count) {
      const long row0 = long(first + i * step) * 16 + lane / 16;
      uint4* slot = ring + (i % STAGES) * 512;
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const long row = row0 + 2 * r;
        unsigned dk = (unsigned)__cvta_generic_to_shared(slot + (lane / 16 + 2 * r) * 16 + lane % 16);
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dk), "l"(kh + row * row_stride), "l"(policy));
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dk + 4096), "l"(vh + row * row_stride), "l"(policy));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  for (int i = 0; i < STAGES - 1; ++i) issue(i);
  unsigned acc = 0;
  for (int i = 0; i < count; ++i) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    __syncwarp();
    issue(i + STAGES - 1);
    const uint4* slot = ring + (i % STAGES) * 512;
    const uint4 a = slot[lane], b = slot[256 + lane];
    acc ^= a.x ^ a.w ^ b.y ^ b.z;
    if (spin > 0) {  // stands in for the attention math of the chunk
      const long long t0 = clock64();
      while (clock64() - t0 < spin) acc += 1;
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}
"""

# (label, mode, warps, stages)
PATTERNS = [
    ("head w4 s4", 0, 4, 4),
    ("head w4 s3", 0, 4, 3),
    ("head w8 s2", 0, 8, 2),
    ("head w8 s3", 0, 8, 3),
    ("warp_heads w8 s2", 1, 8, 2),
    ("warp_heads w8 s3", 1, 8, 3),
    ("warp_heads w4 s4", 1, 4, 4),
    ("warp_heads w4 s3", 1, 4, 3),
]


def _dependent(kernel, grid, threads: int, smem: int, values):
    """``kernel`` launched as a programmatic dependent of the grid before it (cuattn.launch), with
    ``values`` (device pointers as ints or CuPy arrays, CuPy int32 scalars) as its arguments."""
    from cuattn.launch import DependentLaunch

    holders = [ctypes.c_void_p(v.data.ptr) if hasattr(v, "data") and hasattr(v.data, "ptr") else
               ctypes.c_int(int(v)) if isinstance(v, np.integer) else ctypes.c_void_p(v) for v in values]
    argv = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
    dependent = DependentLaunch(kernel.kernel, (*grid, 1), (threads, 1, 1), smem)

    def launch(stream: int) -> bool:
        return dependent(stream, ctypes.addressof(argv))

    launch.arguments = holders, argv  # alive as long as the launch
    return launch


def main() -> None:
    import cupy as cp
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="16x32768,16x131072,4x8192")
    parser.add_argument("--ctas", type=int, default=0, help="CTAs of the warp_heads grid (0: as many as the head grid)")
    parser.add_argument("--tlb-ahead", type=int, default=0, help="rows ahead whose 2 MB page each warp touches, once a page (0: none)")
    parser.add_argument("--pdl", action="store_true", help="launch the copy kernels as programmatic dependents (as decode.cu is)")
    parser.add_argument("--spin", default="0", help="cycles each warp spends on a chunk after touching it (comma list: a table each)")
    args = parser.parse_args()
    names = [f"stream<{w}, {s}, {m}>" for _, m, w, s in PATTERNS]
    module = cp.RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=names)
    sink = cp.zeros(1, dtype=cp.uint32)
    print(f"{'row':>10} " + " ".join(f"{label:>17}" for label, *_ in PATTERNS) + f" {'cuattn':>8} {'cudnn':>8}   GB/s")
    for batch, seqlen, spin in ((*map(int, r.split("x")), int(s)) for s in args.spin.split(",") for r in args.rows.split(",")):
        nbytes, sets, q, kv, lengths = rotated_row(batch, seqlen)
        cells = []
        for (label, mode, warps, stages), name in zip(PATTERNS, names):
            kernel = module.get_function(name)
            smem = warps * stages * 8192
            kernel.max_dynamic_shared_size_bytes = smem
            if mode == 0:
                grid, splits = (HEADS_KV, batch), 1
            else:
                head_ctas = HEADS_KV * batch
                ctas = args.ctas or head_ctas
                splits = max(1, ctas // batch // (HEADS_KV // warps))
                grid = (splits * (HEADS_KV // warps), batch)

            def arguments(i, splits=splits):
                return (kv[i][0].data_ptr(), kv[i][1].data_ptr(), cp.int32(seqlen), cp.int32(HEADS_KV), cp.int32(splits), sink,
                        cp.int32(spin), cp.int32(args.tlb_ahead))

            if args.pdl:
                dependents = [_dependent(kernel, grid, warps * 32, smem, arguments(i)) for i in range(sets)]

                def launch(i, dependents=dependents):
                    assert dependents[i](torch.cuda.current_stream().cuda_stream), "the driver refused the dependent launch"
            else:
                def launch(i, kernel=kernel, grid=grid, warps=warps, smem=smem, arguments=arguments):
                    with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                        kernel(grid, (warps * 32,), arguments(i), shared_mem=smem)

            cells.append(_gbs(nbytes, launch, sets))
        cells.append(_gbs(nbytes, lambda i: cuattn.attention_with_kvcache(q[i], *kv[i], cache_seqlens=lengths), sets))
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        views = [[x.transpose(1, 2) for x in (q[i], *kv[i])] for i in range(len(q))]

        def cudnn(i):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                return sdpa(*views[i], enable_gqa=True)

        cells.append(_gbs(nbytes, cudnn, sets))
        print(f"{f'b{batch}s{seqlen}/{spin}':>10} " + " ".join(f"{c:>17.0f}" for c in cells[:-2]) + f" {cells[-2]:>8.0f} {cells[-1]:>8.0f}",
              flush=True)
        del q, kv


if __name__ == "__main__":
    assert HEADS_Q % HEADS_KV == 0 and HEAD_DIM == 128
    main()
