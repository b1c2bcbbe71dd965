// kvmesh::gguf_linear_cpu: x @ W.T with W in GGUF's own Q4_0 / Q4_1 / Q8_0 blocks,
// never dequantized to float (llama.cpp's scheme: ggml_vec_dot_q4_0_q8_0 and kin).
//
// out[m, n] = sum over blocks b of the row: d_w * d_x * sum_i q_w[i] * q_x[i]
//             (+ m_w * d_x * sum_i q_x[i] for Q4_1),
// where every activation row is first quantized to int8 per block of 32 (d_x =
// absmax / 127, round half to even; kernels/gguf_linear_cpu.py has the reference).
// Integer dot products per block, scaled and summed in float32.
//
// Decode reads every weight once per step, so the kernel streams each thread's
// contiguous range of rows, four rows at a time with independent accumulators,
// prefetching the next four, and multiplies up to four activation rows into a
// weight vector once it is unpacked. The nibbles are unpacked unsigned (0..15) and,
// for VNNI, Q8_0 weights shifted to unsigned (+128), so one unsigned x signed instruction
// does the products; the shift's -8 / -128 times the block's sum of q_x starts the
// integer accumulator, exactly. Two paths, chosen per call at run time:
//   * AVX512-VNNI: two blocks per 512-bit vector, vpdpbusd. The activation's int8
//     and scales are stored in the lane order the weights unpack to.
//   * AVX2 (every x86-64 the library is built for): a block per 256-bit vector,
//     vpmaddubsw + vpmaddwd (Q8_0 with the sign trick: products stay under int16).
// gguf_linear_packed_cpu reads the rows packed by eight at load (below), on the
// same two paths.
//
// Built at run time by kernels/cpu_extension.py with the C++ compiler inductor uses.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>

#include "decode_kernels.h"
#include "row_groups.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#define KVMESH_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVMESH_VNNI \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

namespace {

constexpr int64_t kBlock = 32;  // weights per GGUF block
constexpr int64_t kRows = 4;  // weight rows per group (a thread's unit of work)
constexpr int64_t kMaxXRows = 4;  // activation rows per pass over a group
// A block whose largest magnitude is below this counts as zero (127 / absmax would
// overflow float32 for subnormals).
constexpr float kMinAbsMax = 1e-30f;

// GGUF's ids (gguf.GGMLQuantizationType).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

template <int64_t QT>
struct Format;
template <>
struct Format<kQ4_0> {
  static constexpr int64_t kBytes = 18, kQs = 2;
};
template <>
struct Format<kQ4_1> {
  static constexpr int64_t kBytes = 20, kQs = 4;
};
template <>
struct Format<kQ8_0> {
  static constexpr int64_t kBytes = 34, kQs = 2;
};

inline int64_t block_bytes(int64_t quant_type) {
  switch (quant_type) {
    case kQ4_0: return Format<kQ4_0>::kBytes;
    case kQ4_1: return Format<kQ4_1>::kBytes;
    case kQ8_0: return Format<kQ8_0>::kBytes;
    default: return 0;
  }
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// ---- activations: int8 per block of 32, in the lane order of the weight vectors ----

// One block of x quantized: q = round(x * 127 / absmax), d = absmax / 127. A block with
// a NaN or an infinity gets d = NaN (its row's outputs are NaN, as the reference's).
struct XBlock {
  int8_t q[kBlock];
  float d;
  int32_t sum;
};

KVMESH_AVX2 inline XBlock quantize_block(const float* x) {
  XBlock out;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], a[4];
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    a[i] = _mm256_andnot_ps(sign, v[i]);
  }
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 bad = _mm256_cmp_ps(a[0], inf, _CMP_NLT_UQ);  // NaN or inf
  for (int i = 1; i < 4; ++i) bad = _mm256_or_ps(bad, _mm256_cmp_ps(a[i], inf, _CMP_NLT_UQ));
  __m256 m8 = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float absmax = _mm_cvtss_f32(m4);
  if (_mm256_movemask_ps(bad) != 0 || !(absmax >= kMinAbsMax)) {
    std::memset(out.q, 0, sizeof(out.q));
    out.d = _mm256_movemask_ps(bad) != 0 ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    out.sum = 0;
    return out;
  }
  out.d = absmax / 127.0f;
  const __m256 inv_d = _mm256_set1_ps(127.0f / absmax);
  __m256i q[4];  // the current rounding mode: to nearest, ties to even
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv_d));
  __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
  out.sum = _mm_cvtsi128_si32(s4);
  // packs work within 128-bit lanes: the permute restores element order.
  const __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                        _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q),
                      _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return out;
}

// A group is the blocks one weight vector holds (2 for VNNI, 1 for AVX2); per
// activation row and group, a record of three vectors: q_x in the weights' lane
// order, d_x on every int32 lane, and `aux` on the first int32 lane of each block:
// the integer start -offset * sum(q_x), or (Q4_1) the float d_x * sum(q_x) for the min.
struct XLayout {
  int64_t width;  // bytes of a vector: 64 or 32
  bool q4_halves;  // VNNI Q4: [b0 lo, b1 lo, b0 hi, b1 hi] (16 bytes each)
  int32_t offset;  // 8 (Q4_0), 128 (Q8_0 on VNNI), 0 otherwise
  bool float_aux;  // Q4_1
  int64_t blocks_per_group() const { return width / kBlock; }
  int64_t record_bytes() const { return 3 * width; }
};

KVMESH_AVX2 void quantize_rows(const float* x, int64_t num_rows, int64_t K, const XLayout& layout,
                               uint8_t* records) {
  const int64_t num_blocks = K / kBlock, per_group = layout.blocks_per_group();
  const int64_t num_groups = (num_blocks + per_group - 1) / per_group;
  const int64_t width = layout.width;
  std::memset(records, 0, num_rows * num_groups * layout.record_bytes());
  for (int64_t m = 0; m < num_rows; ++m) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const XBlock xb = quantize_block(x + m * K + b * kBlock);
      const int64_t g = b / per_group, j = b % per_group;
      uint8_t* rec = records + (m * num_groups + g) * layout.record_bytes();
      float* d = reinterpret_cast<float*>(rec + width);
      uint8_t* aux = rec + 2 * width;
      // Where the block's two 16-byte halves go.
      const int64_t half_at[2] = {layout.q4_halves ? j * 16 : j * kBlock,
                                  layout.q4_halves ? (2 + j) * 16 : j * kBlock + 16};
      for (int h = 0; h < 2; ++h) {
        std::memcpy(rec + half_at[h], xb.q + 16 * h, 16);
        for (int64_t lane = half_at[h] / 4; lane < (half_at[h] + 16) / 4; ++lane) d[lane] = xb.d;
      }
      if (layout.float_aux) {
        const float v = xb.d * static_cast<float>(xb.sum);
        std::memcpy(aux + half_at[0], &v, 4);
      } else {
        const int32_t v = -layout.offset * xb.sum;
        std::memcpy(aux + half_at[0], &v, 4);
      }
    }
  }
}

// ---- AVX512-VNNI: two blocks per vector ----

// The float16 at p (and at p1 where kPair) to float32 lanes, p1's on the lanes of `second`.
template <__mmask16 kSecond, bool kPair>
KVMESH_VNNI inline __m512 half_pattern(const uint8_t* p, const uint8_t* p1) {
  const short h0 = static_cast<short>(load_u16(p));
  const short h1 = kPair ? static_cast<short>(load_u16(p1)) : 0;
  return _mm512_cvtph_ps(
      _mm256_mask_blend_epi16(kSecond, _mm256_set1_epi16(h0), _mm256_set1_epi16(h1)));
}

// Weights of one group (blocks 2g and 2g + 1 of a row; the second absent at an odd
// row's end): unsigned quants, d_w and m_w per int32 lane.
template <int64_t QT, bool kPair>
KVMESH_VNNI inline void load_group_vnni(const uint8_t* row, int64_t g, __m512i& w, __m512& dw,
                                        __m512& mw) {
  using F = Format<QT>;
  const uint8_t* p = row + 2 * g * F::kBytes;
  const uint8_t* p1 = p + F::kBytes;
  if constexpr (QT == kQ8_0) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + F::kQs));
    const __m256i b = kPair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + F::kQs))
                            : _mm256_setzero_si256();
    w = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1),
                         _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + F::kQs));
    const __m128i b = kPair ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + F::kQs))
                            : _mm_setzero_si128();
    const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
    w = _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1),
        _mm512_set1_epi8(0x0F));
  }
  // Lanes of block 2g + 1: Q4 [4..7] and [12..15], Q8_0 [8..15].
  constexpr __mmask16 kSecond = QT == kQ8_0 ? 0xFF00 : 0xF0F0;
  dw = half_pattern<kSecond, kPair>(p, p1);
  if constexpr (QT == kQ4_1) mw = half_pattern<kSecond, kPair>(p + 2, p1 + 2);
}

// acc[m][r] += the group's products for MB activation rows and R weight rows.
template <int64_t QT, int64_t MB, int64_t R, bool kPair>
KVMESH_VNNI inline void group_vnni(const uint8_t* const* rows, int64_t g, const uint8_t* x,
                                   int64_t x_stride, __m512 (&acc)[MB][R]) {
  __m512i w[R];
  __m512 dw[R], mw[R];
  for (int64_t r = 0; r < R; ++r) load_group_vnni<QT, kPair>(rows[r], g, w[r], dw[r], mw[r]);
  for (int64_t m = 0; m < MB; ++m) {
    const uint8_t* rec = x + m * x_stride;
    const __m512i xq = _mm512_loadu_si512(rec);
    const __m512 dx = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + 64));
    const __m512i aux = _mm512_loadu_si512(rec + 128);
    for (int64_t r = 0; r < R; ++r) {
      if constexpr (QT == kQ4_1) {
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], xq);
        acc[m][r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dx), dw[r], acc[m][r]);
        acc[m][r] = _mm512_fmadd_ps(_mm512_castsi512_ps(aux), mw[r], acc[m][r]);
      } else {
        const __m512i s = _mm512_dpbusd_epi32(aux, w[r], xq);
        acc[m][r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), dx), dw[r], acc[m][r]);
      }
    }
  }
}

template <int64_t QT, int64_t MB, int64_t R>
KVMESH_VNNI void dot_rows_vnni(const uint8_t* const* rows, int64_t num_blocks, const uint8_t* x,
                               int64_t x_stride, float* out, int64_t out_stride) {
  __m512 acc[MB][R];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t num_pairs = num_blocks / 2;
  for (int64_t g = 0; g < num_pairs; ++g) {
    group_vnni<QT, MB, R, true>(rows, g, x + g * 192, x_stride, acc);
  }
  if (num_blocks % 2) {
    group_vnni<QT, MB, R, false>(rows, num_pairs, x + num_pairs * 192, x_stride, acc);
  }
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t r = 0; r < R; ++r) out[m * out_stride + r] = _mm512_reduce_add_ps(acc[m][r]);
}

// ---- AVX2: a block per vector ----

template <int64_t QT, int64_t MB, int64_t R>
KVMESH_AVX2 void dot_rows_avx2(const uint8_t* const* rows, int64_t num_blocks, const uint8_t* x,
                               int64_t x_stride, float* out, int64_t out_stride) {
  using F = Format<QT>;
  __m256 acc[MB][R];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m256i w[R];
    __m256 dw[R], mw[R];
    for (int64_t r = 0; r < R; ++r) {
      const uint8_t* p = rows[r] + b * F::kBytes;
      if constexpr (QT == kQ8_0) {
        w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + F::kQs));
      } else {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + F::kQs));
        w[r] = _mm256_and_si256(
            _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1),
            _mm256_set1_epi8(0x0F));
      }
      dw[r] = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(load_u16(p))));
      if constexpr (QT == kQ4_1) {
        mw[r] = _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(load_u16(p + 2))));
      }
    }
    for (int64_t m = 0; m < MB; ++m) {
      const uint8_t* rec = x + m * x_stride + b * 96;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec));
      const __m256 dx = _mm256_loadu_ps(reinterpret_cast<const float*>(rec + 32));
      const __m256i aux = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64));
      for (int64_t r = 0; r < R; ++r) {
        __m256i s;
        if constexpr (QT == kQ8_0) {  // |w| x (x with w's sign): at most 2 * 128 * 127
          s = _mm256_madd_epi16(
              _mm256_maddubs_epi16(_mm256_sign_epi8(w[r], w[r]), _mm256_sign_epi8(xq, w[r])),
              ones);
        } else {
          s = _mm256_madd_epi16(_mm256_maddubs_epi16(w[r], xq), ones);
        }
        if constexpr (QT == kQ4_0) s = _mm256_add_epi32(s, aux);
        acc[m][r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), dx), dw[r], acc[m][r]);
        if constexpr (QT == kQ4_1) {
          acc[m][r] = _mm256_fmadd_ps(_mm256_castsi256_ps(aux), mw[r], acc[m][r]);
        }
      }
    }
  }
  for (int64_t m = 0; m < MB; ++m) {
    for (int64_t r = 0; r < R; ++r) {
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m][r]), _mm256_extractf128_ps(acc[m][r], 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      out[m * out_stride + r] = _mm_cvtss_f32(s);
    }
  }
}

// ---- driver ----

using DotRows = void (*)(const uint8_t* const*, int64_t, const uint8_t*, int64_t, float*, int64_t);

// Kernels for (activation rows 1..kMaxXRows) x (kRows weight rows, or one).
struct Kernels {
  DotRows group[kMaxXRows];
  DotRows single[kMaxXRows];
};

template <int64_t QT, bool kVnni, int64_t R>
constexpr DotRows dot_rows(int64_t mb) {
  if constexpr (kVnni) {
    return mb == 1 ? dot_rows_vnni<QT, 1, R> : mb == 2 ? dot_rows_vnni<QT, 2, R>
         : mb == 3 ? dot_rows_vnni<QT, 3, R> : dot_rows_vnni<QT, 4, R>;
  } else {
    return mb == 1 ? dot_rows_avx2<QT, 1, R> : mb == 2 ? dot_rows_avx2<QT, 2, R>
         : mb == 3 ? dot_rows_avx2<QT, 3, R> : dot_rows_avx2<QT, 4, R>;
  }
}

template <int64_t QT, bool kVnni>
Kernels kernels_for() {
  Kernels k;
  for (int64_t mb = 1; mb <= kMaxXRows; ++mb) {
    k.group[mb - 1] = dot_rows<QT, kVnni, kRows>(mb);
    k.single[mb - 1] = dot_rows<QT, kVnni, 1>(mb);
  }
  return k;
}

bool cpu_has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
}

XLayout layout_for(int64_t quant_type, bool vnni) {
  XLayout layout;
  layout.width = vnni ? 64 : 32;
  layout.q4_halves = vnni && quant_type != kQ8_0;
  layout.offset = quant_type == kQ4_0 ? 8 : (quant_type == kQ8_0 && vnni ? 128 : 0);
  layout.float_aux = quant_type == kQ4_1;
  return layout;
}

template <typename scalar_t>
void gguf_linear_kernel(const at::Tensor& x, const at::Tensor& qweight, int64_t quant_type,
                        bool vnni, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const int64_t num_blocks = K / kBlock, row_bytes = qweight.size(1);
  const XLayout layout = layout_for(quant_type, vnni);
  const int64_t per_group = layout.blocks_per_group();
  const int64_t num_groups = (num_blocks + per_group - 1) / per_group;
  const int64_t x_stride = num_groups * layout.record_bytes();
  const at::Tensor x_float = x.to(at::kFloat).contiguous();
  at::Tensor records = at::empty({M * x_stride}, x.options().dtype(at::kByte));
  quantize_rows(x_float.data_ptr<float>(), M, K, layout, records.data_ptr<uint8_t>());

  Kernels k;
  switch (quant_type * 2 + vnni) {
    case kQ4_0 * 2: k = kernels_for<kQ4_0, false>(); break;
    case kQ4_0 * 2 + 1: k = kernels_for<kQ4_0, true>(); break;
    case kQ4_1 * 2: k = kernels_for<kQ4_1, false>(); break;
    case kQ4_1 * 2 + 1: k = kernels_for<kQ4_1, true>(); break;
    case kQ8_0 * 2: k = kernels_for<kQ8_0, false>(); break;
    default: k = kernels_for<kQ8_0, true>(); break;
  }
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const uint8_t* xr = records.data_ptr<uint8_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  kvmesh::for_each_row_group<kRows>(N, w, row_bytes, [&](int64_t n0, int64_t num_rows) {
    float dots[kMaxXRows * kRows];
    const uint8_t* rows[kRows];
    for (int64_t r = 0; r < kRows; ++r) rows[r] = w + (n0 + std::min(r, num_rows - 1)) * row_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxXRows) {  // the group's weights stay in L1
      const int64_t mb = std::min(kMaxXRows, M - m0);
      if (num_rows == kRows) {
        k.group[mb - 1](rows, num_blocks, xr + m0 * x_stride, x_stride, dots, kRows);
      } else {
        for (int64_t r = 0; r < num_rows; ++r) {
          k.single[mb - 1](rows + r, num_blocks, xr + m0 * x_stride, x_stride, dots + r, kRows);
        }
      }
      for (int64_t m = 0; m < mb; ++m) {
        for (int64_t r = 0; r < num_rows; ++r) {
          o[(m0 + m) * N + n0 + r] = static_cast<scalar_t>(dots[m * kRows + r]);
        }
      }
    }
  });
}

// ---- AVX2 on rows packed by eight (kernels/gguf_linear_cpu.py: pack_rows) ----
//
// Packed at load, a group of 8 weight rows stores each block b as the 8 rows'
// float16 d (then, for Q4_1, their 8 m), then the rows' quants in 4-byte chunks:
// chunk j of row 0, of row 1, ... of row 7, then chunk j + 1. One 256-bit load is
// then chunk j of all 8 rows, and a broadcast of the activation's chunk j
// multiplies into it so that every row's products land on that row's own int32
// lane: no horizontal sums, and each scale is one vector for 8 rows. The Q4 products
// (nibble x int8, at most 2 * 15 * 127 per int16 lane) of a whole block sum in
// int16 without overflow (8 * 3810 < 32767); Q8_0 widens each chunk to int32.

constexpr int64_t kPackRows = 8;

// One activation row's blocks: q_x in order, d_x, and aux (Q4_0: -8 * sum(q_x) as
// int32; Q4_1: d_x * sum(q_x) as float; Q8_0: -128 * sum(q_x), used by VNNI only).
struct PackedX {
  const int8_t* q;
  const float* d;
  const int32_t* aux;
};

KVMESH_AVX2 inline __m256i broadcast_chunk(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// The 8 rows' integer dot products with one activation block, one per int32 lane.
template <int64_t QT>
KVMESH_AVX2 inline __m256i block_dots_packed(const __m256i* w, const int8_t* xq) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (QT == kQ8_0) {
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {  // |w| x (x with w's sign): at most 2 * 128 * 127
      const __m256i x = broadcast_chunk(xq + 4 * j);
      s = _mm256_add_epi32(s, _mm256_madd_epi16(
          _mm256_maddubs_epi16(_mm256_sign_epi8(w[j], w[j]), _mm256_sign_epi8(x, w[j])), ones));
    }
    return s;
  } else {  // w[j]: chunk j's low nibbles (quants 4j..4j+3); w[4 + j]: its high (16 + 4j..)
    __m256i s16 = _mm256_maddubs_epi16(w[0], broadcast_chunk(xq));
    for (int j = 1; j < 8; ++j) {
      const int64_t at = j < 4 ? 4 * j : 16 + 4 * (j - 4);
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], broadcast_chunk(xq + at)));
    }
    return _mm256_madd_epi16(s16, ones);
  }
}

// A packed block's scales of its 8 rows as float32 lanes: d_w, and (Q4_1) m_w.
template <int64_t QT>
KVMESH_AVX2 inline void load_scales_packed(const uint8_t* blk, __m256& dw, __m256& mw) {
  dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
  mw = _mm256_setzero_ps();
  if constexpr (QT == kQ4_1) {
    mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
  }
}

// acc (lane r: weight row r) + block b's integer sums `s` for activation row x,
// scaled by d_w * d_x, and (Q4_1) the min term m_w * d_x * sum(q_x).
template <int64_t QT>
KVMESH_AVX2 inline __m256 add_block_packed(__m256 acc, __m256i s, __m256 dw, __m256 mw,
                                           const PackedX& x, int64_t b) {
  const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[b]));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
  if constexpr (QT == kQ4_1) {
    float min_term;
    std::memcpy(&min_term, &x.aux[b], sizeof(min_term));
    acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(min_term), acc);
  }
  return acc;
}

// acc[m] (lane r: weight row r) += block b's products for MB activation rows;
// kAhead: each block prefetches the bytes kvmesh::kAheadBytes past it (row_groups.h).
template <int64_t QT, int64_t MB, bool kAhead>
KVMESH_AVX2 void dot_group_packed(const uint8_t* group, int64_t num_blocks, const PackedX* xs,
                                  __m256 (&acc)[MB]) {
  using F = Format<QT>;
  constexpr int64_t kScaleBytes = kPackRows * F::kQs;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* blk = group + b * kPackRows * F::kBytes;
    if constexpr (kAhead) kvmesh::prefetch_ahead(blk, kPackRows * F::kBytes);
    __m256 dw, mw;
    load_scales_packed<QT>(blk, dw, mw);
    const uint8_t* qs = blk + kScaleBytes;
    __m256i w[8];
    for (int j = 0; j < (QT == kQ8_0 ? 8 : 4); ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      if constexpr (QT == kQ8_0) {
        w[j] = v;
      } else {
        w[j] = _mm256_and_si256(v, low);
        w[4 + j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
    }
    for (int64_t m = 0; m < MB; ++m) {
      __m256i s = block_dots_packed<QT>(w, xs[m].q + b * kBlock);
      if constexpr (QT == kQ4_0) s = _mm256_add_epi32(s, _mm256_set1_epi32(xs[m].aux[b]));
      acc[m] = add_block_packed<QT>(acc[m], s, dw, mw, xs[m], b);
    }
  }
}

// ---- AVX512-VNNI on the same packed rows ----
//
// One 512-bit load is two consecutive chunks of the 8 rows (chunk j on lanes 0-7,
// j + 1 on lanes 8-15); the activation's 8 matching bytes are spread to those lanes
// (vpermd) and vpdpbusd sums each row's products on its two lanes. The halves are
// added per block, so the float arithmetic is the AVX2 kernel's, bit for bit.

// x's quants p[0..3] on lanes 0-7 and p[4..7] on lanes 8-15.
KVMESH_VNNI inline __m512i spread_pair(const int8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                  _mm512_castsi128_si512(v));
}

// A block's quants of the 8 rows as four unsigned vectors; w[v] pairs with x's
// quants 8v..8v+7. Q8_0 is shifted to unsigned (+128); aux carries the -128 * sum(q_x).
template <int64_t QT>
KVMESH_VNNI inline void load_block_vnni(const uint8_t* qs, __m512i (&w)[4]) {
  if constexpr (QT == kQ8_0) {
    for (int v = 0; v < 4; ++v) {
      w[v] = _mm512_xor_si512(_mm512_loadu_si512(qs + 64 * v),
                              _mm512_set1_epi8(static_cast<char>(0x80)));
    }
  } else {  // chunks 0-1 hold quants 0-7 (low nibbles) and 16-23 (high); 2-3 the rest
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i a = _mm512_loadu_si512(qs), b = _mm512_loadu_si512(qs + 64);
    w[0] = _mm512_and_si512(a, low);
    w[1] = _mm512_and_si512(b, low);
    w[2] = _mm512_and_si512(_mm512_srli_epi16(a, 4), low);
    w[3] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
  }
}

template <int64_t QT, int64_t MB, bool kAhead>
KVMESH_VNNI void dot_packed_vnni(const uint8_t* group, int64_t num_blocks, const PackedX* xs,
                                 float* out) {
  using F = Format<QT>;
  __m256 acc[MB];
  for (int64_t m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  constexpr int64_t kScaleBytes = kPackRows * F::kQs;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* blk = group + b * kPackRows * F::kBytes;
    if constexpr (kAhead) kvmesh::prefetch_ahead(blk, kPackRows * F::kBytes);
    __m256 dw, mw;
    load_scales_packed<QT>(blk, dw, mw);
    __m512i w[4];
    load_block_vnni<QT>(blk + kScaleBytes, w);
    for (int64_t m = 0; m < MB; ++m) {
      const int8_t* xq = xs[m].q + b * kBlock;
      // Two chains of two, so that vpdpbusd's latency overlaps.
      __m512i s0 = QT == kQ4_1 ? _mm512_setzero_si512()
                               : _mm512_maskz_set1_epi32(0x00FF, xs[m].aux[b]);
      __m512i s1 = _mm512_setzero_si512();
      s0 = _mm512_dpbusd_epi32(s0, w[0], spread_pair(xq));
      s1 = _mm512_dpbusd_epi32(s1, w[1], spread_pair(xq + 8));
      s0 = _mm512_dpbusd_epi32(s0, w[2], spread_pair(xq + 16));
      s1 = _mm512_dpbusd_epi32(s1, w[3], spread_pair(xq + 24));
      const __m512i s2 = _mm512_add_epi32(s0, s1);
      const __m256i s = _mm256_add_epi32(_mm512_castsi512_si256(s2),
                                         _mm512_extracti64x4_epi64(s2, 1));
      acc[m] = add_block_packed<QT>(acc[m], s, dw, mw, xs[m], b);
    }
  }
  for (int64_t m = 0; m < MB; ++m) _mm256_storeu_ps(out + m * kPackRows, acc[m]);
}

template <int64_t QT, int64_t MB, bool kAhead>
KVMESH_AVX2 void dot_packed(const uint8_t* group, int64_t num_blocks, const PackedX* xs,
                            float* out) {
  __m256 acc[MB];
  for (int64_t m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  dot_group_packed<QT, MB, kAhead>(group, num_blocks, xs, acc);
  for (int64_t m = 0; m < MB; ++m) _mm256_storeu_ps(out + m * kPackRows, acc[m]);
}

using DotPacked = void (*)(const uint8_t*, int64_t, const PackedX*, float*);

// The kernel for mb activation rows; `ahead` (one row only): prefetching ahead of its
// reads, the process's mode (kvmesh::prefetch_ahead_mode()).
template <int64_t QT, bool kVnni>
DotPacked dot_packed_for(int64_t mb, bool ahead) {
  if constexpr (kVnni) {
    return mb == 1 ? (ahead ? dot_packed_vnni<QT, 1, true> : dot_packed_vnni<QT, 1, false>)
         : mb == 2 ? dot_packed_vnni<QT, 2, false>
         : mb == 3 ? dot_packed_vnni<QT, 3, false> : dot_packed_vnni<QT, 4, false>;
  } else {
    return mb == 1 ? (ahead ? dot_packed<QT, 1, true> : dot_packed<QT, 1, false>)
         : mb == 2 ? dot_packed<QT, 2, false>
         : mb == 3 ? dot_packed<QT, 3, false> : dot_packed<QT, 4, false>;
  }
}

template <bool kVnni>
DotPacked dot_packed_for(int64_t quant_type, int64_t mb, bool ahead) {
  return quant_type == kQ4_0 ? dot_packed_for<kQ4_0, kVnni>(mb, ahead)
       : quant_type == kQ4_1 ? dot_packed_for<kQ4_1, kVnni>(mb, ahead)
                             : dot_packed_for<kQ8_0, kVnni>(mb, ahead);
}

// Activation rows quantized per block, in order: int8 [M, K], d [M, K / 32], aux
// (Q4_0: -8 * sum(q_x); Q8_0: -128 * sum(q_x), for VNNI's unsigned weights).
KVMESH_AVX2 void quantize_rows_packed(const float* x, int64_t M, int64_t K, int64_t quant_type,
                                      int8_t* q, float* d, int32_t* aux) {
  const int64_t num_blocks = K / kBlock;
  for (int64_t i = 0; i < M * num_blocks; ++i) {
    const XBlock xb = quantize_block(x + i * kBlock);
    std::memcpy(q + i * kBlock, xb.q, kBlock);
    d[i] = xb.d;
    if (quant_type == kQ4_1) {
      const float v = xb.d * static_cast<float>(xb.sum);
      std::memcpy(aux + i, &v, sizeof(v));
    } else {
      aux[i] = (quant_type == kQ4_0 ? -8 : -128) * xb.sum;
    }
  }
}

template <typename scalar_t>
void gguf_linear_packed_kernel(const at::Tensor& x, const at::Tensor& packed, int64_t quant_type,
                               bool vnni, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  const int64_t num_blocks = K / kBlock, row_bytes = packed.size(1);
  const at::Tensor x_float = x.to(at::kFloat).contiguous();
  // One allocation (a one-row call is ~30 us): q_x [M, K], then d_x and aux [M, K / 32].
  at::Tensor scratch = at::empty({M * K + 8 * M * num_blocks}, x.options().dtype(at::kByte));
  int8_t* q = reinterpret_cast<int8_t*>(scratch.data_ptr<uint8_t>());
  float* d = reinterpret_cast<float*>(q + M * K);  // K is a multiple of 32: aligned
  int32_t* aux = reinterpret_cast<int32_t*>(d + M * num_blocks);
  quantize_rows_packed(x_float.data_ptr<float>(), M, K, quant_type, q, d, aux);
  DotPacked kernels[kMaxXRows];
  const bool ahead = kvmesh::prefetch_ahead_mode();
  for (int64_t mb = 1; mb <= kMaxXRows; ++mb) {
    kernels[mb - 1] = vnni ? dot_packed_for<true>(quant_type, mb, ahead)
                           : dot_packed_for<false>(quant_type, mb, ahead);
  }
  const uint8_t* w = packed.data_ptr<uint8_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  kvmesh::for_each_row_group<kPackRows>(N, w, row_bytes, [&](int64_t n0, int64_t) {
    float dots[kMaxXRows * kPackRows];
    PackedX xs[kMaxXRows];
    for (int64_t m0 = 0; m0 < M; m0 += kMaxXRows) {  // the group's weights stay in L1
      const int64_t mb = std::min(kMaxXRows, M - m0);
      for (int64_t m = 0; m < mb; ++m) {
        const int64_t row = m0 + m;
        xs[m] = {q + row * K, d + row * num_blocks, aux + row * num_blocks};
      }
      kernels[mb - 1](w + n0 * row_bytes, num_blocks, xs, dots);
      for (int64_t m = 0; m < mb; ++m) {
        for (int64_t r = 0; r < kPackRows; ++r) {
          o[(m0 + m) * N + n0 + r] = static_cast<scalar_t>(dots[m * kPackRows + r]);
        }
      }
    }
  });
}

void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a contiguous float32 or bfloat16 [M, K], got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) % kBlock == 0, op, ": x's K=", x.size(1), " must be a multiple of ",
              kBlock);
}

// The weight for activations of K columns: its dtype, bytes per row and (packed) rows.
void check_weight(const char* op, const at::Tensor& qweight, int64_t quant_type, bool packed,
                  int64_t K) {
  const int64_t bytes = block_bytes(quant_type);
  TORCH_CHECK(bytes != 0, op, ": quant_type must be 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0), got ",
              quant_type);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kByte,
              op, ": qweight must be a contiguous uint8 [N, K / 32 * block_bytes], got ",
              qweight.scalar_type(), " ", qweight.sizes());
  TORCH_CHECK(qweight.size(1) == K / kBlock * bytes, op, ": qweight has ", qweight.size(1),
              " bytes per row; K=", K, " needs ", K / kBlock * bytes, " for quant_type ",
              quant_type);
  TORCH_CHECK(!packed || qweight.size(0) % kPackRows == 0, op, ": packed has ", qweight.size(0),
              " rows; it must be a multiple of ", kPackRows);
}

// out [M, N] = x @ W.T on either layout and path, after the checks; M, N, K > 0.
void run(const at::Tensor& x, const at::Tensor& qweight, int64_t quant_type, bool packed,
         bool vnni, at::Tensor& out) {
  if (x.scalar_type() == at::kBFloat16) {
    packed ? gguf_linear_packed_kernel<at::BFloat16>(x, qweight, quant_type, vnni, out)
           : gguf_linear_kernel<at::BFloat16>(x, qweight, quant_type, vnni, out);
  } else {
    packed ? gguf_linear_packed_kernel<float>(x, qweight, quant_type, vnni, out)
           : gguf_linear_kernel<float>(x, qweight, quant_type, vnni, out);
  }
}

at::Tensor gguf_linear_op(const char* op, const at::Tensor& x, const at::Tensor& qweight,
                          int64_t quant_type, bool packed, bool use_vnni) {
  check_x(op, x);
  check_weight(op, qweight, quant_type, packed, x.size(1));
  auto out = at::empty({x.size(0), qweight.size(0)}, x.options());
  if (x.size(0) == 0 || qweight.size(0) == 0) return out;
  if (x.size(1) == 0) return out.zero_();
  run(x, qweight, quant_type, packed, use_vnni && cpu_has_vnni(), out);
  return out;
}

at::Tensor gguf_linear_packed_cpu(const at::Tensor& x, const at::Tensor& packed,
                                  int64_t quant_type, bool use_vnni) {
  return gguf_linear_op("gguf_linear_packed_cpu", x, packed, quant_type, true, use_vnni);
}

at::Tensor gguf_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, int64_t quant_type,
                           bool use_vnni) {
  return gguf_linear_op("gguf_linear_cpu", x, qweight, quant_type, false, use_vnni);
}

}  // namespace

namespace kvmesh {

void check_gguf_weight(const at::Tensor& qweight, int64_t quant_type, bool packed, int64_t K) {
  check_weight(packed ? "gguf_linear_packed_cpu" : "gguf_linear_cpu", qweight, quant_type, packed,
               K);
}

void gguf_linear_out(const at::Tensor& x, const at::Tensor& qweight, int64_t quant_type,
                     bool packed, at::Tensor& out) {
  run(x, qweight, quant_type, packed, cpu_has_vnni(), out);
}

}  // namespace kvmesh

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  // use_vnni=False forces the AVX2 path (tests, benchmarks).
  m.def("gguf_linear_cpu(Tensor x, Tensor qweight, int quant_type, bool use_vnni=True) -> Tensor");
  m.def("gguf_linear_packed_cpu(Tensor x, Tensor packed, int quant_type, bool use_vnni=True) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("gguf_linear_cpu", &gguf_linear_cpu);
  m.impl("gguf_linear_packed_cpu", &gguf_linear_packed_cpu);
}
#endif  // CPU_CAPABILITY_AVX512 || CPU_CAPABILITY_AVX2
