// Tensor-core building blocks for sm_80+: asynchronous global->shared copies, ldmatrix, and the
// m16n8k16 mma.sync with fp32 accumulators.
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16x16, row-major) a0: (g, 2t..2t+1)  a1: (g+8, 2t..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
//   B (16x8, "col")      b0: (k = 2t..2t+1, n = g)  b1: (k = 2t+8.., n = g)
//   C (16x8)             c0,c1: (g, 2t..2t+1)  c2,c3: (g+8, 2t..2t+1)
#pragma once
#include "dtypes.cuh"

namespace cuattn {

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte copy; src_bytes = 0 writes zeros without reading src (rows / columns out of range).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
// 16-byte copy to shared address `dst`, or 16 zero bytes where `valid` is false (src not read;
// the ignore-src form, which costs no address arithmetic where a byte count does).
__device__ __forceinline__ void cp_async_16_or_zeros_at(u32 dst, const void* src, bool valid) {
  asm volatile("{\n .reg .pred skip;\n setp.eq.u32 skip, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, skip;\n}\n" ::"r"(dst), "l"(src),
               "r"(u32(valid)));
}
// A 16-byte copy, zeros where `valid` is false, for data read once (a KV cache streamed by decoding): marked first to leave L2. (The
// .L2::256B prefetch hint beside it gained 2-4% on an H100 with padded shared rows, and capped a
// plain read stream at 0.9x on an H200; benchmarks/NOTES.md.)
// `dst` a shared-memory address.
__device__ __forceinline__ void cp_async_16_stream_at(u32 dst, const void* src, bool valid) {
  u64 policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0),
               "l"(policy));
}
__device__ __forceinline__ void cp_async_16_stream(void* dst, const void* src, bool valid) {
  cp_async_16_stream_at(smem_addr(dst), src, valid);
}
// The 128-byte line at src pulled into L2, nothing waited for (no register or shared memory).
__device__ __forceinline__ void prefetch_l2(const void* src) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(src)); }
// 4-byte copy through L1 (row vectors such as lse); src_bytes = 0 writes a zero.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// c += a * b on one m16n8k16 tile.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1);

template <>
__device__ __forceinline__ void mma_16816<f16>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<bf16>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A operand (16 x 16: rows of a C tile pair, k = columns 16kk..16kk+15) from C tiles 2kk and
// 2kk + 1, re-packed to 16 bits.
template <typename T, int N>
__device__ __forceinline__ void c_tiles_to_a(const float (&c)[N][4], int kk, u32 (&a)[4]) {
  a[0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

__device__ __forceinline__ u32 dynamic_smem_bytes() {
  u32 r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

}  // namespace cuattn
