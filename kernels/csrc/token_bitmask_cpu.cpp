// Structured outputs: masks the logits of the tokens a grammar forbids.
//
// kvmesh::apply_token_bitmask_cpu(logits, bitmask, rows) sets logits[r, t] to
// -inf wherever bit t of bitmask[r] is 0, for each r in rows (int64). The
// bitmask is int32 [num_rows, ceil(vocab / 32)], bit t % 32 of word t / 32
// (xgrammar's layout). The inner loop is branch-free so the compiler
// vectorises it; rows are split across threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

namespace {

void mask_row(float* logits, const int32_t* words, int64_t vocab) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t full_words = vocab / 32;
  for (int64_t w = 0; w < full_words; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    if (bits == 0xFFFFFFFFu) continue;  // every token of the word allowed
    float* out = logits + w * 32;
    for (int b = 0; b < 32; ++b) {
      out[b] = ((bits >> b) & 1u) ? out[b] : kNegInf;
    }
  }
  const uint32_t bits = vocab % 32 ? static_cast<uint32_t>(words[full_words]) : 0u;
  for (int64_t t = full_words * 32; t < vocab; ++t) {
    if (!((bits >> (t % 32)) & 1u)) logits[t] = kNegInf;
  }
}

void apply_token_bitmask_cpu(at::Tensor logits, const at::Tensor& bitmask,
                             const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be contiguous float32 [num_rows, vocab]");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be contiguous int32 [num_rows, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be int64 [n]");
  const int64_t vocab = logits.size(1);
  const int64_t words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "bitmask has ", words, " words for a vocab of ", vocab);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0) && row_ids[i] < bitmask.size(0),
                "row ", row_ids[i], " is out of range");
  }
  float* data = logits.data_ptr<float>();
  const int32_t* mask = bitmask.data_ptr<int32_t>();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = row_ids[i];
      mask_row(data + r * vocab, mask + r * words, vocab);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("apply_token_bitmask_cpu(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("apply_token_bitmask_cpu", &apply_token_bitmask_cpu);
}
