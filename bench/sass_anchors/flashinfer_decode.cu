// FlashInfer's paged decode kernel, instantiated as its launcher picks it for bf16 Q/KV/O, head 128,
// GQA group 4 (include/flashinfer/attention/decode.cuh, BatchDecodeWithPagedKVCacheDispatched):
//   vec_size = max(16 / sizeof(bf16), 128 / 32) = 8, bdx = 128 / 8 = 16, bdy = GROUP_SIZE = 4,
//   num_threads = max(128, bdx * bdy) = 128, bdz = 2, tile_size_per_bdx = 1 (group > 1),
//   NUM_STAGES_SMEM = 2 (compute capability >= 8, utils.cuh).
// Page size is a run-time field of paged_kv_t (16 in our comparison); no template parameter.
// Compiled by bench/sass.py with -I <flashinfer>/data/include; nothing of FlashInfer is vendored.
#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/default_decode_params.cuh>
#include <flashinfer/attention/variants.cuh>

namespace flashinfer {
using DecodeParams = BatchDecodeParams<nv_bfloat16, nv_bfloat16, nv_bfloat16, int32_t>;
using DecodeVariant = DefaultAttention</*custom_mask=*/false, /*sliding_window=*/false,
                                       /*logits_soft_cap=*/false, /*alibi=*/false>;
template __global__ void BatchDecodeWithPagedKVCacheKernel<PosEncodingMode::kNone, 2, 1, 8, 16, 4, 2,
                                                           DecodeVariant, DecodeParams>(
    const __grid_constant__ DecodeParams params);
}  // namespace flashinfer
