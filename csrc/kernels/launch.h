// The one launcher interface of the CUDA kernels, shared by the two builds that run them:
//   * the GPU build (nvcc): csrc/cuda/decode.cu, prefill.cu, merge.cu and cache_kernels.cu define
//     kCudaDecode, kCudaPrefill, kCudaMerge (+ kCudaMergeStates) and kCudaCache, launching on a
//     CUDA stream;
//   * the emulator (host compiler over csrc/emu/cuda_emu.h): csrc/cuda_emu/kernels_decode.cpp,
//     kernels_prefill.cpp, kernels_merge.cpp and kernels_cache.cpp define kEmuDecode, kEmuPrefill,
//     kEmuMerge (+ kEmuMergeStates) and kEmuCache;
//     launches are synchronous.
// Each launcher lives in the translation unit that compiles its kernels, so the big kernel sets
// compile in parallel. The binding (csrc/binding.h) fills the parameters and the plan once and
// calls one build's launchers. No torch or CUDA types: a stream travels as paged::Stream (void*).
#pragma once
#include <cstdint>

#include "kernels/params.h"
#include "kernels/plan.h"

namespace paged {

// `workspace`: plan.workspace_floats floats (null when that is 0).
using DecodeLauncher = void (*)(const AttentionParams& p, const DecodePlan& plan, float* workspace, Stream stream);
using PrefillLauncher = void (*)(const AttentionParams& p, const PrefillPlan& plan, Stream stream);
using MergeLauncher = void (*)(const MergeParams& p, Stream stream);
using MergeStatesLauncher = void (*)(const MergeStatesParams& p, Stream stream);

struct CacheLaunchers {
  void (*reshape_and_cache)(const ReshapeCacheParams& p, Stream stream);
  void (*quantize_fp8)(const Fp8Params& p, Stream stream);
  void (*dequantize_fp8)(const Fp8Params& p, Stream stream);
  // `caches` and `mapping` ([num_pairs, 2] src/dst block ids) are device arrays.
  void (*copy_blocks)(const CacheDesc* caches, int num_caches, const int64_t* mapping, int64_t num_pairs,
                      Stream stream);
};

extern const DecodeLauncher kCudaDecode;    // csrc/cuda/decode.cu
extern const PrefillLauncher kCudaPrefill;  // csrc/cuda/prefill.cu
extern const CacheLaunchers kCudaCache;     // csrc/cuda/cache_kernels.cu
extern const MergeLauncher kCudaMerge;      // csrc/cuda/merge.cu
extern const MergeStatesLauncher kCudaMergeStates;  // csrc/cuda/merge.cu
extern const DecodeLauncher kEmuDecode;     // csrc/cuda_emu/kernels_decode.cpp (sm_90's code)
extern const DecodeLauncher kEmuDecodeSm80; // csrc/cuda_emu/kernels_decode_sm80.cpp (sm_80's code)
extern const PrefillLauncher kEmuPrefill;   // csrc/cuda_emu/kernels_prefill.cpp
extern const CacheLaunchers kEmuCache;      // csrc/cuda_emu/kernels_cache.cpp
extern const MergeLauncher kEmuMerge;       // csrc/cuda_emu/kernels_merge.cpp
extern const MergeStatesLauncher kEmuMergeStates;  // csrc/cuda_emu/kernels_merge.cpp

}  // namespace paged
