// Tensor-core matrix multiply-accumulate, m16n8k16 with 16-bit inputs (fp16 / bf16) and fp32
// accumulation: `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}...` on a GPU (sm_80+), and a
// functional warp-collective emulation on the CPU emulator (the same fragment layouts, so kernels
// written against them are tested by the emulator).
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16" for .f16/.bf16), per lane with
// g = lane / 4 (group id) and t = lane % 4 (thread in group). A 32-bit register holds two 16-bit
// elements, the lower-indexed one in the low half.
//   A (16 x 16, row-major), a[4]:  a[0] = A[g    ][2t, 2t+1]    a[1] = A[g + 8][2t, 2t+1]
//                                  a[2] = A[g    ][2t+8, 2t+9]  a[3] = A[g + 8][2t+8, 2t+9]
//   B (16 x 8, "col": k-major pairs), b[2]:  b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//   C / D (16 x 8, fp32), c[4]:    c[0], c[1] = C[g][2t, 2t+1]      c[2], c[3] = C[g + 8][2t, 2t+1]
// The emulation sums each output in k order in fp32; the hardware's internal order/precision of
// the partial products may differ in the last bits (covered by the tests' error budgets).
#pragma once
#include "kernels/common.cuh"

namespace PAGED_KERNEL_NS {

template <typename T>
__device__ __forceinline__ uint32_t pack2_raw(T lo, T hi) {
  uint16_t a, b;
  memcpy(&a, &lo, 2);
  memcpy(&b, &hi, 2);
  return uint32_t(a) | (uint32_t(b) << 16);
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return pack2_raw(from_float<T>(lo), from_float<T>(hi));
}

template <typename T>
__device__ __forceinline__ float unpack_half(uint32_t r, int hi) {
  const uint16_t bits = uint16_t(hi ? r >> 16 : r & 0xffffu);
  T v;
  memcpy(&v, &bits, 2);
  return to_float(v);
}

// d += A * B for one 16x8x16 tile, all 32 lanes of the warp participating.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef PAGED_EMU
  struct Frag {
    uint32_t a[4], b[2];
  } mine;
  for (int i = 0; i < 4; ++i) mine.a[i] = a[i];
  mine.b[0] = b[0];
  mine.b[1] = b[1];
  const unsigned char* raw = ::cuda_emu::warp_allgather(kFullMask, &mine, sizeof(Frag));
  auto frag = [&](int lane) -> const Frag& { return *reinterpret_cast<const Frag*>(raw + lane * ::cuda_emu::detail::kMaxGatherBytes); };
  auto A = [&](int row, int col) {  // inverse of the A layout above
    const int lane = (row % 8) * 4 + (col % 8) / 2;
    const int reg = row / 8 + 2 * (col / 8);
    return unpack_half<T>(frag(lane).a[reg], col % 2);
  };
  auto B = [&](int k, int n) {
    const int lane = n * 4 + (k % 8) / 2;
    return unpack_half<T>(frag(lane).b[k / 8], k % 2);
  };
  const int lane = int(::cuda_emu::lane_id());
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    d[i] = acc;
  }
#else
  if constexpr (std::is_same<T, __half>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}

// Fragment loads from shared memory holding T row-major with leading dimension `ld` (elements).
// A tile at (row0, col0) of a 16 x 16 row-major matrix.
template <typename T>
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const T* s, int ld, int row0, int col0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* p0 = s + (row0 + g) * ld + col0 + 2 * t;
  const T* p1 = p0 + 8 * ld;
  // Element pairs are contiguous and 4-byte aligned (even column, even ld): one 32-bit load each.
  memcpy(&a[0], p0, 4);
  memcpy(&a[1], p1, 4);
  memcpy(&a[2], p0 + 8, 4);
  memcpy(&a[3], p1 + 8, 4);
}
// B = M^T where M is stored row-major as [n][k] (e.g. K rows: token x dim): B[k][n] = M[n0 + n][k0 + k].
template <typename T>
__device__ __forceinline__ void load_b_frag_nk(uint32_t (&b)[2], const T* s, int ld, int n0, int k0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* p = s + (n0 + g) * ld + k0 + 2 * t;
  memcpy(&b[0], p, 4);
  memcpy(&b[1], p + 8, 4);
}
// B stored row-major as [k][n] (e.g. V rows: token x dim): B[k][n] = M[k0 + k][n0 + n].
template <typename T>
__device__ __forceinline__ void load_b_frag_kn(uint32_t (&b)[2], const T* s, int ld, int k0, int n0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* p = s + (k0 + 2 * t) * ld + n0 + g;
  b[0] = pack2_raw(p[0], p[ld]);
  b[1] = pack2_raw(p[8 * ld], p[9 * ld]);
}

// ldmatrix.sync.aligned.m8n8.x{N}{.trans}.shared.b16 (PTX ISA, "Warp-level matrix load instruction:
// ldmatrix"): N 8x8 matrices of 16-bit elements from shared memory, all 32 lanes together. Lane l
// gives the address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned; lanes >= 8 N give
// none the instruction uses); r[m] of lane i is row i / 4, elements 2 (i % 4), 2 (i % 4) + 1 of
// matrix m, the lower in the low half: the A/B/C fragment layout above, so one ldmatrix x4 is an
// A fragment or the B fragments of two n-tiles. Trans: of the transposed matrix (stored rows become
// columns), which turns V's [token][dim] rows into P V's k-major B fragments.
template <int N, bool Trans>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[N], const void* smem_row) {
  static_assert(N == 1 || N == 2 || N == 4, "ldmatrix: .x1, .x2 or .x4");
#ifdef PAGED_EMU
  ::cuda_emu::ldmatrix(r, N, Trans, smem_row);  // the PTX rules, checked (csrc/emu/cuda_emu.h)
#else
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  if constexpr (N == 4 && Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
  } else if constexpr (N == 4) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
  } else if constexpr (N == 2 && Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(s));
  } else if constexpr (N == 2) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(s));
  } else if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(s));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(s));
  }
#endif
}

}  // namespace PAGED_KERNEL_NS
