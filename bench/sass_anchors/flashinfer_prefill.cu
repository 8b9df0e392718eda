// FlashInfer's paged prefill kernel (its FA2 template), instantiated as its launcher picks it on an
// A100 / H100 / H200 for bf16, head 128, causal, long prompts (CTA_TILE_Q = 128, FA2DetermineCtaTileQ)
// (include/flashinfer/attention/prefill.cuh, BatchPrefillWithPagedKVCacheDispatched):
//   NUM_MMA_Q = get_num_mma_q(128) = 2, NUM_WARPS_Q = 4, NUM_WARPS_KV = 1, NUM_MMA_D_* = 128 / 16 = 8;
//   smem per NUM_MMA_KV = (128 + 128) * 16 * 2 B = 8 KiB, fixed (Q tile) 128 * 128 * 2 B = 32 KiB;
//   two CTAs per SM fit (>= 2 * 40 KiB), so (smem_per_SM / 2 - 32 KiB) / 8 KiB >= 4 on both
//   (164 KiB A100, 228 KiB H100/H200), capped by max_num_mma_kv_reg = 8 / NUM_MMA_Q = 4:
//   NUM_MMA_KV = 4 (64-key tiles), dynamic smem 32 KiB + 4 * 8 KiB = 64 KiB, 128 threads.
// GQA group 4 and page 16 are run-time values (group packed into rows; paged_kv_t.page_size).
#include <flashinfer/attention/prefill.cuh>
#include <flashinfer/attention/default_prefill_params.cuh>
#include <flashinfer/attention/variants.cuh>

namespace flashinfer {
using PrefillParams = BatchPrefillPagedParams<nv_bfloat16, nv_bfloat16, nv_bfloat16, int32_t>;
using PrefillVariant = DefaultAttention</*custom_mask=*/false, /*sliding_window=*/false,
                                        /*logits_soft_cap=*/false, /*alibi=*/false>;
using PrefillTraits =
    KernelTraits<MaskMode::kCausal, /*CTA_TILE_Q=*/128, /*NUM_MMA_Q=*/2, /*NUM_MMA_KV=*/4,
                 /*NUM_MMA_D_QK=*/8, /*NUM_MMA_D_VO=*/8, /*NUM_WARPS_Q=*/4, /*NUM_WARPS_KV=*/1,
                 PosEncodingMode::kNone, nv_bfloat16, nv_bfloat16, nv_bfloat16, float, int32_t,
                 PrefillVariant, kPrefillLauncherRepacksFp4, /*USE_TOKEN_HEAD_SF=*/false>;
template __global__ void BatchPrefillWithPagedKVCacheKernel</*SAME_KV_STRIDES=*/true, PrefillTraits,
                                                            PrefillParams>(
    const __grid_constant__ PrefillParams params);
}  // namespace flashinfer
