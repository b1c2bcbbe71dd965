// kvmesh::int8_dynamic_linear_cpu: x @ (qweight * scales[:, None]).T with int8 weights
// and int8 activations quantized per token at every call (dynamic int8 x int8, as
// llama.cpp's Q8 dot products), so the product is integer arithmetic throughout.
//
// Per row m of x: s_x = absmax(x[m]) / 127, q_x = round(x[m] * (127 / absmax)) half to
// even, in [-127, 127] (kernels/int8_dynamic_linear_cpu.py has the reference, which
// computes the same bits). Then
//     out[m, n] = float(sum_k q_x[m, k] * qweight[n, k]) * s_x * scales[n]
// with the sum exact in int32 over the whole row (K <= kMaxK), in x's dtype. A row
// with a NaN or an infinity gets s_x = NaN (its outputs only are NaN); an all-zero row
// gets zeros.
//
// Weight-only int8 (int8_linear_cpu.cpp) converts every weight to float: from a few
// rows on, that conversion, not memory, bounds it. Here a weight vector is used as
// it is stored. Two paths, chosen per call at run time:
//   * AVX512-VNNI: vpdpbusd multiplies unsigned by signed bytes, so activations are
//     stored as q_x + 128 (uint8) and the shift is taken back exactly with the
//     caller's weight_sums: sum (q_x + 128) * w - 128 * sum w.
//   * AVX2 (every x86-64 the library is built for): activations widened to int16
//     once per call, weights sign-extended to int16 and multiplied with vpmaddwd
//     (pairs of products of at most 128 * 127: no saturation, which vpmaddubsw's
//     int16 pair sums would hit with 255 * 127). weight_sums is not needed there.
// Each thread streams a contiguous range of weight rows, four at a time while the
// next four are prefetched, and multiplies up to four activation rows into each
// weight vector it loads. Or, on the AVX2 path with one activation row where the
// process's mode says so (row_groups.h: "ahead"), it reads its rows one after
// another, prefetching a fixed distance ahead: on a Zen 3 a one-stream w8a8 engine
// step ran 1.06x (bfloat16) and 1.22x (float32) faster than with the whole group.
//
// From kGemmMinRows activation rows on (a batch of decodes), the VNNI path turns
// the product around: each vpdpbusd takes 16 activation rows (repacked once per
// call so that a vector holds 4 consecutive k of 16 rows) against 4 bytes of one
// weight row broadcast, so every lane is one output and no sum is reduced across
// a vector. Its int32 sums and the float operations after them are the same as
// the row path's, so the output is the same bits.
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
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#define KVMESH_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVMESH_VNNI \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

namespace {

constexpr int64_t kKMultiple = 64;  // bytes of a 512-bit vector: K is whole vectors
// The VNNI path's unsigned sum, at most 255 * 128 per element, stays within int32.
constexpr int64_t kMaxK = std::numeric_limits<int32_t>::max() / (255 * 128);
constexpr int64_t kRows = 4;  // weight rows per group (a thread's unit of work)
constexpr int64_t kMaxXRows = 4;  // activation rows per pass over a group
constexpr int32_t kVnniOffset = 128;  // the unsigned shift of the VNNI path's activations
constexpr int64_t kGemmMinRows = 16;  // activation rows from which VNNI takes the GEMM path
constexpr int64_t kLanes = 16;  // int32 lanes of a 512-bit vector: activation rows per vector
constexpr int64_t kGemmVecs = 2;  // activation vectors (32 rows) per pass over a block
constexpr int64_t kGemmRows = 6;  // weight rows per group of the GEMM path
constexpr int64_t kGemmBlockRows = 96;  // weight rows per block (16 groups): a unit of work
// A pass over one vector of rows takes twice the weight rows into the same dots.
static_assert(kGemmVecs >= 2 && kGemmBlockRows % (2 * kGemmRows) == 0);
// A row whose largest magnitude is below this counts as zero (127 / absmax would
// overflow float32 for subnormals); the reference uses the same bound.
constexpr float kMinAbsMax = 1e-30f;

// ---- activations: int8 per row, stored as uint8 (VNNI) or int16 (AVX2) ----

template <typename scalar_t>
KVMESH_AVX2 inline __m256 load8(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm256_loadu_ps(p);
  } else {  // bfloat16 is float32's upper half
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

KVMESH_AVX2 inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Quantizes row `x` (length K, a multiple of 64) into `q_u8` (q + 128) or `q_i16` (q),
// whichever is not null; returns s_x (NaN for a row with a NaN or an infinity).
template <typename scalar_t>
KVMESH_AVX2 float quantize_row(const scalar_t* x, int64_t K, uint8_t* q_u8, int16_t* q_i16) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 a = _mm256_andnot_ps(sign, load8(x + k));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // NaN or inf
    amax = _mm256_max_ps(amax, a);
  }
  const float absmax = hmax(amax);
  const bool is_bad = _mm256_movemask_ps(bad) != 0;
  if (is_bad || !(absmax >= kMinAbsMax)) {  // all products zero; s_x makes them NaN
    if (q_u8) std::memset(q_u8, kVnniOffset, K);
    if (q_i16) std::memset(q_i16, 0, K * sizeof(int16_t));
    return is_bad ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
  }
  // A true division (not x * reciprocal) for both, as the reference computes them.
  const __m256 inv = _mm256_set1_ps(127.0f / absmax);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t k = 0; k < K; k += 32) {
    __m256i q[4];  // the current rounding mode: to nearest, ties to even
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + k + 8 * i), inv));
    // packs work within 128-bit lanes: the permutes restore element order.
    const __m256i q01 = _mm256_packs_epi32(q[0], q[1]), q23 = _mm256_packs_epi32(q[2], q[3]);
    if (q_u8) {
      const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q01, q23), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q_u8 + k),
                          _mm256_xor_si256(q8, _mm256_set1_epi8(static_cast<char>(0x80))));
    }
    if (q_i16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q_i16 + k),
                          _mm256_permute4x64_epi64(q01, 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q_i16 + k + 16),
                          _mm256_permute4x64_epi64(q23, 0xD8));
    }
  }
  return absmax / 127.0f;
}

// ---- integer dot products of MB activation rows with R consecutive weight rows ----
// dots[m * kRows + r] = sum_k xq[m * K + k] * w[r * K + k] (VNNI: xq shifted by +128).

template <int64_t MB, int64_t R>
KVMESH_VNNI void dots_vnni(const int8_t* w, const uint8_t* xq, int64_t K, int32_t* dots) {
  __m512i acc[MB][R];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    __m512i wv[R];
    for (int64_t r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(w + r * K + k);
    for (int64_t m = 0; m < MB; ++m) {
      const __m512i xv = _mm512_loadu_si512(xq + m * K + k);
      for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], xv, wv[r]);
    }
  }
  for (int64_t m = 0; m < MB; ++m) {
    if constexpr (R == 4) {  // four sums at once: a third of four separate reductions
      const __m512i* a = acc[m];
      const __m512i a01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]),
                                           _mm512_unpackhi_epi32(a[0], a[1]));
      const __m512i a23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]),
                                           _mm512_unpackhi_epi32(a[2], a[3]));
      // Each 128-bit lane now holds partial sums of rows 0..3, in order.
      const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(a01, a23),
                                         _mm512_unpackhi_epi64(a01, a23));
      const __m256i h =
          _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dots + m * kRows),
                       _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
    } else {
      for (int64_t r = 0; r < R; ++r) dots[m * kRows + r] = _mm512_reduce_add_epi32(acc[m][r]);
    }
  }
}

// The sum of v's eight int32 lanes.
KVMESH_AVX2 inline int32_t sum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// Two weight rows at a time: 16 ymm registers hold 4 x 2 accumulators and operands.
template <int64_t MB, int64_t R>
KVMESH_AVX2 void dots_avx2(const int8_t* w, const int16_t* xq, int64_t K, int32_t* dots) {
  __m256i acc[MB][R];
  for (int64_t m = 0; m < MB; ++m)
    for (int64_t r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 16) {
    __m256i wv[R];
    for (int64_t r = 0; r < R; ++r) {
      const auto* p = reinterpret_cast<const __m128i*>(w + r * K + k);
      wv[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128(p));
    }
    for (int64_t m = 0; m < MB; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + k));
      for (int64_t r = 0; r < R; ++r) {
        acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(xv, wv[r]));
      }
    }
  }
  for (int64_t m = 0; m < MB; ++m) {
    for (int64_t r = 0; r < R; ++r) dots[m * kRows + r] = sum_epi32(acc[m][r]);
  }
}

// One activation row and one weight row, read in order with four accumulators, each
// step prefetching the bytes kvmesh::kAheadBytes past it (RowGroupPrefetch::kAhead):
// a group's rows one after another are one sequential stream per thread, as
// bf16_linear_cpu.cpp's Widen::dot_row reads them (past a row's end lie the next
// row's first bytes). Integer sums: the same bits as dots_avx2<1, 1>.
KVMESH_AVX2 int32_t dot_row_avx2_ahead(const int8_t* w, const int16_t* xq, int64_t K) {
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                    _mm256_setzero_si256()};
  for (int64_t k = 0; k < K; k += 64) {  // K is a multiple of 64
    kvmesh::prefetch_ahead(w + k, 64);
    for (int64_t j = 0; j < 4; ++j) {
      const __m256i wv = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16 * j)));
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k + 16 * j));
      acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(xv, wv));
    }
  }
  return sum_epi32(_mm256_add_epi32(_mm256_add_epi32(acc[0], acc[1]),
                                    _mm256_add_epi32(acc[2], acc[3])));
}

// The dots of mb (1..kMaxXRows) activation rows and num_rows (1..kRows) weight rows;
// `ahead`: the AVX2 path's one-row loop prefetches ahead of its reads
// (kvmesh::prefetch_ahead_mode()).
template <int64_t MB>
void group_dots(bool vnni, bool ahead, const int8_t* w, int64_t num_rows, const void* xq,
                int64_t K, int32_t* dots) {
  if (vnni) {
    const auto* x = static_cast<const uint8_t*>(xq);
    if (num_rows == kRows) return dots_vnni<MB, kRows>(w, x, K, dots);
    for (int64_t r = 0; r < num_rows; ++r) dots_vnni<MB, 1>(w + r * K, x, K, dots + r);
  } else if (MB == 1 && ahead) {
    const auto* x = static_cast<const int16_t*>(xq);
    for (int64_t r = 0; r < num_rows; ++r) dots[r] = dot_row_avx2_ahead(w + r * K, x, K);
  } else {
    const auto* x = static_cast<const int16_t*>(xq);
    int64_t r = 0;
    for (; r + 2 <= num_rows; r += 2) dots_avx2<MB, 2>(w + r * K, x, K, dots + r);
    if (r < num_rows) dots_avx2<MB, 1>(w + r * K, x, K, dots + r);
  }
}

void group_dots(int64_t mb, bool vnni, bool ahead, const int8_t* w, int64_t num_rows,
                const void* xq, int64_t K, int32_t* dots) {
  switch (mb) {
    case 1: return group_dots<1>(vnni, ahead, w, num_rows, xq, K, dots);
    case 2: return group_dots<2>(vnni, ahead, w, num_rows, xq, K, dots);
    case 3: return group_dots<3>(vnni, ahead, w, num_rows, xq, K, dots);
    default: return group_dots<4>(vnni, ahead, w, num_rows, xq, K, dots);
  }
}

// ---- many activation rows (VNNI): activation rows in the lanes, weights broadcast ----

// xq's M rows (K bytes each) as blocks of 16 rows: block b's step j (64 bytes) holds
// bytes 4j..4j+3 of its rows in row order, at xp + (b * K / 4 + j) * 64. Rows past M
// hold the VNNI zero (128) and their outputs are never stored.
void pack_rows(const uint8_t* xq, int64_t M, int64_t K, uint8_t* xp) {
  const int64_t blocks = (M + kLanes - 1) / kLanes, steps = K / 4;
  std::memset(xp + M * K, kVnniOffset, (blocks * kLanes - M) * K);
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* block = xp + (m / kLanes) * kLanes * K + (m % kLanes) * 4;
    for (int64_t j = 0; j < steps; ++j) std::memcpy(block + j * 64, xq + m * K + 4 * j, 4);
  }
}

// dots[v * R + r][lane] = sum_k xq[16 v + lane, k] * w[r * K + k] for V blocks of
// packed rows at xp and R weight rows at w.
template <int64_t V, int64_t R>
KVMESH_VNNI void gemm_dots(const uint8_t* xp, int64_t K, const int8_t* w,
                           int32_t (*dots)[kLanes]) {
  __m512i acc[V][R];
  for (int64_t v = 0; v < V; ++v)
    for (int64_t r = 0; r < R; ++r) acc[v][r] = _mm512_setzero_si512();
  const int64_t steps = K / 4;
  for (int64_t j = 0; j < steps; ++j) {
    __m512i xv[V];
    for (int64_t v = 0; v < V; ++v) xv[v] = _mm512_loadu_si512(xp + (v * steps + j) * 64);
    for (int64_t r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, w + r * K + 4 * j, 4);
      const __m512i wv = _mm512_set1_epi32(quad);
      for (int64_t v = 0; v < V; ++v) acc[v][r] = _mm512_dpbusd_epi32(acc[v][r], xv[v], wv);
    }
  }
  for (int64_t v = 0; v < V; ++v)
    for (int64_t r = 0; r < R; ++r) _mm512_storeu_si512(dots[v * R + r], acc[v][r]);
}

template <int64_t R>
void gemm_dots(int64_t num_vecs, const uint8_t* xp, int64_t K, const int8_t* w,
               int32_t (*dots)[kLanes]) {
  if (num_vecs == 1) return gemm_dots<1, R>(xp, K, w, dots);
  return gemm_dots<kGemmVecs, R>(xp, K, w, dots);
}

// tile[16 v + lane][c0 + r] = float32(dot - 128 * wsum[r]) * sx[16 v + lane] * scales[r],
// as write_outputs computes each output (before its rounding to x's dtype).
KVMESH_VNNI void scale_gemm_dots(int32_t (*dots)[kLanes], int64_t num_vecs, int64_t R,
                                 const int32_t* wsum, const float* scales, const float* sx,
                                 float (*tile)[kGemmBlockRows], int64_t c0) {
  for (int64_t v = 0; v < num_vecs; ++v) {
    const __m512 sxv = _mm512_loadu_ps(sx + v * kLanes);
    for (int64_t r = 0; r < R; ++r) {
      const __m512i acc = _mm512_sub_epi32(_mm512_loadu_si512(dots[v * R + r]),
                                           _mm512_set1_epi32(kVnniOffset * wsum[r]));
      const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc), sxv),
                                     _mm512_set1_ps(scales[r]));
      float ys[kLanes];
      _mm512_storeu_ps(ys, y);
      for (int64_t i = 0; i < kLanes; ++i) tile[v * kLanes + i][c0 + r] = ys[i];
    }
  }
}

// One pass of up to 32 activation rows (packed at xp, scales at sx) over the block of
// num_rows weight rows at w: out's rows [m0, m0 + rows), columns [n0, n0 + num_rows).
// The outputs are gathered in a tile and written a row segment at a time: written a
// column at a time, as the lanes hold them, the LM head's output rows (49,152 values
// apart, so in the same cache sets) evicted one another.
template <typename scalar_t>
void gemm_pass(const uint8_t* xp, int64_t K, int64_t rows, const float* sx, const int8_t* w,
               int64_t num_rows, const int32_t* wsum, const float* scales, scalar_t* out,
               int64_t N) {
  alignas(64) float tile[kGemmVecs * kLanes][kGemmBlockRows];
  int32_t dots[kGemmVecs * kGemmRows][kLanes];
  const int64_t num_vecs = (rows + kLanes - 1) / kLanes;
  int64_t c = 0;
  // One vector of rows: twice the weight rows, for as many independent sums.
  for (; num_vecs == 1 && c + 2 * kGemmRows <= num_rows; c += 2 * kGemmRows) {
    gemm_dots<1, 2 * kGemmRows>(xp, K, w + c * K, dots);
    scale_gemm_dots(dots, 1, 2 * kGemmRows, wsum + c, scales + c, sx, tile, c);
  }
  for (; c + kGemmRows <= num_rows; c += kGemmRows) {
    gemm_dots<kGemmRows>(num_vecs, xp, K, w + c * K, dots);
    scale_gemm_dots(dots, num_vecs, kGemmRows, wsum + c, scales + c, sx, tile, c);
  }
  for (; c < num_rows; ++c) {
    gemm_dots<1>(num_vecs, xp, K, w + c * K, dots);
    scale_gemm_dots(dots, num_vecs, 1, wsum + c, scales + c, sx, tile, c);
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < num_rows; ++j) out[i * N + j] = static_cast<scalar_t>(tile[i][j]);
  }
}

// The VNNI path for M >= kGemmMinRows rows, on xq (M rows of q + 128) and sx (M values,
// padded with zeros to whole vectors). Each thread takes a contiguous range of blocks
// of kGemmBlockRows weight rows; a block is read from memory on its first pass and
// from the cache on the others.
template <typename scalar_t>
void int8_dynamic_gemm(const uint8_t* xq, const float* sx, int64_t M, int64_t K,
                       const at::Tensor& qweight, const int32_t* wsum, const float* scales,
                       scalar_t* out) {
  const int64_t N = qweight.size(0), num_blocks = (N + kGemmBlockRows - 1) / kGemmBlockRows;
  std::vector<uint8_t> packed((M + kLanes - 1) / kLanes * kLanes * K);
  pack_rows(xq, M, K, packed.data());
  const int8_t* w = qweight.data_ptr<int8_t>();
  const int64_t per_thread = (num_blocks + at::get_num_threads() - 1) / at::get_num_threads();
  at::parallel_for(0, num_blocks, per_thread, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kGemmBlockRows, num_rows = std::min(kGemmBlockRows, N - n0);
      if (b + 1 < end) {  // the next block into L2 while this one computes
        const char* next = reinterpret_cast<const char*>(w + (n0 + kGemmBlockRows) * K);
        const int64_t next_bytes = std::min(kGemmBlockRows, N - n0 - kGemmBlockRows) * K;
        for (int64_t i = 0; i < next_bytes; i += 64) _mm_prefetch(next + i, _MM_HINT_T1);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kGemmVecs * kLanes) {
        gemm_pass(packed.data() + m0 * K, K, std::min(kGemmVecs * kLanes, M - m0), sx + m0,
                  w + n0 * K, num_rows, wsum + n0, scales + n0, out + m0 * N + n0, N);
      }
    }
  });
}

// ---- driver ----

bool cpu_has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
}

// out[r] = float32(dots[r] - offset * wsum[r]) * sx * scales[r] for r < num_rows, exact
// in int32: |dots| <= 255 * 128 * K and |offset * wsum| <= 128 * 128 * K.
template <typename scalar_t>
inline void write_outputs(const int32_t* dots, int64_t num_rows, int32_t offset,
                          const int32_t* wsum, const float* scales, float sx, scalar_t* out) {
  if (num_rows == kRows) {  // the same operations on four lanes
    const __m128i shift = _mm_mullo_epi32(
        _mm_set1_epi32(offset), _mm_loadu_si128(reinterpret_cast<const __m128i*>(wsum)));
    const __m128i acc =
        _mm_sub_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dots)), shift);
    const __m128 y = _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(acc), _mm_set1_ps(sx)),
                                _mm_loadu_ps(scales));
    if constexpr (std::is_same_v<scalar_t, float>) {
      _mm_storeu_ps(out, y);
    } else {
      float ys[kRows];
      _mm_storeu_ps(ys, y);
      for (int64_t r = 0; r < kRows; ++r) out[r] = static_cast<scalar_t>(ys[r]);
    }
    return;
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    const int32_t acc = dots[r] - offset * wsum[r];
    out[r] = static_cast<scalar_t>(static_cast<float>(acc) * sx * scales[r]);
  }
}

template <typename scalar_t>
void int8_dynamic_linear_kernel(const at::Tensor& x, const at::Tensor& qweight,
                                const at::Tensor& scales, const at::Tensor& weight_sums,
                                bool vnni, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const int64_t elem_bytes = vnni ? 1 : 2;
  at::Tensor xq = at::empty({M * K * elem_bytes}, x.options().dtype(at::kByte));
  std::vector<float> sx((M + kLanes - 1) / kLanes * kLanes, 0.0f);  // whole vectors
  const scalar_t* xp = x.data_ptr<scalar_t>();
  uint8_t* xq_bytes = xq.data_ptr<uint8_t>();
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* row = xq_bytes + m * K * elem_bytes;
    sx[m] = quantize_row(xp + m * K, K, vnni ? row : nullptr,
                         vnni ? nullptr : reinterpret_cast<int16_t*>(row));
  }
  const int32_t offset = vnni ? kVnniOffset : 0;
  const int8_t* w = qweight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const int32_t* wsum = weight_sums.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  if (vnni && M >= kGemmMinRows) {
    return int8_dynamic_gemm(xq_bytes, sx.data(), M, K, qweight, wsum, s, o);
  }
  const bool ahead = kvmesh::prefetch_ahead_mode();
  kvmesh::for_each_row_group<kRows>(N, w, K, [&](int64_t n0, int64_t num_rows) {
    int32_t dots[kMaxXRows * kRows];
    for (int64_t m0 = 0; m0 < M; m0 += kMaxXRows) {  // the group's weights stay in L1
      const int64_t mb = std::min(kMaxXRows, M - m0);
      group_dots(mb, vnni, ahead, w + n0 * K, num_rows, xq_bytes + m0 * K * elem_bytes, K,
                 dots);
      for (int64_t m = 0; m < mb; ++m) {
        write_outputs(dots + m * kRows, num_rows, offset, wsum + n0, s + n0, sx[m0 + m],
                      o + (m0 + m) * N + n0);
      }
    }
  });
}

// The product into out (after the checks): the VNNI path where asked and the CPU has it.
void run(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
         const at::Tensor& weight_sums, bool use_vnni, at::Tensor& out) {
  if (x.size(0) == 0 || qweight.size(0) == 0) return;
  if (x.size(1) == 0) {
    out.zero_();
    return;
  }
  const bool vnni = use_vnni && cpu_has_vnni();
  if (x.scalar_type() == at::kBFloat16) {
    int8_dynamic_linear_kernel<at::BFloat16>(x, qweight, scales, weight_sums, vnni, out);
  } else {
    int8_dynamic_linear_kernel<float>(x, qweight, scales, weight_sums, vnni, out);
  }
}

at::Tensor int8_dynamic_linear_cpu(const at::Tensor& x, const at::Tensor& qweight,
                                   const at::Tensor& scales, const at::Tensor& weight_sums,
                                   bool use_vnni) {
  kvmesh::check_int8_dynamic_linear(x, qweight, scales, weight_sums);
  auto out = at::empty({x.size(0), qweight.size(0)}, x.options());
  run(x, qweight, scales, weight_sums, use_vnni, out);
  return out;
}

}  // namespace

void kvmesh::check_int8_dynamic_linear(const at::Tensor& x, const at::Tensor& qweight,
                                       const at::Tensor& scales, const at::Tensor& weight_sums) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int8_dynamic_linear_cpu: x must be a contiguous float32 or bfloat16 [M, K], got ",
              x.scalar_type(), " ", x.sizes());
  kvmesh::check_int8_dynamic_weight(qweight, scales, weight_sums, x.size(1));
}

void kvmesh::check_int8_dynamic_weight(const at::Tensor& qweight, const at::Tensor& scales,
                                       const at::Tensor& weight_sums, int64_t K) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kChar,
              "int8_dynamic_linear_cpu: qweight must be a contiguous int8 [N, K], got ",
              qweight.scalar_type(), " ", qweight.sizes());
  const int64_t N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K, "int8_dynamic_linear_cpu: qweight has K=", qweight.size(1),
              ", x has K=", K);
  TORCH_CHECK(K % kKMultiple == 0 && K <= kMaxK, "int8_dynamic_linear_cpu: K=", K,
              " must be a multiple of ", kKMultiple, " and at most ", kMaxK,
              " (int32 accumulation)");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N && scales.is_contiguous() &&
              scales.scalar_type() == at::kFloat,
              "int8_dynamic_linear_cpu: scales must be a contiguous float32 [N=", N, "], got ",
              scales.scalar_type(), " ", scales.sizes());
  TORCH_CHECK(weight_sums.dim() == 1 && weight_sums.size(0) == N && weight_sums.is_contiguous() &&
              weight_sums.scalar_type() == at::kInt,
              "int8_dynamic_linear_cpu: weight_sums must be a contiguous int32 [N=", N, "], got ",
              weight_sums.scalar_type(), " ", weight_sums.sizes());
}

void kvmesh::int8_dynamic_linear_out(const at::Tensor& x, const at::Tensor& qweight,
                                     const at::Tensor& scales, const at::Tensor& weight_sums,
                                     at::Tensor& out) {
  run(x, qweight, scales, weight_sums, /*use_vnni=*/true, out);
}

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  // weight_sums[n] = sum_k qweight[n, k]; use_vnni=False forces the AVX2 path (tests).
  m.def("int8_dynamic_linear_cpu(Tensor x, Tensor qweight, Tensor scales, Tensor weight_sums, "
        "bool use_vnni=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("int8_dynamic_linear_cpu", &int8_dynamic_linear_cpu);
}
#endif  // CPU_CAPABILITY_AVX512 || CPU_CAPABILITY_AVX2
