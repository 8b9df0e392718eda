// decode_attention and prefill_attention for the cpu backend: both build AttentionParams and
// run the one core in attention.h (decode is prefill with one query token per sequence).
// The AMX builds' tile kernels come first: bf16_dot.h's entry points call them.
#include "cpu/amx_dot.h"
#include "cpu/attention.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>

#include "cpu/isa.h"

#include <algorithm>
#include <limits>

namespace paged::cpu::PAGED_CPU_ISA_NS {
namespace {

// The dtypes the public op validated, as params.h codes.
DType dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kFloat8_e4m3fn: return DType::E4M3;
    case at::kFloat8_e5m2: return DType::E5M2;
    default: TORCH_CHECK(false, "paged cpu attention: unsupported dtype ", t);
  }
}

template <typename QT>
void dispatch_cache(const AttentionParams& p, at::ScalarType cache_dtype) {
  switch (cache_dtype) {
    case at::kFloat8_e4m3fn: return paged_attention<QT, c10::Float8_e4m3fn>(p);
    case at::kFloat8_e5m2: return paged_attention<QT, c10::Float8_e5m2>(p);
    default: return paged_attention<QT, QT>(p);  // validated: cache dtype == query dtype
  }
}

void run(Tensor& out, const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
         const Tensor& block_tables, const Tensor& cu_seqlens_q, const Tensor& seq_lens,
         double scale, bool causal, const OptTensor& k_scale, const OptTensor& v_scale,
         const AttentionVariants& variants) {
  AttentionParams p{};
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.q_stride_token = query.stride(0), p.q_stride_head = query.stride(1);
  p.o_stride_token = out.stride(0), p.o_stride_head = out.stride(1);
  p.key_cache = key_cache.data_ptr(), p.value_cache = value_cache.data_ptr();
  p.k_stride_block = key_cache.stride(0), p.k_stride_token = key_cache.stride(1), p.k_stride_head = key_cache.stride(2);
  p.v_stride_block = value_cache.stride(0), p.v_stride_token = value_cache.stride(1), p.v_stride_head = value_cache.stride(2);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.max_blocks_per_seq = block_tables.size(1), p.block_table_stride = block_tables.stride(0);
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.k_scale = k_scale ? k_scale->data_ptr<float>() : nullptr;
  p.v_scale = v_scale ? v_scale->data_ptr<float>() : nullptr;
  // Each scale in its own form: per tensor, per KV head or per sequence and KV head.
  const ScaleStrides k_strides = scale_strides(k_scale), v_strides = scale_strides(v_scale);
  p.k_scale_seq_stride = k_strides.seq_stride, p.k_scale_head_stride = k_strides.head_stride;
  p.v_scale_seq_stride = v_strides.seq_stride, p.v_scale_head_stride = v_strides.head_stride;
  p.dtype = dtype_code(query.scalar_type()), p.cache_dtype = dtype_code(key_cache.scalar_type());
  p.num_seqs = seq_lens.size(0);
  p.num_tokens = query.size(0);
  p.num_heads = query.size(1);
  p.num_kv_heads = key_cache.size(2);
  p.head_size = query.size(2);
  p.block_size = key_cache.size(1);
  p.scale = float(scale);
  p.causal = causal;
  // softcap in float, kept > 0 and finite when it is (a cap of 1e-50 is still a cap, and an
  // infinite one would make inf * tanh(0) = NaN of every score).
  p.softcap = variants.softcap > 0 ? std::clamp(float(variants.softcap), std::numeric_limits<float>::denorm_min(),
                                                std::numeric_limits<float>::max())
                                   : 0.f;
  p.window_left = variants.window_left;
  p.window_right = variants.window_right;
  p.sinks = variants.sinks_ptr();
  p.alibi_slopes = variants.alibi_slopes_ptr();
  p.lse = variants.lse_ptr();
  p.batch_invariant = variants.batch_invariant;
#if defined(PAGED_CPU_AMX)
  amx_begin_call();  // every thread reloads its tile configuration in this call (amx_dot.h)
#endif
  switch (query.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(p, key_cache.scalar_type()); break;
    case at::kHalf: dispatch_cache<c10::Half>(p, key_cache.scalar_type()); break;
    case at::kBFloat16: dispatch_cache<c10::BFloat16>(p, key_cache.scalar_type()); break;
    default: TORCH_CHECK(false, "paged cpu attention: unsupported query dtype ", query.scalar_type());
  }
#if defined(PAGED_CPU_AMX_EMULATED)
  // A tile instruction the hardware would fault on (recorded by the model; an exception cannot
  // leave the kernel's OpenMP region): the call fails, its output is not to be trusted.
  const std::string fault = amx_emulated::take_fault();
  TORCH_CHECK(fault.empty(), fault);
#endif
}

}  // namespace

void prefill_attention(Tensor& out, const Tensor& query, const Tensor& key_cache,
                       const Tensor& value_cache, const Tensor& block_tables,
                       const Tensor& cu_seqlens_q, const Tensor& seq_lens, int64_t /*max_seqlen_q*/,
                       double scale, bool causal, const OptTensor& k_scale, const OptTensor& v_scale,
                       PAGED_OPS_VARIANT_PARAMS) {
  run(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, causal,
      k_scale, v_scale, attention_variants(PAGED_OPS_VARIANT_ARGS));
}

void decode_attention(Tensor& out, const Tensor& query, const Tensor& key_cache,
                      const Tensor& value_cache, const Tensor& block_tables,
                      const Tensor& seq_lens, double scale, const OptTensor& k_scale,
                      const OptTensor& v_scale, PAGED_OPS_VARIANT_PARAMS) {
  const Tensor cu_seqlens_q = at::arange(query.size(0) + 1, seq_lens.options());
  run(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, true,
      k_scale, v_scale, attention_variants(PAGED_OPS_VARIANT_ARGS));
}

}  // namespace paged::cpu::PAGED_CPU_ISA_NS
