// kvmesh::bf16_amx_linear_cpu: x @ weight.T for bfloat16 x on AMX tiles (batched decode).
//
// out[m, n] = sum_k x[m, k] * weight[n, k] in float32, rounded once to bfloat16: the
// product F.linear(x.float(), weight.float()) computes, up to summation order (AMX
// also flushes denormal inputs and outputs, below ~1e-38, to zero). The weight is
// laid out for the tiles once, at load (kernels/bf16_amx_linear_cpu.py's amx_pack):
// [N/16, K/32, 16, 16, 2], tile (n/16, k/32) holding for each pair of k its 16 rows'
// two elements side by side, as tdpbf16ps reads its second operand. x is read as
// it is: a tile is 16 of its rows, 32 elements each. N and K must be multiples of 32.
//
// Each thread takes a contiguous range of 32 weight rows at a time and, for each,
// every block of 32 rows of x: four accumulator tiles (two of x's halves by two of
// the weight's), summed over K in steps of 32, then rounded and written. x is
// walked in chunks of kChunkRows rows, so that a prefill's x tiles stay in L2 while
// the whole weight passes. On a Xeon with AMX (2 threads, weights from memory) this
// took 0.5-0.7x the time of oneDNN's prepacked bfloat16 linear at 4 to 32 rows,
// about the same at 64, and 0.8-1.2x at 128 and 256 (benchmarks/RESULTS.md).
//
// AMX code is compiled with target attributes and runs only where CPUID reports
// AMX-TILE and AMX-BF16 and Linux grants the process the tile state
// (bf16_amx_available), so the library still loads on every AVX-512 CPU. Built
// into AVX-512 libraries where the compiler knows AMX (KVMESH_AMX).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16_amx_linear.h"

#if defined(KVMESH_AMX)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#define KVMESH_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))

namespace {

constexpr int64_t kTile = 16;         // rows of a tile, of x and of the weight
constexpr int64_t kTileK = 32;        // bfloat16 elements in a tile's row (64 bytes)
constexpr int64_t kBlock = 2 * kTile;  // rows of x, and of the weight, per block
constexpr int64_t kChunkRows = 256;   // rows of x per pass over the weight
constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an XSAVE feature
constexpr int kXfeatureXtiledata = 18;     // the AMX tile data

// ldtilecfg's 64-byte operand (palette 1: 8 tiles of up to 16 rows of 64 bytes).
struct TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

bool request_amx() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool has_tile = edx & (1u << 24), has_bf16 = edx & (1u << 22);
  return has_tile && has_bf16 &&
         syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Every tile as 16 rows of 64 bytes: tiles 0-3 accumulate float32 (16 x 16), 4-5
// hold x (16 rows x 32 bfloat16), 6-7 the weight (16 pairs of k x 16 rows x 2).
KVMESH_AMX_TARGET void load_tile_config() {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTile;
    config.bytes_per_row[t] = 64;
  }
  // GCC's ldtilecfg takes its operand as a pointer-sized read: without this the
  // stores above look dead to it and are dropped (then ldtilecfg faults).
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

KVMESH_AMX_TARGET void release_tiles() { _tile_release(); }

// acc[h][i][j] (h = x half * 2 + weight half) for the 32 (or, with one x half, 16)
// rows of x at x and the 32 weight rows whose tiles start at w0 and w1. Tiles are
// not renamed: a load waits for the products still reading its tile, so each
// load comes right before the products that use it.
KVMESH_AMX_TARGET void multiply_block(const uint16_t* x, int64_t K, bool two_halves,
                                      const uint16_t* w0, const uint16_t* w1,
                                      float (*acc)[kTile][kTile]) {
  const int64_t tiles_k = K / kTileK, tile_elems = kTile * kTileK;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < tiles_k; ++kb) {
    _tile_loadd(4, x + kb * kTileK, K * 2);
    _tile_loadd(6, w0 + kb * tile_elems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w1 + kb * tile_elems, 64);
    _tile_dpbf16ps(1, 4, 7);
    if (two_halves) {
      _tile_loadd(5, x + kTile * K + kb * kTileK, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc[0], 64);
  _tile_stored(1, acc[1], 64);
  if (two_halves) {
    _tile_stored(2, acc[2], 64);
    _tile_stored(3, acc[3], 64);
  }
}

// Rounds the block's sums to bfloat16 into out's rows [m0, m0 + num_rows) and
// columns [n0, n0 + 32).
KVMESH_AMX_TARGET void store_block(float (*acc)[kTile][kTile], int64_t num_rows,
                                   uint16_t* out, int64_t m0, int64_t n0, int64_t N) {
  for (int64_t i = 0; i < num_rows; ++i) {
    const int64_t half = i / kTile, row = i % kTile;
    const __m512 left = _mm512_loadu_ps(acc[half * 2][row]);
    const __m512 right = _mm512_loadu_ps(acc[half * 2 + 1][row]);
    _mm512_storeu_si512(out + (m0 + i) * N + n0, (__m512i)_mm512_cvtne2ps_pbh(right, left));
  }
}

}  // namespace

namespace kvmesh {

bool bf16_amx_available() {
  static const bool available = request_amx();  // once per process; Linux keeps the grant
  return available;
}

at::Tensor bf16_amx_linear_cpu(const at::Tensor& x, const at::Tensor& packed_weight) {
  TORCH_CHECK(bf16_amx_available(), "bf16_amx_linear_cpu needs a CPU with AMX-BF16 whose "
              "kernel grants the process AMX's tile state");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "x must be bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(packed_weight.dim() == 5 && packed_weight.scalar_type() == at::kBFloat16 &&
              packed_weight.is_contiguous() && packed_weight.size(0) % 2 == 0 &&
              packed_weight.size(2) == kTile && packed_weight.size(3) == kTile &&
              packed_weight.size(4) == 2,
              "packed_weight must be amx_pack's contiguous bfloat16 [N/16, K/32, 16, 16, 2] "
              "with N a multiple of 32, got ", packed_weight.scalar_type(), " ",
              packed_weight.sizes());
  const int64_t N = packed_weight.size(0) * kTile, K = packed_weight.size(1) * kTileK;
  TORCH_CHECK(x.size(1) == K, "x [M, K] must have the packed weight's K = ", K, ", got ",
              x.sizes());
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  // Tiles read 16 rows of x: pad a partial last tile with zero rows.
  const int64_t padded_rows = (M + kTile - 1) / kTile * kTile;
  at::Tensor xs = x.contiguous();
  if (padded_rows != M) {
    xs = at::constant_pad_nd(xs, {0, 0, 0, padded_rows - M});
  }
  const auto* xd = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
  const auto* wd = reinterpret_cast<const uint16_t*>(packed_weight.data_ptr<at::BFloat16>());
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t weight_tile_elems = K * kTile;  // one 16-row strip of the packed weight
  at::parallel_for(0, N / kBlock, 0, [&](int64_t begin, int64_t end) {
    load_tile_config();
    alignas(64) float acc[4][kTile][kTile];
    for (int64_t chunk = 0; chunk < padded_rows; chunk += kChunkRows) {
      const int64_t chunk_end = std::min(chunk + kChunkRows, padded_rows);
      for (int64_t block = begin; block < end; ++block) {
        const uint16_t* w0 = wd + 2 * block * weight_tile_elems;
        for (int64_t m0 = chunk; m0 < chunk_end; m0 += kBlock) {
          const bool two_halves = m0 + kTile < chunk_end;
          multiply_block(xd + m0 * K, K, two_halves, w0, w0 + weight_tile_elems, acc);
          store_block(acc, std::min(kBlock, M - m0), od, m0, block * kBlock, N);
        }
      }
    }
    release_tiles();
  });
  return out;
}

}  // namespace kvmesh

namespace {

at::Tensor bf16_amx_linear_meta(const at::Tensor& x, const at::Tensor& packed_weight) {
  return at::empty_symint({x.sym_size(0), packed_weight.sym_size(0) * kTile}, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("bf16_amx_available() -> bool", &kvmesh::bf16_amx_available);
  m.def("bf16_amx_linear_cpu(Tensor x, Tensor packed_weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("bf16_amx_linear_cpu", &kvmesh::bf16_amx_linear_cpu); }

TORCH_LIBRARY_IMPL(kvmesh, Meta, m) { m.impl("bf16_amx_linear_cpu", &bf16_amx_linear_meta); }
#endif  // KVMESH_AMX
