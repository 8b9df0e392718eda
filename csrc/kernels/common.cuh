// Shared pieces of the paged-ops CUDA kernels: storage types, 8-element vector loads/stores with
// conversion to float, fp8 (de)quantization, and the launch macro that lets the same launcher code
// run on a GPU (nvcc) or on the CPU emulator (csrc/emu/cuda_emu.h, which defines PAGED_EMU).
//
// No torch types anywhere under csrc/kernels: nvcc compiles these without the (slow) torch headers,
// and the emulator compiles them with the host compiler.
#pragma once

#ifndef PAGED_EMU
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cooperative_groups.h>
#endif

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "attention_rules.h"
#include "kernels/params.h"

// The kernels' namespace. The emulator build renames it (-> paged_cuda_emu_impl) so that its
// host-compiled kernels can never be confused with nvcc's host stubs of the same templates when
// both backends are linked into one extension (same mangled names would be merged by the linker).
#ifndef PAGED_KERNEL_NS
#define PAGED_KERNEL_NS paged_cuda
#endif

// The architecture the kernels are compiled for: nvcc's __CUDA_ARCH__ in device code; in the
// emulator's builds PAGED_EMU_CUDA_ARCH (csrc/cuda_emu/kernels_decode_sm80.cpp builds the decode
// kernels' sm_80 choices, the other emulator builds sm_90's), so both sides of each choice below
// and in decode.cuh run under the emulator. Host code (and a plain emulator build): 900.
#if defined(__CUDA_ARCH__)
#define PAGED_TARGET_ARCH __CUDA_ARCH__
#elif defined(PAGED_EMU_CUDA_ARCH)
#define PAGED_TARGET_ARCH PAGED_EMU_CUDA_ARCH
#else
#define PAGED_TARGET_ARCH 900
#endif

namespace PAGED_KERNEL_NS {
using namespace ::paged;  // kernels/params.h's parameter structs and dtype codes, attention_rules.h's rules

// ---- launching ---------------------------------------------------------------------------------
#ifdef PAGED_EMU
#define PAGED_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::cuda_emu::launch(kernel, grid, block, smem, __VA_ARGS__)
// The emulator records the opt-in per kernel and rejects a launch over 48 KB without it, as a GPU.
#define PAGED_ALLOW_SMEM(kernel, bytes)                                                \
  do {                                                                                 \
    if ((bytes) > 48 * 1024) ::cuda_emu::func_set_max_dynamic_smem(kernel, int(bytes)); \
  } while (0)
#define PAGED_CHECK_LAUNCH(what) ((void)0)
// First statement of every kernel, restating its __launch_bounds__: the emulator rejects a launch
// with more threads per block, as a GPU does (the host compiler drops the attribute itself).
#define PAGED_LAUNCH_BOUNDS_CHECK(max_threads) ::cuda_emu::check_launch_bounds(max_threads)
#else
#define PAGED_LAUNCH_BOUNDS_CHECK(max_threads) ((void)0)
// `stream` is a paged::Stream (void*): the CUDA stream of the launch.
#define PAGED_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<grid, block, smem, static_cast<cudaStream_t>(stream)>>>(__VA_ARGS__)
// Over 48 KB of dynamic shared memory needs an explicit opt-in per kernel.
#define PAGED_ALLOW_SMEM(kernel, bytes)                                                          \
  do {                                                                                           \
    if ((bytes) > 48 * 1024)                                                                     \
      ::paged_cuda::check_cuda(                                                                  \
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)), \
          "cudaFuncSetAttribute");                                                               \
  } while (0)
#define PAGED_CHECK_LAUNCH(what) ::paged_cuda::check_cuda(cudaGetLastError(), what)
inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("paged_cuda: ") + what + ": " + cudaGetErrorString(e));
}
#endif

// ---- thread-block clusters (sm_90 and later) ---------------------------------------------------
// A launch in clusters of `cluster` blocks (cudaLaunchKernelEx with cudaLaunchAttributeClusterDimension;
// over 8 blocks, the portable size, the kernel must allow non-portable sizes), and in the kernels the
// block's rank in its cluster, the cluster's barrier (barrier.cluster.arrive.release + wait.acquire:
// every thread of every block, shared-memory writes before it visible to the cluster after it) and
// the address of the same shared-memory variable in another block of the cluster (mapa). Where the
// code is compiled for an arch without clusters, calling them traps.
#ifdef PAGED_EMU
#define PAGED_LAUNCH_CLUSTER(kernel, grid, block, smem, stream, cluster, ...)                              \
  do {                                                                                                     \
    if ((cluster).x * (cluster).y * (cluster).z > 8) ::cuda_emu::func_set_non_portable_cluster_size_allowed(kernel, true); \
    ::cuda_emu::launch_cluster(kernel, grid, block, smem, cluster, __VA_ARGS__);                        \
  } while (0)
inline unsigned cluster_block_rank() { return ::cuda_emu::cluster_ctarank(); }
inline void cluster_barrier() { ::cuda_emu::cluster_sync(); }
template <typename T>
inline T* cluster_shared_of(T* p, unsigned rank) {
  return ::cuda_emu::cluster_map_shared_rank(p, rank);
}
#else
template <typename... KArgs, typename... Args>
inline void launch_cluster(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                           dim3 cluster, Args... args) {
  if (cluster.x * cluster.y * cluster.z > 8)
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), "cudaFuncSetAttribute");
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster.x;
  attr[0].val.clusterDim.y = cluster.y;
  attr[0].val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&config, kernel, args...), "cudaLaunchKernelEx");
}
#define PAGED_LAUNCH_CLUSTER(kernel, grid, block, smem, stream, cluster, ...) \
  ::PAGED_KERNEL_NS::launch_cluster(kernel, grid, block, smem, static_cast<cudaStream_t>(stream), cluster, __VA_ARGS__)
__device__ __forceinline__ unsigned cluster_block_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().block_rank();
#else
  __trap();
  return 0;
#endif
}
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#else
  __trap();
#endif
}
template <typename T>
__device__ __forceinline__ T* cluster_shared_of(T* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(p, rank);
#else
  __trap();
  return p;
#endif
}
#endif

// ---- dtypes ------------------------------------------------------------------------------------
// Runtime dtype codes: paged::DType (kernels/params.h).

// fp8 storage: one byte, the interpretation is the tag type.
struct e4m3_t {
  uint8_t x;
};
struct e5m2_t {
  uint8_t x;
};

template <typename T>
struct is_fp8 {
  static constexpr bool value = false;
};
template <>
struct is_fp8<e4m3_t> {
  static constexpr bool value = true;
};
template <>
struct is_fp8<e5m2_t> {
  static constexpr bool value = true;
};

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<T>{}) for the storage type of a float dtype (f32/f16/bf16).
template <typename F>
inline void dispatch_float(DType d, F&& f) {
  switch (d) {
    case DType::F32: return f(Tag<float>{});
    case DType::F16: return f(Tag<__half>{});
    case DType::BF16: return f(Tag<__nv_bfloat16>{});
    default: throw std::runtime_error("paged_cuda: expected a float32/float16/bfloat16 tensor");
  }
}
template <typename F>
inline void dispatch_fp8(DType d, F&& f) {
  switch (d) {
    case DType::E4M3: return f(Tag<e4m3_t>{});
    case DType::E5M2: return f(Tag<e5m2_t>{});
    default: throw std::runtime_error("paged_cuda: expected a float8_e4m3fn/float8_e5m2 tensor");
  }
}
// Cache dtype = the activation dtype T, or fp8. Keeps the instantiations at 3 x 3.
template <typename T, typename F>
inline void dispatch_cache(DType act, DType cache, F&& f) {
  if (cache == act) return f(Tag<T>{});
  if (cache == DType::E4M3) return f(Tag<e4m3_t>{});
  if (cache == DType::E5M2) return f(Tag<e5m2_t>{});
  throw std::runtime_error("paged_cuda: cache dtype must be the activation dtype or fp8");
}

// ---- scalar conversions ------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float float_from_bits(uint32_t bits) {
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
#ifdef PAGED_EMU
// cuda_fp16's host conversion returns a canonical (positive) NaN; the GPU's cvt.f32.f16 (and torch)
// keep a NaN's sign and payload. Widen the bits exactly, so the emulator's bytes match the GPU's.
inline float to_float(__half x) {
  uint16_t h;
  memcpy(&h, &x, 2);
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / NaN (payload kept)
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do {
      m <<= 1;
      ++e;
    } while (!(m & 0x400u));
    bits = sign | (uint32_t(112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
#else
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
#endif
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(e4m3_t x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.x, __NV_E4M3)));  // exact: fp8 is a subset of fp16
}
__device__ __forceinline__ float to_float(e5m2_t x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.x, __NV_E5M2)));
}
// prmt.b32 (PTX ISA, prmt; the emulator's model: cuda_emu::prmt): byte n of the result is the byte
// of {b, a} named by the selector's nibble n, or with the nibble's msb set that byte's sign
// replicated over all 8 bits. CUDA's __byte_perm reads 3 bits a nibble and has no sign mode.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
#ifdef PAGED_EMU
  return ::cuda_emu::prmt(a, b, selector);
#else
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
#endif
}
// mul.rn.f16x2 on raw half pairs (the emulator's model: cuda_emu::mul_rn_f16x2): no .ftz, so
// subnormal halves stay exact; .rn keeps nvcc from contracting it into another operation.
__device__ __forceinline__ uint32_t mul_rn_f16x2(uint32_t a, uint32_t b) {
#ifdef PAGED_EMU
  return ::cuda_emu::mul_rn_f16x2(a, b);
#else
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#endif
}

// Two fp8 values of a 32-bit word (its low pair, or its high pair) as two fp16 halves (the first element
// the low half), without sm_89's cvt: the bits cuda_fp8.h's __nv_cvt_fp8x2_to_halfraw2 gives (NaN as the
// canonical 0x7fff), in 5 (e5m2) or 8 (e4m3) integer and half instructions a pair where the library's
// software path on sm_80 / 86 takes a branchy conversion per element (tests/test_cuda_emu.py checks
// all 65536 pairs of both formats against the library).
// - Each byte goes to the high byte of its half (prmt): that is the fp16 number for e5m2, whose
//   layout is fp16's upper byte.
// - e4m3 (bias 7) moves its 7 magnitude bits one place right, below fp16's 5-bit exponent (bias 15),
//   and the multiply by 2^8 corrects the bias: exact, subnormals included (the fp16 multiply keeps them).
// - NaN (e4m3: magnitude 0x7f; e5m2: above 0x7c) is found by adding to the magnitude so that exactly
//   those carry into their half's bit 15, which prmt's sign mode spreads over the half.
template <typename FP8>
__device__ __forceinline__ uint32_t fp8x2_to_half2_bits(uint32_t word, bool high_pair) {
  constexpr bool kE4M3 = std::is_same_v<FP8, e4m3_t>;
  const uint32_t x = prmt(word, 0u, high_pair ? 0x3424u : 0x1404u);  // [0, b0, 0, b1]: each half its byte << 8
  const uint32_t magnitude = x & 0x7f007f00u;
  const uint32_t nan = prmt(magnitude + (kE4M3 ? 0x01000100u : 0x03000300u), 0u, 0xbb99u);  // 0xffff where NaN
  uint32_t h = x;
  if constexpr (kE4M3) h = mul_rn_f16x2((magnitude >> 1) | (x & 0x80008000u), 0x5c005c00u);  // x 2^8
  return (h & ~nan) | (nan & 0x7fff7fffu);
}

// The fp16 pair (bits, the first element in the low half) of a word's low or high fp8 pair: sm_89+
// has cvt.rn.f16x2.e4m3x2 / e5m2x2 (PTX ISA, cvt), one instruction a pair; older GPUs take
// fp8x2_to_half2_bits, whose prmt picks either pair of the word. Exact either way: fp8 is a subset of fp16.
template <typename FP8>
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint32_t word, bool high_pair) {
#if PAGED_TARGET_ARCH >= 890
  const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(uint16_t(high_pair ? word >> 16 : word),
                                                    std::is_same_v<FP8, e4m3_t> ? __NV_E4M3 : __NV_E5M2);
  return uint32_t(h2.x) | (uint32_t(h2.y) << 16);
#else
  return fp8x2_to_half2_bits<FP8>(word, high_pair);
#endif
}
__device__ __forceinline__ float half_bits_to_float(uint16_t bits) {
  __half_raw r;
  r.x = bits;
  return to_float(__half(r));
}
// Four fp8 values of one 32-bit word (the low byte the first element) to float.
template <typename FP8>
__device__ __forceinline__ void fp8x4_to_float(uint32_t word, float* o) {
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
    const uint32_t bits = fp8x2_to_half2<FP8>(word, pair == 1);
    o[2 * pair] = half_bits_to_float(uint16_t(bits));
    o[2 * pair + 1] = half_bits_to_float(uint16_t(bits >> 16));
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The contract's quantization: x / scale as a correctly rounded fp32 division (__fdiv_rn: not the
// approximate division --use_fast_math would pick), then a saturating round-to-nearest-even cast.
// __NV_SATFINITE clamps out-of-range values and infinities to +-max and keeps NaN a NaN, which is
// exactly torch's clamp(-max, max) followed by its cast.
// One difference remains: the intrinsic returns the canonical NaN 0x7f for every NaN, torch keeps
// the sign (0xff for a negative NaN); we keep the sign too, so stored bytes are identical.
__device__ __forceinline__ uint8_t fp8_nan_with_sign(float y) { return (__float_as_int(y) < 0 ? 0x80 : 0) | 0x7f; }
template <typename T>
__device__ __forceinline__ T quantize_fp8(float x, float scale);
template <>
__device__ __forceinline__ e4m3_t quantize_fp8<e4m3_t>(float x, float scale) {
  const float y = __fdiv_rn(x, scale);
  if (y != y) return e4m3_t{fp8_nan_with_sign(y)};
  return e4m3_t{static_cast<uint8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3))};
}
template <>
__device__ __forceinline__ e5m2_t quantize_fp8<e5m2_t>(float x, float scale) {
  const float y = __fdiv_rn(x, scale);
  if (y != y) return e5m2_t{fp8_nan_with_sign(y)};
  return e5m2_t{static_cast<uint8_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E5M2))};
}

// Activation/cache store: a float cast for float types, the saturating quantization for fp8.
template <typename T>
__device__ __forceinline__ T store_cast(float x, float scale) {
  if constexpr (is_fp8<T>::value) {
    return quantize_fp8<T>(x, scale);
  } else {
    return from_float<T>(x);
  }
}

// ---- 8-element vectors ---------------------------------------------------------------------------
// Head sizes are multiples of 8, so every row splits into 8-element chunks: 16 bytes for 16-bit
// types (one 128-bit load), 8 for fp8, 32 for fp32 (two 128-bit loads). `aligned` is uniform per
// launch (pointer and all strides are multiples of the chunk's byte size); an odd view falls back
// to scalar loads instead of faulting on a misaligned vector access.
template <typename T>
struct Chunk8 {
  static constexpr int kBytes = 8 * sizeof(T);
};

// The fp8 scale of (sequence seq, KV head head): scale[seq * seq_stride + head * head_stride], by
// the strides of its form (kernels/params.h: per tensor, per KV head, per sequence and KV head), or
// none (1).
__device__ __forceinline__ float cache_scale(const float* scale, int64_t seq_stride, int64_t head_stride, int64_t seq,
                                             int head) {
  return scale ? scale[seq * seq_stride + head * head_stride] : 1.f;
}

template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&o)[8], bool aligned, float mul = 1.0f) {
#ifdef PAGED_EMU
  ::cuda_emu::note_load(p, 8 * sizeof(T));  // tests count the KV-cache bytes a kernel reads
#endif
  if (aligned) {
    if constexpr (sizeof(T) == 4) {
      const float4 a = reinterpret_cast<const float4*>(p)[0];
      const float4 b = reinterpret_cast<const float4*>(p)[1];
      o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w, o[4] = b.x, o[5] = b.y, o[6] = b.z, o[7] = b.w;
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      // A bf16 is a float's top half: a pair's low element is its word shifted up, its high one the word
      // masked, one instruction each (through __bfloat162float nvcc moved the high one down and back up).
      const uint4 u = *reinterpret_cast<const uint4*>(p);
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        o[2 * i] = float_from_bits(w[i] << 16);
        o[2 * i + 1] = float_from_bits(w[i] & 0xffff0000u);
      }
    } else if constexpr (sizeof(T) == 2) {
      const uint4 u = *reinterpret_cast<const uint4*>(p);
      T h[8];
      memcpy(static_cast<void*>(h), &u, sizeof(u));  // not a pointer cast: T and uint4 must not alias (strict aliasing)
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = to_float(h[i]);
    } else {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      fp8x4_to_float<T>(u.x, o);
      fp8x4_to_float<T>(u.y, o + 4);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = to_float(p[i]);
  }
  if (mul != 1.0f) {
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] *= mul;
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[8], bool aligned, float scale = 1.0f) {
  alignas(16) T tmp[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) tmp[i] = store_cast<T>(v[i], scale);
  if (aligned) {
    if constexpr (sizeof(T) == 4) {
      uint4 u[2];
      memcpy(u, tmp, sizeof(u));
      reinterpret_cast<uint4*>(p)[0] = u[0];
      reinterpret_cast<uint4*>(p)[1] = u[1];
    } else if constexpr (sizeof(T) == 2) {
      uint4 u;
      memcpy(&u, tmp, sizeof(u));
      *reinterpret_cast<uint4*>(p) = u;
    } else {
      uint2 u;
      memcpy(&u, tmp, sizeof(u));
      *reinterpret_cast<uint2*>(p) = u;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = tmp[i];
  }
}

// ---- asynchronous global -> shared copies --------------------------------------------------------
// copy_async(dst, src, bytes): `bytes` is 1, 2, 4, 8 or 16 and both addresses are aligned to it.
// On sm_80+ the 4/8/16-byte copies are cp.async (no registers held while the load is in flight, so
// a block can keep a whole tile of loads outstanding while it computes on the previous one);
// 1/2-byte copies (odd views only) and older GPUs copy synchronously. A copy is complete, for the
// calling thread, after the cp_async_wait that covers its commit group; other threads see it
// after a following __syncthreads.
__device__ __forceinline__ void copy_async(void* dst, const void* src, int bytes) {
#ifdef PAGED_EMU
  ::cuda_emu::note_load(src, bytes);
  // The same instruction per size as the sm_80 branch, with cp.async's alignment rules and its
  // asynchrony (destination NaN until the covering wait): csrc/emu/cuda_emu.h.
  if (bytes == 16) ::cuda_emu::cp_async(dst, src, 16, /*cg=*/true);
  else if (bytes == 8 || bytes == 4) ::cuda_emu::cp_async(dst, src, bytes, /*cg=*/false);
  else ::cuda_emu::aligned_copy(dst, src, bytes);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if (bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
  } else if (bytes == 8) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(src) : "memory");
  } else if (bytes == 4) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src) : "memory");
  } else if (bytes == 2) {
    *static_cast<uint16_t*>(dst) = *static_cast<const uint16_t*>(src);
  } else {
    *static_cast<uint8_t*>(dst) = *static_cast<const uint8_t*>(src);
  }
#else
  if (bytes == 16) *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
  else if (bytes == 8) *static_cast<uint2*>(dst) = *static_cast<const uint2*>(src);
  else if (bytes == 4) *static_cast<uint32_t*>(dst) = *static_cast<const uint32_t*>(src);
  else if (bytes == 2) *static_cast<uint16_t*>(dst) = *static_cast<const uint16_t*>(src);
  else *static_cast<uint8_t*>(dst) = *static_cast<const uint8_t*>(src);
#endif
}
// copy_async_16(dst, src, src_bytes): a 16-byte cp.async.cg of which the first src_bytes (0 or 16
// here) come from src and the rest are zeros (PTX's src-size: zero-fill), so a copy loop writes a
// padding chunk with the instruction that copies a data chunk. Both addresses 16-byte aligned (src
// too when nothing is read: pass any aligned address of the source).
__device__ __forceinline__ void copy_async_16(void* dst, const void* src, int src_bytes) {
#ifdef PAGED_EMU
  ::cuda_emu::note_load(src, src_bytes);
  ::cuda_emu::cp_async(dst, src, 16, /*cg=*/true, src_bytes);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes) : "memory");
#else
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (src_bytes) v = *static_cast<const uint4*>(src);
  *static_cast<uint4*>(dst) = v;
#endif
}
// Closes the calling thread's current group of copy_async copies.
__device__ __forceinline__ void cp_async_commit() {
#ifdef PAGED_EMU
  ::cuda_emu::cp_async_commit_group();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most N of the calling thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef PAGED_EMU
  ::cuda_emu::cp_async_wait_group(N);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// 2^x by one SFU instruction (ex2.approx.ftz.f32; exp2f wraps it in a range fix-up of three more):
// ex2(-Inf) = +0, so a softmax can leave -inf scores untested; subnormal results are 0, which a
// probability below 2^-126 of the row's largest may be. The emulator models the instruction
// (cuda_emu::ex2_approx_ftz, with its error).
__device__ __forceinline__ float exp2_approx(float x) {
#ifdef PAGED_EMU
  return ::cuda_emu::ex2_approx_ftz(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// tanh(x) = 1 - 2 / (1 + 2^(2 x log2 e)) by ex2.approx and __fdividef (a few instructions instead
// of tanhf's polynomial and branches), and x - x^3 / 3 + 2 x^5 / 15 where |x| < 1/16: there the
// first form's absolute error (a few 1e-7, from the cancellation) would be large beside tanh(x)
// itself, and the series is within 3e-9 of it relatively (a capped score stays exact in its
// relative error however large the cap). Exact at the tails (a denominator past 2^126 gives 0:
// tanh is 1 in fp32 long before), NaN stays NaN. For the 16-bit kernels, whose error budgets
// dwarf the first form's.
__device__ __forceinline__ float tanh_fast(float x) {
  const float x2 = x * x;
  const float series = x * (1.f - x2 * (1.f / 3.f - x2 * (2.f / 15.f)));
  const float by_exp = 1.f - __fdividef(2.f, 1.f + exp2_approx(2.f * kLog2e * x));
  return fabsf(x) < 0.0625f ? series : by_exp;
}

// cap tanh(x) as cap - 2 cap / (1 + 2^(2 x log2 e)): one ex2.approx, one reciprocal (__fdividef)
// and three other instructions a score where cap * tanh_fast takes twelve (the pipelined prefill's
// soft-cap). Its error is absolute, not relative as tanh_fast's: a few ulp of 2 cap / (1 + E) from the
// exponential and the division, at most cap 2^-20.7 over x (a sweep with both instructions 2 ulp off,
// the emulator's model of them). With cap = softcap log2(e) that is a probability's relative error of
// up to softcap 2^-20.7, so plan.h kMaxSoftcapByExp bounds the caps that take it (at a cap of 2^126
// every score would round to 0). Exact at the tails (E = 0: -cap; E past 2^126 or infinite: cap),
// NaN stays NaN. exp_mul = 2 log2(e) x / s carries the score's multiplier and 1 / softcap.
struct SoftCapByExp {
  float cap, exp_mul;
  __device__ __forceinline__ float operator()(float s) const {
    return cap - __fdividef(cap + cap, 1.f + exp2_approx(s * exp_mul));
  }
};

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---- the visible keys of a query row ------------------------------------------------------------
// attention_rules.h's visible_keys on the kernels' int positions (a sequence fits int: the binding
// checks), the windows int64 as the contract has them: keys [lo, hi) of the row at position pos
// (= seq_len - q_len + i; negative when q_len > seq_len) of a sequence of seq_len keys. A row with
// none (lo >= hi) is out 0 and lse -inf, or its sink's (end_row), whatever the cache holds.
using KeyRange = ::paged::KeyRange<int>;
__device__ __forceinline__ KeyRange visible_keys(const AttentionParams& p, int pos, int seq_len) {
  return ::paged::visible_keys(pos, seq_len, p.causal, p.window_left, p.window_right);
}

// The end of a row: attention_rules.h's end_row in the kernels' fp32 base-2 arithmetic (Base2F32),
// from the row's running max m (log2 domain) and sum l and the head's sink.
__device__ __forceinline__ RowEnd<float> finish_softmax(const AttentionParams& p, float m, float l, int head) {
  return end_row<Base2F32>(m, l, sink_logit<float>(p.sinks, head));
}

}  // namespace PAGED_KERNEL_NS

// Dynamic shared memory of `count` elements of T. On the emulator the count is checked against the
// launch's request; on a GPU it documents the size the launcher must request.
#ifdef PAGED_EMU
#define PAGED_DYNAMIC_SMEM(T, name, count) T* name = ::cuda_emu::dynamic_smem<T>(count)
#else
#define PAGED_DYNAMIC_SMEM(T, name, count)                       \
  extern __shared__ __align__(16) unsigned char paged_smem_raw[]; \
  T* name = reinterpret_cast<T*>(paged_smem_raw)
#endif

// The paged addressing (PagedKV) needs the kernels' namespace set up above.
#define PAGED_KERNELS_COMMON 1
#include "kernels/paged_kv.h"
