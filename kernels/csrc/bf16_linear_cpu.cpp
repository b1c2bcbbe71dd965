// kvmesh::bf16_linear_cpu: x @ weight.T with a bfloat16 weight, for a few rows (decode).
//
// out[m, n] = sum_k x[m, k] * weight[n, k] in float32, rounded once to x's dtype
// (float32 or bfloat16): the product F.linear(x.float(), weight.float()) computes,
// up to summation order. weight is the model's plain [N, K] layout; K must be a
// multiple of 32.
//
// Decode reads every weight once per step, so the kernel is a stream over the
// weight rows, as kernels/csrc/int8_linear_cpu.cpp is: each thread takes one
// contiguous range of rows, eight at a time with independent float32 accumulators
// while the next eight are prefetched (or not: row_groups.h), and each weight vector
// is loaded (and widened) once per block of up to four activation rows. One
// activation row takes the eight rows one after another instead, so that the
// weight is read in order (each path's dot_row), prefetching a fixed distance
// ahead where the process's mode says so: on a Xeon with AMX the AVX512-BF16 path
// read 1.2-1.3x faster so than eight rows abreast (benchmarks/RESULTS.md).
//
// Three paths, chosen per call (`path` "auto"), or forced by name for tests:
//  - "avx512bf16": vdpbf16ps multiplies bfloat16 pairs straight from memory, for
//    bfloat16 x on CPUs that have AVX512-BF16 (checked at run time; compiled with
//    a target attribute, so the library still loads elsewhere). Its products are
//    exact in float32 like the reference's (it flushes denormals, below ~1e-38).
//    float32 x would have to be rounded to bfloat16 first, which changes the
//    result, so float32 x takes the next path.
//  - "avx512f" (AVX-512 builds): a bfloat16 is the high half of a float32, so a
//    32-bit word holding a pair widens into two floats with one shift and one
//    mask: the even elements and the odd ones. x is converted to float32 once per
//    call with each step's even elements before its odd ones, to match.
//  - "avx2": the same at 256 bits; the AVX2 build's path (also compiled into
//    AVX-512 builds, so that it can be tested there).
//
// Built at run time by kernels/cpu_extension.py with the C++ compiler inductor uses.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>

#include "bf16_amx_linear.h"
#include "decode_kernels.h"
#include "row_groups.h"

#include <algorithm>
#include <cstdint>
#include <string_view>

namespace {

constexpr int64_t kRows = 8;  // weight rows per group (and per inner loop for one row of x)
constexpr int64_t kBlock = 4;  // rows of x per inner loop
constexpr int64_t kKMultiple = 32;  // K per step of the 512-bit paths
#if defined(CPU_CAPABILITY_AVX512)
constexpr const char* kPaths = "auto, avx512bf16, avx512f, avx2";
#else
constexpr const char* kPaths = "auto, avx2";
#endif

// Widening paths: a step is kPairs 32-bit words of weight, 2 * kPairs elements.
struct Avx2 {
  using Vec = __m256;
  static constexpr int64_t kPairs = 8;
  static constexpr int64_t kBlockRows = 2;  // weight rows per inner loop with a block of x:
                                            // 4 x 2 accumulators fit 16 registers
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static void widen(const uint16_t* w, Vec& even, Vec& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF0000)));
  }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static float sum(Vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};

#if defined(CPU_CAPABILITY_AVX512)
struct Avx512F {
  using Vec = __m512;
  static constexpr int64_t kPairs = 16;
  static constexpr int64_t kBlockRows = 4;  // 4 x 4 accumulators
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void widen(const uint16_t* w, Vec& even, Vec& odd) {
    const __m512i v = _mm512_loadu_si512(w);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF0000)));
  }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static float sum(Vec v) { return _mm512_reduce_add_ps(v); }
};
#endif

// A widening path: x float32, each step's even elements before its odd ones.
template <typename Isa>
struct Widen {
  using X = float;
  static constexpr int64_t kBlockRows = Isa::kBlockRows;

  // dot(x, w) for one row of each, the weight row read in order with four
  // independent accumulators. With one row of x there is no widened weight vector
  // to share, so a group's rows go one after another: one sequential stream per
  // thread. Read eight rows abreast (eight streams), the AVX2-only EPYC's two
  // threads streamed 11-12 GB/s; row after row, 14-16 (Tensor.sum: 18-20).
  // kAhead: each step prefetches the bytes kvmesh::kAheadBytes past it (the
  // process's mode, RowGroupPrefetch::kAhead); rows are contiguous, so past a
  // row's end lie the next row's first bytes.
  template <bool kAhead>
  static float dot_row(const float* x, const uint16_t* w, int64_t K) {
    using Vec = typename Isa::Vec;
    constexpr int64_t P = Isa::kPairs;
    Vec acc[4] = {Isa::zero(), Isa::zero(), Isa::zero(), Isa::zero()};
    int64_t k = 0;
    for (; k + 4 * P <= K; k += 4 * P) {  // two steps of 2 * P elements
      if constexpr (kAhead) kvmesh::prefetch_ahead(w + k, 4 * P * sizeof(uint16_t));
      Vec even0, odd0, even1, odd1;
      Isa::widen(w + k, even0, odd0);
      Isa::widen(w + k + 2 * P, even1, odd1);
      acc[0] = Isa::fma(Isa::load(x + k), even0, acc[0]);
      acc[1] = Isa::fma(Isa::load(x + k + P), odd0, acc[1]);
      acc[2] = Isa::fma(Isa::load(x + k + 2 * P), even1, acc[2]);
      acc[3] = Isa::fma(Isa::load(x + k + 3 * P), odd1, acc[3]);
    }
    if (k < K) {  // K is a multiple of 2 * P: one step left at most
      Vec even, odd;
      Isa::widen(w + k, even, odd);
      acc[0] = Isa::fma(Isa::load(x + k), even, acc[0]);
      acc[1] = Isa::fma(Isa::load(x + k + P), odd, acc[1]);
    }
    return Isa::sum(Isa::add(Isa::add(acc[0], acc[1]), Isa::add(acc[2], acc[3])));
  }

  // out[m * out_stride + r] = dot(x row m, w row r) for MB rows of x and R rows of w.
  template <int64_t MB, int64_t R>
  static void dot_block(const float* x, const uint16_t* w, int64_t K, float* out,
                        int64_t out_stride) {
    using Vec = typename Isa::Vec;
    constexpr int64_t P = Isa::kPairs;
    Vec acc[MB][R];
    for (int64_t m = 0; m < MB; ++m)
      for (int64_t r = 0; r < R; ++r) acc[m][r] = Isa::zero();
    for (int64_t k = 0; k < K; k += 2 * P) {
      Vec even[R], odd[R];
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) Isa::widen(w + r * K + k, even[r], odd[r]);
#pragma GCC unroll 4
      for (int64_t m = 0; m < MB; ++m) {
        const Vec xe = Isa::load(x + m * K + k), xo = Isa::load(x + m * K + k + P);
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) {
          acc[m][r] = Isa::fma(xo, odd[r], Isa::fma(xe, even[r], acc[m][r]));
        }
      }
    }
    for (int64_t m = 0; m < MB; ++m)
      for (int64_t r = 0; r < R; ++r) out[m * out_stride + r] = Isa::sum(acc[m][r]);
  }

  // x as this path reads it: float32 [M, K], each step's pairs split into even, odd.
  static at::Tensor prepare(const at::Tensor& x) {
    const at::Tensor xc = x.contiguous();
    at::Tensor out = at::empty(xc.sizes(), xc.options().dtype(at::kFloat));
    if (xc.scalar_type() == at::kBFloat16) {
      deinterleave(xc.data_ptr<at::BFloat16>(), out.data_ptr<float>(), xc.numel());
    } else {
      deinterleave(xc.data_ptr<float>(), out.data_ptr<float>(), xc.numel());
    }
    return out;
  }

  template <typename scalar_t>
  static void deinterleave(const scalar_t* src, float* dst, int64_t n) {
    constexpr int64_t P = Isa::kPairs;
    for (int64_t i = 0; i < n; i += 2 * P) {
      for (int64_t j = 0; j < P; ++j) {
        dst[i + j] = static_cast<float>(src[i + 2 * j]);
        dst[i + P + j] = static_cast<float>(src[i + 2 * j + 1]);
      }
    }
  }
};

#if defined(CPU_CAPABILITY_AVX512)
#define KVMESH_AVX512BF16 __attribute__((target("avx512bf16")))

// The AVX512-BF16 path: x bfloat16 as it is; vdpbf16ps multiplies the pairs.
struct Avx512Bf16 {
  using X = uint16_t;
  static constexpr int64_t kBlockRows = 4;

  // dot(x, w) for one row of each, the weight row read in order with four
  // independent accumulators, as Widen::dot_row reads it (kAhead: each step
  // prefetches the bytes kvmesh::kAheadBytes past it).
  template <bool kAhead>
  KVMESH_AVX512BF16 static float dot_row(const uint16_t* x, const uint16_t* w, int64_t K) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    int64_t k = 0;
    for (; k + 4 * kKMultiple <= K; k += 4 * kKMultiple) {
      if constexpr (kAhead) kvmesh::prefetch_ahead(w + k, 4 * kKMultiple * sizeof(uint16_t));
#pragma GCC unroll 4
      for (int64_t j = 0; j < 4; ++j) {
        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(x + k + j * kKMultiple),
                                  (__m512bh)_mm512_loadu_si512(w + k + j * kKMultiple));
      }
    }
    for (int64_t j = 0; k < K; k += kKMultiple, ++j) {  // K a multiple of 32: three steps at most
      if constexpr (kAhead) kvmesh::prefetch_ahead(w + k, kKMultiple * sizeof(uint16_t));
      acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(x + k),
                                (__m512bh)_mm512_loadu_si512(w + k));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]),
                                              _mm512_add_ps(acc[2], acc[3])));
  }

  template <int64_t MB, int64_t R>
  KVMESH_AVX512BF16 static void dot_block(const uint16_t* x, const uint16_t* w, int64_t K,
                                          float* out, int64_t out_stride) {
    __m512 acc[MB][R];
    for (int64_t m = 0; m < MB; ++m)
      for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += kKMultiple) {
      __m512bh wv[R];
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
#pragma GCC unroll 4
      for (int64_t m = 0; m < MB; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
#pragma GCC unroll 8
        for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
      }
    }
    for (int64_t m = 0; m < MB; ++m)
      for (int64_t r = 0; r < R; ++r) out[m * out_stride + r] = _mm512_reduce_add_ps(acc[m][r]);
  }

  static at::Tensor prepare(const at::Tensor& x) { return x.contiguous(); }
};
#endif

// Path::dot_block for a run-time block of mb (1..kBlock) rows of x.
template <typename Path, int64_t R>
void dot_block_of(int64_t mb, const typename Path::X* x, const uint16_t* w, int64_t K,
                  float* out, int64_t out_stride) {
  switch (mb) {
    case 1: Path::template dot_block<1, R>(x, w, K, out, out_stride); break;
    case 2: Path::template dot_block<2, R>(x, w, K, out, out_stride); break;
    case 3: Path::template dot_block<3, R>(x, w, K, out, out_stride); break;
    default: Path::template dot_block<4, R>(x, w, K, out, out_stride); break;
  }
}

// dots[m * kRows + r] for mb rows of x and the group's `rows` weight rows; `ahead`:
// the one-row loop prefetches ahead of its reads (kvmesh::prefetch_ahead_mode()).
template <typename Path>
void dot_group(const typename Path::X* x, int64_t mb, const uint16_t* w, int64_t rows,
               int64_t K, bool ahead, float* dots) {
  if (mb == 1 && ahead) {
    for (int64_t r = 0; r < rows; ++r) dots[r] = Path::template dot_row<true>(x, w + r * K, K);
  } else if (mb == 1) {
    for (int64_t r = 0; r < rows; ++r) dots[r] = Path::template dot_row<false>(x, w + r * K, K);
  } else if (rows == kRows) {
    for (int64_t r0 = 0; r0 < kRows; r0 += Path::kBlockRows) {
      dot_block_of<Path, Path::kBlockRows>(mb, x, w + r0 * K, K, dots + r0, kRows);
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) dot_block_of<Path, 1>(mb, x, w + r * K, K, dots + r, kRows);
  }
}

template <typename Path, typename scalar_t>
void bf16_linear_kernel(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const at::Tensor xp = Path::prepare(x);
  const auto* xs = reinterpret_cast<const typename Path::X*>(xp.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  scalar_t* o = out.data_ptr<scalar_t>();
  const bool ahead = kvmesh::prefetch_ahead_mode();
  kvmesh::for_each_row_group<kRows>(N, w, K * 2, [&](int64_t n0, int64_t rows) {
    float dots[kBlock * kRows];
    for (int64_t m0 = 0; m0 < M; m0 += kBlock) {  // the group's weights stay in L1
      const int64_t mb = std::min(kBlock, M - m0);
      dot_group<Path>(xs + m0 * K, mb, w + n0 * K, rows, K, ahead, dots);
      for (int64_t m = 0; m < mb; ++m) {
        for (int64_t r = 0; r < rows; ++r) {
          o[(m0 + m) * N + n0 + r] = static_cast<scalar_t>(dots[m * kRows + r]);
        }
      }
    }
  });
}

template <typename Path>
void run(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  if (x.scalar_type() == at::kBFloat16) {
    bf16_linear_kernel<Path, at::BFloat16>(x, weight, out);
  } else {
    bf16_linear_kernel<Path, float>(x, weight, out);
  }
}

// Runs the path named (all the checks made): "auto" the fastest for x's dtype on this CPU.
void run_path(std::string_view name, const at::Tensor& x, const at::Tensor& weight,
              at::Tensor& out) {
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
#if defined(CPU_CAPABILITY_AVX512)
  const bool has_bf16 = __builtin_cpu_supports("avx512bf16");
  if (name == "avx512bf16" || (name == "auto" && bf16_x && has_bf16)) {
    TORCH_CHECK(bf16_x && has_bf16, "path avx512bf16 needs bfloat16 x and a CPU with "
                "AVX512-BF16, got x ", x.scalar_type(), (has_bf16 ? "" : " on a CPU without it"));
    run<Avx512Bf16>(x, weight, out);
    return;
  }
  if (name == "auto" || name == "avx512f") {
    run<Widen<Avx512F>>(x, weight, out);
    return;
  }
#endif
  TORCH_CHECK(name == "auto" || name == "avx2", "unknown path '", name, "': this build has ",
              kPaths);
  run<Widen<Avx2>>(x, weight, out);
}

at::Tensor bf16_linear_cpu(const at::Tensor& x, const at::Tensor& weight,
                           c10::string_view path) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
              weight.is_contiguous(), "weight must be contiguous bfloat16 [N, K], got ",
              weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == weight.size(1) && x.size(1) % kKMultiple == 0,
              "x [M, K] and weight [N, K] must share K, a multiple of ", kKMultiple, ", got x ",
              x.sizes(), " and weight ", weight.sizes());
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  run_path(std::string_view(path.data(), path.size()), x, weight, out);
  return out;
}

// oneDNN's linear on a weight mkldnn::_reorder_linear_weight laid out (as a
// PackedLinear runs it), called through the dispatcher: ATen declares no C++
// function for it.
at::Tensor onednn_packed_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                                const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed_weight, bias, std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  op.callBoxed(stack);
  return stack[0].toTensor();
}

// out plus bias, where there is one: added to a kernel's rounded output (one
// rounding more than oneDNN's, for bfloat16 x).
at::Tensor add_bias(at::Tensor out, const std::optional<at::Tensor>& bias) {
  if (bias.has_value()) out.add_(*bias);
  return out;
}

// The rows above a layer's max_rows: on packed_weight where the layer holds one,
// laid out for kvmesh's AMX kernel (5-D, amx_pack's) or reordered for oneDNN (2-D),
// else at::linear on the plain weight.
at::Tensor above_max_rows(const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& packed_weight) {
  if (!packed_weight.has_value()) return at::linear(x, weight, bias);
#if defined(KVMESH_AMX)
  if (packed_weight->dim() == 5) {
    return add_bias(kvmesh::bf16_amx_linear_cpu(x, *packed_weight), bias);
  }
#endif
  return onednn_packed_linear(x, *packed_weight, bias);
}

// A layer's op (services/worker/layers/bf16_linear.py): this kernel for up to
// max_rows rows of x, where the worker measured it faster than what runs above
// (above_max_rows). Choosing here rather than in Python keeps the choice out of
// compiled graphs: they call this one op for every batch size.
at::Tensor bf16_linear_dispatch(const at::Tensor& x, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias, int64_t max_rows,
                                const std::optional<at::Tensor>& packed_weight) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K], got ", x.sizes());
  if (x.size(0) > max_rows) return above_max_rows(x, weight, bias, packed_weight);
  return add_bias(bf16_linear_cpu(x, weight, "auto"), bias);
}

// Output shapes for torch.compile's tracing (fake tensors run the Meta kernels).
at::Tensor bf16_linear_meta(const at::Tensor& x, const at::Tensor& weight, c10::string_view) {
  return at::empty({x.size(0), weight.size(0)}, x.options());
}

// Symbolic sizes: traced with dynamic shapes, x's rows are a symbol.
at::Tensor bf16_linear_dispatch_meta(const at::Tensor& x, const at::Tensor& weight,
                                     const std::optional<at::Tensor>&, int64_t,
                                     const std::optional<at::Tensor>&) {
  return at::empty_symint({x.sym_size(0), weight.sym_size(0)}, x.options());
}

}  // namespace

void kvmesh::bf16_linear_out(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  run_path("auto", x, weight, out);
}

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("bf16_linear_cpu(Tensor x, Tensor weight, str path=\"auto\") -> Tensor");
  m.def("bf16_linear_dispatch(Tensor x, Tensor weight, Tensor? bias, int max_rows, "
        "Tensor? packed_weight=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("bf16_linear_cpu", &bf16_linear_cpu);
  m.impl("bf16_linear_dispatch", &bf16_linear_dispatch);
}

// A packed_weight is an opaque oneDNN tensor, so calls that pass one dispatch here.
TORCH_LIBRARY_IMPL(kvmesh, MkldnnCPU, m) {
  m.impl("bf16_linear_dispatch", &bf16_linear_dispatch);
}

TORCH_LIBRARY_IMPL(kvmesh, Meta, m) {
  m.impl("bf16_linear_cpu", &bf16_linear_meta);
  m.impl("bf16_linear_dispatch", &bf16_linear_dispatch_meta);
}
#endif  // CPU_CAPABILITY_AVX512 || CPU_CAPABILITY_AVX2
