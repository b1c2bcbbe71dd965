// kvmesh::llama_decode_cpu: a Llama-family model's decode step (one new token per
// request), every decoder layer and the final norm, in one call; bfloat16 or float32
// activations.
//
// The C++ counterpart of the model's compiled decode step (`_decode_step` in
// services/worker/models/llama.py) for a few rows. There each layer is a dozen
// small ops around four matrix-vector products, and launching them from Python,
// with dynamo's guards and arguments before the graph, took about a fifth of a
// one-stream step (benchmarks/RESULTS.md). Per layer, on rows of `hidden`:
//   residual += h (the first layer: residual = h); x = norm(residual)
//   [q | k | v] = x @ qkv.T; q and k rotated (rotate-half, by the row's position)
//   k, v stored at the row's slot of the layer's cache; a = attention(q, cache)
//   residual += a @ o.T; x = norm(residual)
//   [g | u] = x @ gate_up.T; h = (silu(g) * u) @ down.T
// and the result is norm(h + residual) with the final norm's weight.
//
// The linear layers are bfloat16 weights (`linear` "bf16"), w8a8 ones (int8
// weights, activations quantized per token: "w8a8") or a GGUF's own blocks (Q4_0,
// Q4_1 or Q8_0 per layer, activations quantized per block: "gguf"); the products and
// the attention are the kernels the compiled step calls (decode_kernels.h), so they
// give the same bits. The activations, the KV caches, the norms' weights and the
// rotary table share `hidden`'s dtype. The elementwise work is float32; on bfloat16
// it rounds once per tensor the model keeps (the residual, the norm before and after
// its weight, the rotated q/k, silu(g) * u), as the PyTorch reference
// (kernels/llama_decode_cpu.py) rounds. It is a few thousand values a row, done on
// one thread.
//
// Built at run time by kernels/cpu_extension.py with the C++ compiler inductor uses.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "decode_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kKMultiple = 32;  // the linear kernels' step through in_features

using fVec = at::vec::Vectorized<float>;
using bVec = at::vec::Vectorized<bf16>;  // twice fVec's lanes
constexpr int64_t kLanes = bVec::size();

// kLanes values from p, as two vectors of float32.
inline std::tuple<fVec, fVec> load(const bf16* p) {
  return at::vec::convert_to_float<bf16>(bVec::loadu(p));
}
inline std::tuple<fVec, fVec> load(const float* p) {
  return {fVec::loadu(p), fVec::loadu(p + fVec::size())};
}

// (a, b) stored at p: rounded to bfloat16 (to nearest even) there.
inline void store(bf16* p, const fVec& a, const fVec& b) {
  at::vec::convert_from_float<bf16>(a, b).store(p);
}
inline void store(float* p, const fVec& a, const fVec& b) {
  a.store(p);
  b.store(p + fVec::size());
}

// (a, b) as a tensor of T keeps them: rounded to bfloat16 and back, or as they are.
template <typename T>
inline std::tuple<fVec, fVec> round_to(const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<T, bf16>) {
    return at::vec::convert_to_float<bf16>(at::vec::convert_from_float<bf16>(a, b));
  } else {
    return {a, b};
  }
}

// The model's dimensions, read from the first layer's weights and cache.
struct Dims {
  int64_t rows, hidden, num_heads, num_kv_heads, head_size, inter, block_size, num_slots;
  int64_t q_size() const { return num_heads * head_size; }
  int64_t kv_size() const { return num_kv_heads * head_size; }
};

// How the linear layers' weights are stored and multiplied.
enum class LinearKind {
  kBf16,  // bfloat16 [N, K] (bf16_linear_out)
  kW8a8,  // int8 [N, K], float32 scales [N], int32 weight sums [N] (int8_dynamic_linear_out)
  kGguf,  // uint8 blocks [N, K / 32 * block bytes], int64 [2]: the blocks' GGML quant type
          // and whether the rows are packed by eight (gguf_linear_out)
};

LinearKind linear_kind(c10::string_view name) {
  const std::string_view kind(name.data(), name.size());
  TORCH_CHECK(kind == "bf16" || kind == "w8a8" || kind == "gguf",
              "linear must be bf16, w8a8 or gguf, got '", kind, "'");
  return kind == "bf16"   ? LinearKind::kBf16
         : kind == "w8a8" ? LinearKind::kW8a8
                          : LinearKind::kGguf;
}

int64_t tensors_per_linear(LinearKind kind) {
  switch (kind) {
    case LinearKind::kBf16: return 1;
    case LinearKind::kW8a8: return 3;
    default: return 2;
  }
}

// One linear layer: its kind's tensors, in the order above.
struct Linear {
  LinearKind kind;
  const at::Tensor* tensors;

  // out [rows, N] = x [rows, K] @ weight.T, both contiguous, in the activations' dtype.
  void operator()(const at::Tensor& x, at::Tensor& out) const {
    switch (kind) {
      case LinearKind::kBf16: kvmesh::bf16_linear_out(x, tensors[0], out); break;
      case LinearKind::kW8a8:
        kvmesh::int8_dynamic_linear_out(x, tensors[0], tensors[1], tensors[2], out);
        break;
      case LinearKind::kGguf: {
        const int64_t* format = tensors[1].data_ptr<int64_t>();
        kvmesh::gguf_linear_out(x, tensors[0], format[0], format[1] != 0, out);
      }
    }
  }

  // Fails unless the weight is [N, K] and the kernel takes it.
  void check(int64_t N, int64_t K, int64_t layer, const char* name) const {
    const at::Tensor& w = tensors[0];
    if (kind == LinearKind::kGguf) {
      check_gguf(N, K, layer, name);
      return;
    }
    const auto dtype = kind == LinearKind::kBf16 ? at::kBFloat16 : at::kChar;
    TORCH_CHECK(w.scalar_type() == dtype && w.is_contiguous() && w.dim() == 2 &&
                w.size(0) == N && w.size(1) == K, "layer ", layer, "'s ", name,
                " must be contiguous ", dtype, " [", N, ", ", K, "], got ", w.scalar_type(), " ",
                w.sizes());
    if (kind == LinearKind::kW8a8) {
      kvmesh::check_int8_dynamic_weight(w, tensors[1], tensors[2], K);
    }
  }

  void check_gguf(int64_t N, int64_t K, int64_t layer, const char* name) const {
    const at::Tensor& format = tensors[1];
    TORCH_CHECK(format.scalar_type() == at::kLong && format.dim() == 1 && format.size(0) == 2 &&
                format.is_contiguous(), "layer ", layer, "'s ", name,
                " format must be int64 [2] (quant type, packed), got ", format.scalar_type(), " ",
                format.sizes());
    const int64_t* values = format.data_ptr<int64_t>();
    const int64_t quant_type = values[0], packed = values[1];
    TORCH_CHECK(packed == 0 || packed == 1, "layer ", layer, "'s ", name,
                " format's packed must be 0 or 1, got ", packed);
    TORCH_CHECK(tensors[0].dim() == 2 && tensors[0].size(0) == N, "layer ", layer, "'s ", name,
                " must have ", N, " rows of blocks, got ", tensors[0].sizes());
    kvmesh::check_gguf_weight(tensors[0], quant_type, packed == 1, K);
  }
};

// One decoder layer's weights. In `weights`, a layer is its input norm, qkv_proj's
// tensors, o_proj's, the post-attention norm, gate_up_proj's and down_proj's.
struct Layer {
  const at::Tensor& input_norm;
  Linear qkv, o;
  const at::Tensor& post_norm;
  Linear gate_up, down;

  static int64_t num_tensors(LinearKind kind) { return 2 + 4 * tensors_per_linear(kind); }

  static Layer of(at::TensorList weights, LinearKind kind, int64_t layer) {
    const int64_t n = tensors_per_linear(kind);
    const at::Tensor* w = weights.data() + layer * num_tensors(kind);
    return {w[0], {kind, w + 1}, {kind, w + 1 + n}, w[1 + 2 * n], {kind, w + 2 + 2 * n},
            {kind, w + 2 + 3 * n}};
  }
};

// residual = h + residual (when `add`, else h), out = norm(residual) * weight, for
// each row: each [rows, hidden] contiguous, hidden a multiple of kLanes.
template <typename T>
void add_rms_norm(const T* h, T* residual, const T* weight, double eps, bool add, const Dims& d,
                  T* out) {
  for (int64_t r = 0; r < d.rows; ++r) {
    const T* hr = h + r * d.hidden;
    T* rr = residual + r * d.hidden;
    fVec sum_sq(0.f);
    for (int64_t i = 0; i < d.hidden; i += kLanes) {
      auto [a, b] = load(hr + i);
      if (add) {
        auto [ra, rb] = load(rr + i);
        std::tie(a, b) = round_to<T>(a + ra, b + rb);
      }
      store(rr + i, a, b);
      sum_sq = at::vec::fmadd(a, a, at::vec::fmadd(b, b, sum_sq));
    }
    alignas(64) float lanes[fVec::size()];
    sum_sq.store(lanes);
    float total = 0.f;
    for (float lane : lanes) total += lane;
    const fVec inv(1.f / std::sqrt(total / static_cast<float>(d.hidden) + static_cast<float>(eps)));
    for (int64_t i = 0; i < d.hidden; i += kLanes) {
      const auto [a, b] = load(rr + i);
      const auto [na, nb] = round_to<T>(a * inv, b * inv);
      const auto [wa, wb] = load(weight + i);
      store(out + r * d.hidden + i, wa * na, wb * nb);
    }
  }
}

// Rotates the q and k heads of each row of qkv [rows, q + 2 kv] in place by the row's
// position (cos_sin row: cos then sin, head_size / 2 each), then stores its k and v
// at its slot of `cache` [2, num_blocks, block_size, num_kv_heads, head_size].
template <typename T>
void rotate_and_store(T* qkv, const T* cos_sin, const int64_t* positions, const int64_t* slots,
                      T* cache, const Dims& d) {
  const int64_t half = d.head_size / 2, width = d.q_size() + 2 * d.kv_size();
  const int64_t cache_half = d.num_slots * d.kv_size();  // the V cache's offset
  for (int64_t r = 0; r < d.rows; ++r) {
    T* row = qkv + r * width;
    const T* cos = cos_sin + positions[r] * d.head_size;
    const T* sin = cos + half;
    for (int64_t head = 0; head < d.num_heads + d.num_kv_heads; ++head) {
      T* x = row + head * d.head_size;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half], c = cos[i], s = sin[i];
        x[i] = static_cast<T>(x1 * c - x2 * s);
        x[i + half] = static_cast<T>(x2 * c + x1 * s);
      }
    }
    T* k_slot = cache + slots[r] * d.kv_size();
    std::copy_n(row + d.q_size(), d.kv_size(), k_slot);
    std::copy_n(row + d.q_size() + d.kv_size(), d.kv_size(), k_slot + cache_half);
  }
}

// out [rows, inter] = silu(gate) * up, gate_up [rows, 2 inter] = [gate | up], inter a
// multiple of kLanes.
template <typename T>
void silu_and_mul(const T* gate_up, const Dims& d, T* out) {
  const fVec one(1.f);
  for (int64_t r = 0; r < d.rows; ++r) {
    const T* g = gate_up + r * 2 * d.inter;
    for (int64_t i = 0; i < d.inter; i += kLanes) {
      const auto [ga, gb] = load(g + i);
      const auto [ua, ub] = load(g + d.inter + i);
      store(out + r * d.inter + i, ga / (one + ga.neg().exp_u20()) * ua,
            gb / (one + gb.neg().exp_u20()) * ub);
    }
  }
}

void check_weight(const at::Tensor& w, at::ScalarType dtype, at::IntArrayRef shape, int64_t layer,
                  const char* name) {
  TORCH_CHECK(w.scalar_type() == dtype && w.is_contiguous() && w.sizes() == shape, "layer ", layer,
              "'s ", name, " must be contiguous ", dtype, " ", shape, ", got ", w.scalar_type(),
              " ", w.sizes());
}

// Every operand's shape and dtype, and every index into memory, checked once per call.
Dims check_operands(const at::Tensor& hidden, const at::Tensor& positions,
                    const at::Tensor& cos_sin_cache, at::TensorList weights, LinearKind kind,
                    const at::Tensor& final_norm, at::TensorList kv_caches,
                    const at::Tensor& slot_mapping, const at::Tensor& block_table,
                    const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads) {
  const auto dtype = hidden.scalar_type();  // the activations', caches' and norms'
  TORCH_CHECK(hidden.dim() == 2 && (dtype == at::kBFloat16 || dtype == at::kFloat) &&
              hidden.is_contiguous(), "hidden must be contiguous bfloat16 or float32 [rows, ",
              "hidden], got ", dtype, " ", hidden.sizes());
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(num_layers >= 1 &&
              static_cast<int64_t>(weights.size()) == Layer::num_tensors(kind) * num_layers,
              "need ", Layer::num_tensors(kind), " weights per layer for ", num_layers,
              " KV caches, got ", weights.size());
  const at::Tensor& cache = kv_caches[0];
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.scalar_type() == dtype &&
              cache.is_contiguous() && cache.size(3) == num_kv_heads,
              "each KV cache must be contiguous ", dtype, " [2, num_blocks, block_size, ",
              num_kv_heads, ", head_size], got ", cache.scalar_type(), " ", cache.sizes());
  const int64_t rows = hidden.size(0), H = hidden.size(1), head_size = cache.size(4);
  const int64_t inter = Layer::of(weights, kind, 0).gate_up.tensors[0].size(0) / 2;
  const Dims d{rows, H, num_heads, num_kv_heads, head_size, inter, cache.size(2),
               cache.size(1) * cache.size(2)};
  TORCH_CHECK(H % kKMultiple == 0 && d.q_size() % kKMultiple == 0 && inter % kKMultiple == 0 &&
              kKMultiple % kLanes == 0,
              "hidden size ", H, ", heads x head size ", d.q_size(), " and intermediate size ",
              inter, " must be multiples of ", kKMultiple);
  for (int64_t l = 0; l < num_layers; ++l) {
    TORCH_CHECK(kv_caches[l].sizes() == cache.sizes() && kv_caches[l].is_contiguous() &&
                kv_caches[l].scalar_type() == dtype,
                "KV cache ", l, " must be like the first, got ", kv_caches[l].sizes());
    const Layer layer = Layer::of(weights, kind, l);
    check_weight(layer.input_norm, dtype, {H}, l, "input norm");
    layer.qkv.check(d.q_size() + 2 * d.kv_size(), H, l, "qkv_proj");
    layer.o.check(H, d.q_size(), l, "o_proj");
    check_weight(layer.post_norm, dtype, {H}, l, "post-attention norm");
    layer.gate_up.check(2 * inter, H, l, "gate_up_proj");
    layer.down.check(H, inter, l, "down_proj");
  }
  check_weight(final_norm, dtype, {H}, num_layers, "final norm");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == head_size &&
              cos_sin_cache.scalar_type() == dtype && cos_sin_cache.is_contiguous(),
              "cos_sin_cache must be contiguous ", dtype, " [max_position, ", head_size, "], got ",
              cos_sin_cache.scalar_type(), " ", cos_sin_cache.sizes());
  for (const auto& [t, name] : {std::pair{&positions, "positions"}, {&slot_mapping, "slot_mapping"}}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kLong &&
                t->is_contiguous(), name, " must be int64 [", rows, "], got ", t->scalar_type(),
                " ", t->sizes());
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos_sin_cache.size(0), "positions[", r, "] = ", pos[r],
                " is outside [0, ", cos_sin_cache.size(0), ")");
    TORCH_CHECK(slots[r] >= 0 && slots[r] < d.num_slots, "slot_mapping[", r, "] = ", slots[r],
                " is outside [0, ", d.num_slots, ")");
  }
  const at::Tensor query = at::empty({rows, num_heads, head_size}, hidden.options());
  kvmesh::check_decode_attention(query, cache[0], cache[1], block_table, seq_lens);
  return d;
}

// The step on activations of T (after check_operands): the final norm's output.
template <typename T>
at::Tensor decode_step(const at::Tensor& hidden, const at::Tensor& positions,
                       const at::Tensor& cos_sin_cache, at::TensorList weights, LinearKind kind,
                       const at::Tensor& final_norm, at::TensorList kv_caches,
                       const at::Tensor& slot_mapping, const at::Tensor& block_table,
                       const at::Tensor& seq_lens, double eps, double scale, const Dims& d) {
  const auto options = hidden.options();
  at::Tensor h = hidden.clone();
  at::Tensor residual = at::empty_like(hidden), x = at::empty_like(hidden);
  at::Tensor qkv = at::empty({d.rows, d.q_size() + 2 * d.kv_size()}, options);
  at::Tensor attn = at::empty({d.rows, d.num_heads, d.head_size}, options);
  at::Tensor gate_up = at::empty({d.rows, 2 * d.inter}, options);
  at::Tensor act = at::empty({d.rows, d.inter}, options);
  // q's rows inside qkv, as the attention reads them: [rows, heads, head_size].
  const at::Tensor query = qkv.narrow(1, 0, d.q_size()).view({d.rows, d.num_heads, d.head_size});
  const at::Tensor attn_rows = attn.view({d.rows, d.q_size()});
  T* const h_ = h.data_ptr<T>();
  T* const residual_ = residual.data_ptr<T>();
  T* const x_ = x.data_ptr<T>();
  for (int64_t l = 0; l < static_cast<int64_t>(kv_caches.size()); ++l) {
    const Layer layer = Layer::of(weights, kind, l);
    const at::Tensor& cache = kv_caches[l];
    add_rms_norm(h_, residual_, layer.input_norm.data_ptr<T>(), eps, l > 0, d, x_);
    layer.qkv(x, qkv);
    rotate_and_store(qkv.data_ptr<T>(), cos_sin_cache.data_ptr<T>(), positions.data_ptr<int64_t>(),
                     slot_mapping.data_ptr<int64_t>(), cache.data_ptr<T>(), d);
    kvmesh::decode_attention_out(query, cache[0], cache[1], block_table, seq_lens, scale, attn);
    layer.o(attn_rows, h);
    add_rms_norm(h_, residual_, layer.post_norm.data_ptr<T>(), eps, true, d, x_);
    layer.gate_up(x, gate_up);
    silu_and_mul(gate_up.data_ptr<T>(), d, act.data_ptr<T>());
    layer.down(act, h);
  }
  add_rms_norm(h_, residual_, final_norm.data_ptr<T>(), eps, true, d, x_);
  return x;
}

at::Tensor llama_decode_cpu(const at::Tensor& hidden, const at::Tensor& positions,
                            const at::Tensor& cos_sin_cache, at::TensorList weights,
                            const at::Tensor& final_norm, at::TensorList kv_caches,
                            const at::Tensor& slot_mapping, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads,
                            double eps, double scale, c10::string_view linear) {
  const LinearKind kind = linear_kind(linear);
  const Dims d = check_operands(hidden, positions, cos_sin_cache, weights, kind, final_norm,
                                kv_caches, slot_mapping, block_table, seq_lens, num_heads,
                                num_kv_heads);
  const auto step = hidden.scalar_type() == at::kBFloat16 ? decode_step<bf16> : decode_step<float>;
  return step(hidden, positions, cos_sin_cache, weights, kind, final_norm, kv_caches, slot_mapping,
              block_table, seq_lens, eps, scale, d);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("llama_decode_cpu(Tensor hidden, Tensor positions, Tensor cos_sin_cache, "
        "Tensor[] weights, Tensor final_norm, Tensor(a!)[] kv_caches, Tensor slot_mapping, "
        "Tensor block_table, Tensor seq_lens, int num_heads, int num_kv_heads, float eps, "
        "float scale, str linear=\"bf16\") -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("llama_decode_cpu", &llama_decode_cpu);
}
