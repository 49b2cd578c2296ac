// Hopper (sm_90a) warpgroup tensor-core building blocks: shared-memory matrix descriptors for the
// 128-byte-swizzled layout, wgmma.mma_async with fp32 accumulators, and its fences.
//
// Layout (both operand majors): a tile is stored in column blocks of 64 16-bit elements; inside a
// block each row is 128 bytes, and the 16-byte chunk c of row r sits at chunk c ^ (r % 8). Every
// block starts 1024-byte aligned. Read along its rows this is the K-major layout (Q and K); read
// down its rows it is the MN-major layout (V as the B operand of P V).
//
// Register fragments of a warpgroup (warp w of the 4 owns rows 16w..16w+15; g = lane / 4,
// t = lane % 4) are those of mma.m16n8k16 repeated over N / 8: accumulator tile i holds
// (g, 8i + 2t..+1) and (g + 8, 8i + 2t..+1); a register A operand is the m16n8k16 A fragment.
#pragma once
#include "mma.cuh"

namespace cuattn {

constexpr int kSwizzleRowBytes = 128;    // one row of a column block
constexpr int kSwizzleBlockElems = 64;   // 16-bit elements per row of a column block
constexpr int kSwizzleAtomBytes = 1024;  // 8 rows: the period of the swizzle

// Byte offset of 16-byte chunk `chunk` (of 8 per row) in row `row` of one column block.
__device__ __forceinline__ u32 swizzled_chunk(int row, int chunk) {
  return row * kSwizzleRowBytes + ((chunk ^ (row & 7)) << 4);
}

// Matrix descriptor of the 128-byte-swizzled layout. K-major: sbo = 1024 (8 rows), lbo unused.
// MN-major: lbo = bytes between 64-element column blocks, sbo = 1024 (8 rows of K).
__device__ __forceinline__ u64 sw128_desc(u32 smem_byte_addr, u32 lbo_bytes, u32 sbo_bytes) {
  return u64((smem_byte_addr & 0x3FFFF) >> 4) | (u64((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (u64((sbo_bytes >> 4) & 0x3FFF) << 32) | (u64(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Makes this thread's generic-proxy shared-memory writes (cp.async included) visible to wgmma.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving reads or writes of wgmma registers across a fence or wait.
template <int TILES>
__device__ __forceinline__ void fence_registers(float (&d)[TILES][4]) {
#pragma unroll
  for (int i = 0; i < TILES; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}
// The same for register A operands: keeps them (and their registers) alive up to a wait.
template <int TILES>
__device__ __forceinline__ void fence_registers(u32 (&a)[TILES][4]) {
#pragma unroll
  for (int i = 0; i < TILES; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

#define CUATTN_ACC_TILE(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define CUATTN_ACC_32 CUATTN_ACC_TILE(0), CUATTN_ACC_TILE(1), CUATTN_ACC_TILE(2), CUATTN_ACC_TILE(3)
#define CUATTN_ACC_64 CUATTN_ACC_32, CUATTN_ACC_TILE(4), CUATTN_ACC_TILE(5), CUATTN_ACC_TILE(6), CUATTN_ACC_TILE(7)
#define CUATTN_ACC_128 CUATTN_ACC_64, CUATTN_ACC_TILE(8), CUATTN_ACC_TILE(9), CUATTN_ACC_TILE(10), \
    CUATTN_ACC_TILE(11), CUATTN_ACC_TILE(12), CUATTN_ACC_TILE(13), CUATTN_ACC_TILE(14), CUATTN_ACC_TILE(15)
#define CUATTN_REGS_16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define CUATTN_REGS_32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define CUATTN_REGS_64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 x N) = A B + (accumulate ? d : 0), A (64 x 16) and B (16 x N) both K-major in shared memory.
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, bool accumulate);
// d (64 x N) += A B, A (64 x 16) in registers, B (16 x N) MN-major in shared memory.
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs_mn(float (&d)[N / 8][4], const u32 (&a)[4], u64 desc_b);
// d (64 x N) = A B + (accumulate ? d : 0), A (64 x 16) and B (16 x N) both MN-major in shared memory.
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss_mn(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, bool accumulate);
// d (64 x N) = A B + (accumulate ? d : 0), A (64 x 16) K-major and B (16 x N) MN-major in shared memory.
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss_kmn(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, bool accumulate);

// NAME: the function; TRANSPOSE: its two transpose flags ("0, 0": both operands K-major, "1, 1": both MN-major,
// "0, 1": A K-major, B MN-major).
#define CUATTN_WGMMA_SS(NAME, TRANSPOSE, TYPE, N, REGS, ACC, DESC_A, DESC_B, SCALE_D)                        \
  template <>                                                                                                   \
  __device__ __forceinline__ void NAME<TYPE, N>(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, bool accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_D ", 0;\n"                                           \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TYPE "." #TYPE " " REGS ", " DESC_A ", " DESC_B \
                 ", p, 1, 1, " TRANSPOSE ";\n}\n"                                                                  \
                 : ACC : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)));                                         \
  }
#define CUATTN_WGMMA_RS(TYPE, N, REGS, ACC, A_REGS, DESC_B, SCALE_D)                                           \
  template <>                                                                                                   \
  __device__ __forceinline__ void wgmma_rs_mn<TYPE, N>(float (&d)[N / 8][4], const u32 (&a)[4], u64 desc_b) {   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_D ", 0;\n"                                           \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TYPE "." #TYPE " " REGS ", " A_REGS ", " DESC_B \
                 ", p, 1, 1, 1;\n}\n"                                                                              \
                 : ACC : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));                        \
  }
// The operands after the N / 2 accumulators are numbered from %16 (N = 32), %32 (N = 64) or %64 (N = 128).
CUATTN_WGMMA_SS(wgmma_ss, "0, 0", f16, 32, CUATTN_REGS_16, CUATTN_ACC_32, "%16", "%17", "%18")
CUATTN_WGMMA_SS(wgmma_ss, "0, 0", bf16, 32, CUATTN_REGS_16, CUATTN_ACC_32, "%16", "%17", "%18")
CUATTN_WGMMA_SS(wgmma_ss, "0, 0", f16, 64, CUATTN_REGS_32, CUATTN_ACC_64, "%32", "%33", "%34")
CUATTN_WGMMA_SS(wgmma_ss, "0, 0", bf16, 64, CUATTN_REGS_32, CUATTN_ACC_64, "%32", "%33", "%34")
CUATTN_WGMMA_SS(wgmma_ss, "0, 0", f16, 128, CUATTN_REGS_64, CUATTN_ACC_128, "%64", "%65", "%66")
CUATTN_WGMMA_SS(wgmma_ss, "0, 0", bf16, 128, CUATTN_REGS_64, CUATTN_ACC_128, "%64", "%65", "%66")
CUATTN_WGMMA_SS(wgmma_ss_mn, "1, 1", f16, 64, CUATTN_REGS_32, CUATTN_ACC_64, "%32", "%33", "%34")
CUATTN_WGMMA_SS(wgmma_ss_mn, "1, 1", bf16, 64, CUATTN_REGS_32, CUATTN_ACC_64, "%32", "%33", "%34")
CUATTN_WGMMA_SS(wgmma_ss_mn, "1, 1", f16, 128, CUATTN_REGS_64, CUATTN_ACC_128, "%64", "%65", "%66")
CUATTN_WGMMA_SS(wgmma_ss_mn, "1, 1", bf16, 128, CUATTN_REGS_64, CUATTN_ACC_128, "%64", "%65", "%66")
CUATTN_WGMMA_SS(wgmma_ss_kmn, "0, 1", f16, 64, CUATTN_REGS_32, CUATTN_ACC_64, "%32", "%33", "%34")
CUATTN_WGMMA_SS(wgmma_ss_kmn, "0, 1", bf16, 64, CUATTN_REGS_32, CUATTN_ACC_64, "%32", "%33", "%34")
CUATTN_WGMMA_SS(wgmma_ss_kmn, "0, 1", f16, 128, CUATTN_REGS_64, CUATTN_ACC_128, "%64", "%65", "%66")
CUATTN_WGMMA_SS(wgmma_ss_kmn, "0, 1", bf16, 128, CUATTN_REGS_64, CUATTN_ACC_128, "%64", "%65", "%66")
CUATTN_WGMMA_RS(f16, 64, CUATTN_REGS_32, CUATTN_ACC_64, "{%32, %33, %34, %35}", "%36", "%37")
CUATTN_WGMMA_RS(bf16, 64, CUATTN_REGS_32, CUATTN_ACC_64, "{%32, %33, %34, %35}", "%36", "%37")
CUATTN_WGMMA_RS(f16, 128, CUATTN_REGS_64, CUATTN_ACC_128, "{%64, %65, %66, %67}", "%68", "%69")
CUATTN_WGMMA_RS(bf16, 128, CUATTN_REGS_64, CUATTN_ACC_128, "{%64, %65, %66, %67}", "%68", "%69")

// Descriptor of a K-major operand: rows row0.. of a tile of tile_rows rows, k16 step kk.
__device__ __forceinline__ u64 k_major_desc(u32 tile_addr, int tile_rows, int row0, int kk) {
  const int column_block = kk * 16 / kSwizzleBlockElems, within = kk * 16 % kSwizzleBlockElems;
  return sw128_desc(tile_addr + (column_block * tile_rows + row0) * kSwizzleRowBytes + within * 2, 16, kSwizzleAtomBytes);
}
// Descriptor of an MN-major operand: rows 16kk..16kk+15 (the k of the product) of a tile of
// tile_rows rows, all its columns (the N of the product, across column blocks).
__device__ __forceinline__ u64 mn_major_desc(u32 tile_addr, int tile_rows, int kk) {
  return sw128_desc(tile_addr + kk * 16 * kSwizzleRowBytes, tile_rows * kSwizzleRowBytes, kSwizzleAtomBytes);
}

// Issues d (64 x N) = A B^T over K = HEAD_DIM: A is rows a_row0..+63 of a tile of a_rows rows,
// B the N rows of a tile (both row-major, head dim contiguous). Asynchronous: commit and wait.
template <typename T, int N, int HEAD_DIM>
__device__ __forceinline__ void wgmma_rows_by_rows(float (&d)[N / 8][4], u32 a_tile, int a_rows, int a_row0, u32 b_tile) {
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; ++kk) wgmma_ss<T, N>(d, k_major_desc(a_tile, a_rows, a_row0, kk), k_major_desc(b_tile, N, 0, kk), kk > 0);
}

// C (64 x K, fp32 accumulator fragments) packed to 16 bits as register A operands, one per k16 step.
template <typename T, int K>
__device__ __forceinline__ void pack_a_operands(u32 (&a)[K / 16][4], const float (&c)[K / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) c_tiles_to_a<T>(c, kk, a[kk]);
}

// Issues acc (64 x D) += A B: A (64 x K) as packed register operands (pack_a_operands), B the
// K x D tile at b_tile (K rows, head dim contiguous). The registers of `a` are read
// asynchronously: keep them (fence_registers) until the wait.
// D above 128 runs as products of 128 columns (two column blocks of B each), or of 64 where D
// is an odd number of column blocks (192).
template <typename T, int K, int D>
__device__ __forceinline__ void wgmma_regs_by_tile(float (&acc)[D / 8][4], const u32 (&a)[K / 16][4], u32 b_tile) {
  constexpr int kN = D % 128 != 0 ? 64 : D > 128 ? 128 : D;
  static_assert(D % kN == 0 && D % 64 == 0, "D: a multiple of 64");
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk)
#pragma unroll
    for (int part = 0; part < D / kN; ++part) {
      float(&acc_part)[kN / 8][4] = *reinterpret_cast<float(*)[kN / 8][4]>(&acc[part * kN / 8]);
      wgmma_rs_mn<T, kN>(acc_part, a[kk], mn_major_desc(b_tile + part * (kN / kSwizzleBlockElems) * K * kSwizzleRowBytes, K, kk));
    }
}

// Issues acc (64 x D) += C B with C (64 x K, fp32 fragments) packed here; commit and wait
// before the packed registers go out of scope.
template <typename T, int K, int D>
__device__ __forceinline__ void wgmma_frag_by_tile(float (&acc)[D / 8][4], const float (&c)[K / 8][4], u32 b_tile) {
  u32 a[K / 16][4];
  pack_a_operands<T, K>(a, c);
  wgmma_regs_by_tile<T, K, D>(acc, a, b_tile);
}

}  // namespace cuattn
