// The decode kernels the fused decode step (llama_decode_cpu.cpp) calls directly,
// without the dispatcher, an output allocation or the checks each op makes per call.
#pragma once

#include <ATen/ATen.h>

namespace kvmesh {

// bf16_linear_cpu.cpp: out [M, N] = x [M, K] @ weight [N, K].T, x float32 or bfloat16
// (out in x's dtype, contiguous), weight contiguous bfloat16, K a multiple of 32;
// the fastest path this CPU runs ("auto"). Unchecked.
void bf16_linear_out(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out);

// int8_dynamic_linear_cpu.cpp: the checks kvmesh::int8_dynamic_linear_cpu makes of its
// operands (x float32 or bfloat16 [M, K], qweight int8 [N, K], float32 scales and int32
// weight_sums [N], K a multiple of 64 within the int32 sums' bound).
void check_int8_dynamic_linear(const at::Tensor& x, const at::Tensor& qweight,
                               const at::Tensor& scales, const at::Tensor& weight_sums);

// int8_dynamic_linear_cpu.cpp: the part of check_int8_dynamic_linear about the weight,
// for activations with K columns.
void check_int8_dynamic_weight(const at::Tensor& qweight, const at::Tensor& scales,
                               const at::Tensor& weight_sums, int64_t K);

// int8_dynamic_linear_cpu.cpp: kvmesh::int8_dynamic_linear_cpu (x quantized to int8 per
// row, VNNI where the CPU has it) into out [M, N] (contiguous, x's dtype), unchecked:
// after check_int8_dynamic_linear.
void int8_dynamic_linear_out(const at::Tensor& x, const at::Tensor& qweight,
                             const at::Tensor& scales, const at::Tensor& weight_sums,
                             at::Tensor& out);

// gguf_linear_cpu.cpp: the checks kvmesh::gguf_linear_cpu (packed: gguf_linear_packed_cpu)
// makes of qweight for activations with K columns: uint8 [N, K / 32 * block bytes] of
// quant_type (2 Q4_0, 3 Q4_1 or 8 Q8_0), N a multiple of 8 where packed.
void check_gguf_weight(const at::Tensor& qweight, int64_t quant_type, bool packed, int64_t K);

// gguf_linear_cpu.cpp: either op (VNNI where the CPU has it) into out [M, N]
// (contiguous, x's dtype) for x [M, K] contiguous float32 or bfloat16, M, N, K > 0,
// unchecked: after check_gguf_weight.
void gguf_linear_out(const at::Tensor& x, const at::Tensor& qweight, int64_t quant_type,
                     bool packed, at::Tensor& out);

// decode_attention_cpu.cpp: the checks kvmesh::decode_attention_cpu makes of its
// operands (shapes and dtypes it serves, every block id and length in bounds).
void check_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens);

// decode_attention_cpu.cpp: kvmesh::decode_attention_cpu into out [num_reqs, num_heads,
// head_size] (contiguous, query's dtype), unchecked: after check_decode_attention.
void decode_attention_out(const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_table,
                          const at::Tensor& seq_lens, double scale, at::Tensor& out);

}  // namespace kvmesh
