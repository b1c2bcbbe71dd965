// kvmesh::decode_attention_cpu: one query per request against its paged K/V, on the CPU.
//
// The vectorised counterpart of `decode_attention` in kernels/paged_attention_cpu.py
// (the PyTorch reference, same contract). Each work item is one request, or a
// contiguous range of its blocks when there are too few requests to keep every
// thread busy (flash-decoding splits, merged by log-sum-exp at the end). An item
// walks its blocks in order, reading every KV head's rows of a block together (the
// rows are contiguous in the cache) while the next block is prefetched: read one
// head at a time and unprefetched, the loads were latency-bound at a fifth of
// memory bandwidth. Within a block: each token's scores (a K row in registers,
// dotted with its KV head's queries), one online-softmax update per head, then
// the outputs of each KV head's query heads accumulated in registers over its V
// rows, a few heads at a time, each row converted once. Scores, softmax and
// sums are float32; head sizes are compile-time (32, 64, 128, 256).
//
// Built at run time by kernels/cpu_extension.py with the C++ compiler inductor uses.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "decode_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Bounds of the stack buffers below; the Python side checks them before calling.
constexpr int64_t kMaxHeads = 128;
constexpr int64_t kMaxHeadSize = 256;
// Head sizes compiled for (each keeps a row of K or V in registers).
constexpr int64_t kHeadSizes[] = {32, 64, 128, 256};
constexpr int64_t kMaxBlockSize = 64;
// Work items per thread wanted before a request's blocks are split.
constexpr int64_t kItemsPerThread = 4;
constexpr int64_t kMinBlocksPerSplit = 4;

// A cache row of HEAD elements as float32 vectors, in registers.
template <int HEAD, typename T>
inline void load_row(const T* src, Vec* out) {
  if constexpr (std::is_same_v<T, float>) {
    for (int i = 0; i < HEAD / Vec::size(); ++i) out[i] = Vec::loadu(src + i * Vec::size());
  } else {
    using HalfVec = at::vec::Vectorized<T>;  // twice as many lanes as Vec
    for (int i = 0; i < HEAD / HalfVec::size(); ++i) {
      std::tie(out[2 * i], out[2 * i + 1]) =
          at::vec::convert_to_float<T>(HalfVec::loadu(src + i * HalfVec::size()));
    }
  }
}

inline float reduce_sum(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

inline void prefetch(const void* ptr, int64_t bytes) {
  const char* p = static_cast<const char*>(ptr);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

// A work item's blocks [first, end): its request's blocks cut into `num_splits`
// equal ranges of whole blocks (the last ones may be empty).
struct Split {
  int64_t first, end;
};

inline Split split_blocks(int64_t seq_len, int64_t block_size, int64_t num_splits, int64_t split) {
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  const int64_t per_split = (num_blocks + num_splits - 1) / num_splits;
  const int64_t first = std::min(num_blocks, split * per_split);
  return {first, std::min(num_blocks, first + per_split)};
}

struct Shape {
  int64_t num_heads, num_kv_heads, group, head_size, block_size;
  int64_t block_stride, token_stride;  // cache elements between blocks, between tokens
};

// The outputs of heads [first, first + NH), rescaled by `correction` and accumulated
// over a block's `num_tokens` value rows weighted by `scores`, in registers (cheaper
// than loading and storing the accumulators once per token). The heads
// share a KV head, so each V row is converted to float32 once for all of them
// rather than once per query head.
template <int HEAD, int NH, typename kv_t>
inline void accumulate_heads(int64_t first, const kv_t* values, int64_t token_stride,
                             int64_t num_tokens, const float (*scores)[kMaxBlockSize],
                             const float* correction, float* acc) {
  constexpr int kVecs = HEAD / Vec::size();
  Vec out[NH][kVecs];
  Vec row[kVecs];
  for (int j = 0; j < NH; ++j) {
    const float* a = acc + (first + j) * HEAD;
    for (int i = 0; i < kVecs; ++i) {
      out[j][i] = Vec::loadu(a + i * Vec::size()) * Vec(correction[first + j]);
    }
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    load_row<HEAD>(values + t * token_stride, row);
    for (int j = 0; j < NH; ++j) {
      const Vec p(scores[first + j][t]);
      for (int i = 0; i < kVecs; ++i) out[j][i] = at::vec::fmadd(p, row[i], out[j][i]);
    }
  }
  for (int j = 0; j < NH; ++j) {
    float* a = acc + (first + j) * HEAD;
    for (int i = 0; i < kVecs; ++i) out[j][i].store(a + i * Vec::size());
  }
}

// accumulate_heads for heads [first, first + count), count <= kTile, as a
// compile-time count.
template <int HEAD, int64_t kTile, typename kv_t>
inline void accumulate_values(int64_t first, int64_t count, const kv_t* values,
                              int64_t token_stride, int64_t num_tokens,
                              const float (*scores)[kMaxBlockSize], const float* correction,
                              float* acc) {
  if constexpr (kTile > 1) {
    if (count < kTile) {
      accumulate_values<HEAD, kTile - 1>(first, count, values, token_stride, num_tokens, scores,
                                         correction, acc);
      return;
    }
  }
  accumulate_heads<HEAD, kTile>(first, values, token_stride, num_tokens, scores, correction, acc);
}

// Partial attention of one request over its blocks [block_begin, block_end): per
// head, the unnormalised output `acc` [num_heads, head_size], the running max `m`
// and sum of exponentials `l` ([num_heads] each). `q` is scaled, float32. While a
// block is read, the next one is prefetched a token row at a time (all at once
// overflows the core's miss buffers); after the last, `next_block` (the thread's
// next work item's first block, or -1).
template <int HEAD, typename kv_t>
void attend_blocks(const Shape& s, const float* q, const kv_t* key_cache, const kv_t* value_cache,
                   const int32_t* blocks, int64_t block_begin, int64_t block_end, int64_t seq_len,
                   int64_t next_block, float* acc, float* m, float* l) {
  constexpr int kVecs = HEAD / Vec::size();
  alignas(64) float scores[kMaxHeads][kMaxBlockSize];
  Vec row[kVecs];
  std::fill_n(acc, s.num_heads * HEAD, 0.f);
  std::fill_n(m, s.num_heads, kNegInf);
  std::fill_n(l, s.num_heads, 0.f);
  const int64_t row_bytes = s.token_stride * static_cast<int64_t>(sizeof(kv_t));
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t num_tokens = std::min(s.block_size, seq_len - b * s.block_size);
    const int64_t base = blocks[b] * s.block_stride;
    const int64_t ahead = b + 1 < block_end ? blocks[b + 1] : next_block;
    for (int64_t t = 0; t < s.block_size; ++t) {
      if (ahead >= 0) {
        prefetch(key_cache + ahead * s.block_stride + t * s.token_stride, row_bytes);
        prefetch(value_cache + ahead * s.block_stride + t * s.token_stride, row_bytes);
      }
      if (t >= num_tokens) continue;
      for (int64_t kvh = 0; kvh < s.num_kv_heads; ++kvh) {
        load_row<HEAD>(key_cache + base + t * s.token_stride + kvh * HEAD, row);
        for (int64_t h = kvh * s.group; h < (kvh + 1) * s.group; ++h) {
          Vec dot(0.f);
          for (int i = 0; i < kVecs; ++i) {
            dot = at::vec::fmadd(Vec::loadu(q + h * HEAD + i * Vec::size()), row[i], dot);
          }
          scores[h][t] = reduce_sum(dot);
        }
      }
    }
    float correction[kMaxHeads];
    for (int64_t h = 0; h < s.num_heads; ++h) {
      float block_max = m[h];
      for (int64_t t = 0; t < num_tokens; ++t) block_max = std::max(block_max, scores[h][t]);
      correction[h] = std::exp(m[h] - block_max);  // 0 on the first block
      m[h] = block_max;
      Vec sum(0.f);
      for (int64_t t = 0; t < num_tokens; t += Vec::size()) {
        const int64_t width = std::min<int64_t>(Vec::size(), num_tokens - t);
        const Vec p = (Vec::loadu(scores[h] + t, width) - Vec(block_max)).exp_u20();
        p.store(scores[h] + t, width);
        sum = sum + Vec::set(Vec(0.f), p, width);
      }
      l[h] = l[h] * correction[h] + reduce_sum(sum);
    }
    // Each KV head's value rows, converted once for the query heads of its group, a
    // tile of heads at a time: as many (up to 4) as keep their outputs and a row in
    // the vector registers (32 on AVX-512, 16 on AVX2), else one.
    constexpr int kRegisters = Vec::size() == 16 ? 32 : 16;
    constexpr int64_t kTile = std::clamp((kRegisters - 2) / kVecs - 1, 1, 4);
    for (int64_t kvh = 0; kvh < s.num_kv_heads; ++kvh) {
      const kv_t* values = value_cache + base + kvh * HEAD;
      for (int64_t h = kvh * s.group; h < (kvh + 1) * s.group; h += kTile) {
        accumulate_values<HEAD, kTile>(h, std::min(kTile, (kvh + 1) * s.group - h), values,
                                       s.token_stride, num_tokens, scores, correction, acc);
      }
    }
  }
}

template <typename q_t, typename kv_t, int HEAD>
void decode_attention_kernel(const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_table,
                             const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t num_reqs = query.size(0);
  Shape s{query.size(1), key_cache.size(2), query.size(1) / key_cache.size(2), query.size(2),
          key_cache.size(1), key_cache.stride(0), key_cache.stride(1)};
  const int64_t max_blocks = block_table.size(1);
  const int64_t num_splits = std::clamp<int64_t>(
      (kItemsPerThread * at::get_num_threads() + num_reqs - 1) / num_reqs, 1,
      std::max<int64_t>(1, max_blocks / kMinBlocksPerSplit));
  // Per item: acc [heads, head_size], then m [heads], then l [heads].
  const int64_t part_size = s.num_heads * (s.head_size + 2);
  std::vector<float> parts(num_reqs * num_splits * part_size);
  const q_t* q_ptr = query.data_ptr<q_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  // The item's range of blocks, and the block it starts with (-1: none).
  auto item_split = [&](int64_t item) {
    return split_blocks(lens[item / num_splits], s.block_size, num_splits, item % num_splits);
  };
  auto first_block = [&](int64_t item) -> int64_t {
    const Split range = item_split(item);
    return range.first < range.end ? table[(item / num_splits) * block_table.stride(0) + range.first]
                                   : -1;
  };
  at::parallel_for(0, num_reqs * num_splits, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float q[kMaxHeads * kMaxHeadSize];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / num_splits;
      const Split range = item_split(item);
      const q_t* q_row = q_ptr + r * query.stride(0);
      for (int64_t h = 0; h < s.num_heads; ++h) {
        for (int64_t d = 0; d < s.head_size; ++d) {
          q[h * s.head_size + d] = static_cast<float>(q_row[h * query.stride(1) + d]) * fscale;
        }
      }
      float* part = parts.data() + item * part_size;
      float* m = part + s.num_heads * s.head_size;
      attend_blocks<HEAD, kv_t>(s, q, key_cache.data_ptr<kv_t>(), value_cache.data_ptr<kv_t>(),
                                table + r * block_table.stride(0), range.first, range.end,
                                lens[r], item + 1 < end ? first_block(item + 1) : -1, part, m,
                                m + s.num_heads);
    }
  });
  q_t* out_ptr = out.data_ptr<q_t>();
  at::parallel_for(0, num_reqs * s.num_heads, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float o[kMaxHeadSize];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / s.num_heads, h = item % s.num_heads;
      const float* first_part = parts.data() + r * num_splits * part_size;
      const int64_t m_at = s.num_heads * s.head_size + h, l_at = m_at + s.num_heads;
      float m = kNegInf;
      for (int64_t i = 0; i < num_splits; ++i) m = std::max(m, first_part[i * part_size + m_at]);
      std::fill_n(o, s.head_size, 0.f);
      float l = 0.f;
      for (int64_t i = 0; i < num_splits; ++i) {
        const float* part = first_part + i * part_size;
        if (part[m_at] == kNegInf) continue;  // a split with no keys
        const float weight = std::exp(part[m_at] - m);
        l += part[l_at] * weight;
        for (int64_t d = 0; d < s.head_size; ++d) o[d] += part[h * s.head_size + d] * weight;
      }
      q_t* dst = out_ptr + item * s.head_size;
      for (int64_t d = 0; d < s.head_size; ++d) dst[d] = static_cast<q_t>(o[d] / l);
    }
  });
}

// Every block a request reads is in the cache, and every length fits its table row:
// the kernel reads raw memory, so a bad id must fail here rather than read out of
// bounds. (O(blocks read), next to the attention's O(blocks x block size x heads).)
void check_block_table(const at::Tensor& block_table, const at::Tensor& seq_lens,
                       int64_t num_blocks, int64_t block_size) {
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < block_table.size(0); ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= block_table.size(1) * block_size, "seq_lens[", r,
                "] = ", lens[r], " is outside [1, ", block_table.size(1) * block_size, "]");
    for (int64_t b = 0; b < (lens[r] + block_size - 1) / block_size; ++b) {
      const int32_t id = table[r * block_table.stride(0) + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_table[", r, ", ", b, "] = ", id,
                  " is outside [0, ", num_blocks, ")");
    }
  }
}

at::Tensor decode_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_table,
                                const at::Tensor& seq_lens, double scale) {
  kvmesh::check_decode_attention(query, key_cache, value_cache, block_table, seq_lens);
  auto out = at::empty(query.sizes(), query.options());
  kvmesh::decode_attention_out(query, key_cache, value_cache, block_table, seq_lens, scale, out);
  return out;
}

}  // namespace

// The op's operands: shapes, dtypes, and every block id and length (the kernel
// reads raw memory, so a bad one must fail here).
void kvmesh::check_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache, const at::Tensor& block_table,
                                    const at::Tensor& seq_lens) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [num_reqs, num_heads, "
              "head_size] with contiguous rows");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
              key_cache.strides() == value_cache.strides() && key_cache.stride(3) == 1 &&
              key_cache.stride(2) == key_cache.size(3) &&
              key_cache.stride(1) == key_cache.size(2) * key_cache.size(3),
              "caches must be [num_blocks, block_size, num_kv_heads, head_size] with contiguous blocks");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "caches must share a dtype");
  const int64_t num_heads = query.size(1), head_size = query.size(2);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_size && num_heads % num_kv_heads == 0 &&
              num_heads <= kMaxHeads && std::count(kHeadSizes, std::end(kHeadSizes), head_size) &&
              key_cache.size(1) <= kMaxBlockSize,
              "unsupported attention shape: heads ", num_heads, ", kv heads ", num_kv_heads,
              ", head size ", head_size, ", block size ", key_cache.size(1));
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              block_table.dim() == 2 && block_table.stride(1) == 1 && seq_lens.is_contiguous() &&
              block_table.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "block_table must be int32 [num_reqs, blocks] and seq_lens int32 [num_reqs]");
  check_block_table(block_table, seq_lens, key_cache.size(0), key_cache.size(1));
  TORCH_CHECK((query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16) &&
              (key_cache.scalar_type() == at::kFloat || key_cache.scalar_type() == at::kBFloat16),
              "query and caches must be float32 or bfloat16");
}

// The kernel for the operands' dtypes and head size.
void kvmesh::decode_attention_out(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  if (query.size(0) == 0) return;
  const int64_t head_size = query.size(2);
  const bool q_bf16 = query.scalar_type() == at::kBFloat16;
  const bool kv_bf16 = key_cache.scalar_type() == at::kBFloat16;
  const auto args = std::tie(query, key_cache, value_cache, block_table, seq_lens);
  auto run = [&](auto q_tag, auto kv_tag) {
    using q_t = decltype(q_tag);
    using kv_t = decltype(kv_tag);
    auto with_head = [&](auto head) {
      std::apply([&](const auto&... a) {
        decode_attention_kernel<q_t, kv_t, decltype(head)::value>(a..., scale, out);
      }, args);
    };
    switch (head_size) {
      case 32: with_head(std::integral_constant<int, 32>{}); break;
      case 64: with_head(std::integral_constant<int, 64>{}); break;
      case 128: with_head(std::integral_constant<int, 128>{}); break;
      default: with_head(std::integral_constant<int, 256>{}); break;
    }
  };
  if (q_bf16 && kv_bf16) run(at::BFloat16{}, at::BFloat16{});
  else if (q_bf16) run(at::BFloat16{}, float{});
  else if (kv_bf16) run(float{}, at::BFloat16{});
  else run(float{}, float{});
}

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("decode_attention_cpu(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("decode_attention_cpu", &decode_attention_cpu);
}
