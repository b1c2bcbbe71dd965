// kvmesh::int8_linear_cpu: weight-only int8 linear for a few rows (decode), on AVX-512.
//
// out[m, n] = scales[n] * sum_k x[m, k] * qweight[n, k], the product torch's
// `_weight_int8pack_mm` computes (its reference). Decode reads every weight once per
// step, so the kernel is a stream over the int8 rows: each thread takes one
// contiguous range of rows (one memory stream, which the hardware prefetcher
// follows), eight rows at a time with eight independent float32 accumulators per
// activation row, so the FMAs do not wait on each other, while the next eight rows
// are prefetched (a fifth faster than the prefetcher alone). Every activation row
// is converted to float32 once, and every weight vector once per block of up to
// four activation rows, which it then multiplies into each: converting int8 costs
// more than the FMA, so a step of a few rows (a request and its drafts) costs
// little more than one row. Only built for AVX-512; elsewhere torch's kernel
// serves.
//
// Built at run time by kernels/cpu_extension.py with the C++ compiler inductor uses.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include "row_groups.h"

#include <algorithm>

namespace {

constexpr int64_t kRows = 8;  // weight rows per group (and per inner loop for one row of x)
constexpr int64_t kLanes = 16;  // floats per AVX-512 vector
constexpr int64_t kBlock = 4;  // rows of x per inner loop: 4 x 4 accumulators
constexpr int64_t kBlockRows = 4;  // weight rows per inner loop with a block of x

// out[m * out_stride + r] = dot(x row m, w row r) for MB rows of `x` and R consecutive
// rows of `w` (row length K): each weight vector is converted once for all MB rows.
template <int64_t MB, int64_t R>
inline void dot_block(const float* x, const int8_t* w, int64_t K, float* out,
                      int64_t out_stride) {
  __m512 acc[MB][R];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kLanes) {
    __m512 wv[R];
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * K + k));
      wv[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
    }
#pragma GCC unroll 4
    for (int64_t m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
#pragma GCC unroll 8
      for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t r = 0; r < R; ++r) out[m * out_stride + r] = _mm512_reduce_add_ps(acc[m][r]);
}

// dot_block for a run-time block of mb (1..kBlock) rows of x.
template <int64_t R>
inline void dot_block_of(int64_t mb, const float* x, const int8_t* w, int64_t K, float* out,
                         int64_t out_stride) {
  switch (mb) {
    case 1: dot_block<1, R>(x, w, K, out, out_stride); break;
    case 2: dot_block<2, R>(x, w, K, out, out_stride); break;
    case 3: dot_block<3, R>(x, w, K, out, out_stride); break;
    default: dot_block<4, R>(x, w, K, out, out_stride); break;
  }
}

// dots[m * kRows + r] for rows m0 .. m0 + mb of x and the group's `rows` weight rows.
inline void dot_group(const float* x, int64_t mb, const int8_t* w, int64_t rows, int64_t K,
                      float* dots) {
  if (rows == kRows && mb == 1) {
    dot_block<1, kRows>(x, w, K, dots, kRows);
  } else if (rows == kRows) {
    for (int64_t half = 0; half < kRows; half += kBlockRows) {
      dot_block_of<kBlockRows>(mb, x, w + half * K, K, dots + half, kRows);
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) dot_block_of<1>(mb, x, w + r * K, K, dots + r, kRows);
  }
}

template <typename scalar_t>
void int8_linear_kernel(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const at::Tensor x_float = x.to(at::kFloat).contiguous();
  const float* xf = x_float.data_ptr<float>();
  const int8_t* w = qweight.data_ptr<int8_t>();
  const scalar_t* s = scales.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  kvmesh::for_each_row_group<kRows>(N, w, K, [&](int64_t n0, int64_t rows) {
    float dots[kBlock * kRows];
    for (int64_t m0 = 0; m0 < M; m0 += kBlock) {  // the group's weights stay in L1
      const int64_t mb = std::min(kBlock, M - m0);
      dot_group(xf + m0 * K, mb, w + n0 * K, rows, K, dots);
      for (int64_t m = 0; m < mb; ++m) {
        for (int64_t r = 0; r < rows; ++r) {
          o[(m0 + m) * N + n0 + r] =
              static_cast<scalar_t>(dots[m * kRows + r] * static_cast<float>(s[n0 + r]));
        }
      }
    }
  });
}

at::Tensor int8_linear_cpu(const at::Tensor& x, const at::Tensor& qweight,
                           const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2 && qweight.is_contiguous() &&
              qweight.scalar_type() == at::kChar && x.size(1) == qweight.size(1) &&
              x.size(1) % kLanes == 0,
              "x must be [M, K] and qweight int8 [N, K] with K a multiple of ", kLanes);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == qweight.size(0) && scales.is_contiguous() &&
              scales.scalar_type() == x.scalar_type(), "scales must be [N] in x's dtype");
  auto out = at::empty({x.size(0), qweight.size(0)}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    int8_linear_kernel<at::BFloat16>(x, qweight, scales, out);
  } else {
    int8_linear_kernel<float>(x, qweight, scales, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("int8_linear_cpu(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("int8_linear_cpu", &int8_linear_cpu);
}
#endif  // CPU_CAPABILITY_AVX512
