// FlashAttention-2's forward kernels (csrc/flash_attn/src of the flash-attn 2.8.3 source), bf16,
// head 128, instantiated as its launchers pick them (flash_fwd_launch_template.h):
//  - flash_fwd_kernel: run_mha_fwd_hdim128 on sm80 / sm90 (not sm8x), no dropout:
//    Flash_fwd_kernel_traits<128, kBlockM 128, kBlockN 64, 4 warps>, causal, even M/N and K.
//  - flash_fwd_splitkv_kernel (its paged-KV / kv-cache path): run_mha_fwd_splitkv_dispatch:
//    Flash_fwd_kernel_traits<128, 64, 128, 4 warps>, non-causal (one query per sequence), Split,
//    Is_even_MN false (a kv-cache call passes per-sequence lengths), even K.
// GQA group 4 is a run-time ratio (params.h_h_k_ratio). FA2 takes paged KV only in pages that are
// multiples of 256 tokens (flash_api.cpp), so page 16 has no FA2 instance.
// Compiled by bench/sass.py with -I <flash-attn>/csrc/flash_attn/src, CUTLASS 3.x and torch's
// headers (flash.h includes ATen); nothing of flash-attn is vendored.
#include "flash_fwd_launch_template.h"

namespace FLASH_NAMESPACE {
using Fwd128 = Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>;
using Split128 = Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::bfloat16_t>;
// <traits, Is_dropout, Is_causal, Is_local, Has_alibi, Is_even_MN, Is_even_K, Is_softcap, Return_softmax>
template __global__ void flash_fwd_kernel<Fwd128, false, true, false, false, true, true, false, false>(
    KERNEL_PARAM_MODIFIER const Flash_fwd_params params);
// <traits, Is_causal, Is_local, Has_alibi, Is_even_MN, Is_even_K, Is_softcap, Split, Append_KV>
template __global__ void flash_fwd_splitkv_kernel<Split128, false, false, false, false, true, false, true, false>(
    KERNEL_PARAM_MODIFIER const Flash_fwd_params params);
}  // namespace FLASH_NAMESPACE
