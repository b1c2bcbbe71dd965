// The loop every linear kernel here shares: a weight's rows in small groups, split
// over torch's threads, with the next group prefetched while one computes (how, the
// worker measures at start: RowGroupPrefetch below).
//
// A decode step streams each weight from memory once, so each thread takes a
// contiguous range of groups (one sequential stream for the hardware prefetcher
// and for ours), and a group's rows stay in L1 while every activation row is
// multiplied into them.
//
// The prefetch is non-temporal where the group being read and the next one fit
// in L1 together: a step uses each weight once (a model's weights are far larger
// than the caches, so none would still be cached at the next step), and fetched
// as temporal data their hundreds of megabytes push out of L2 and L3 what the
// step touches between kernels (the interpreter's code and data, the activations). On a Zen 5 a
// one-stream bfloat16 decode step ran 1.07x faster so (benchmarks/RESULTS.md);
// w8a8 and GGUF steps were unchanged. A line prefetched non-temporally may be
// dropped when it leaves L1, so where two groups overflow L1 the hint stays T0.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvmesh {

// How the weight rows are prefetched, set for the process by
// kvmesh::set_row_group_prefetch: by for_each_row_group, the next group before one
// computes, or by the kernels' one-row loops, a fixed distance ahead as they read.
// The next group's every line, issued at once, lets it arrive while this one
// computes, but the burst can stall the core until the misses drain: on a Zen 3
// guest the fused decode step ran 1.16x faster with no software prefetch, 1.21x on
// huge pages, where the Zen 5 had gained from the whole group non-temporally; a line
// at a time kAheadBytes ahead ran it 1.07-1.12x faster again there
// (benchmarks/RESULTS.md). Results are the same bits in every mode.
enum class RowGroupPrefetch : int {
  kWholeGroup = 0,  // every line of the next group (the default)
  kFirstLines = 1,  // its first kFirstLines lines; the hardware prefetcher follows them
  kNone = 2,        // the hardware prefetcher alone
  kAhead = 3,       // none by groups; one-row loops prefetch kAheadBytes ahead (prefetch_ahead)
};
constexpr int64_t kFirstLines = 4;
constexpr int64_t kAheadBytes = 1024;

inline std::atomic<int>& row_group_prefetch() {
  static std::atomic<int> mode{static_cast<int>(RowGroupPrefetch::kWholeGroup)};
  return mode;
}

// The L1 data cache's bytes per core (32 KiB where the system does not say).
inline int64_t l1_data_cache_bytes() {
  static const int64_t bytes = [] {
    const long reported = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return reported > 0 ? static_cast<int64_t>(reported) : int64_t{32768};
  }();
  return bytes;
}

// Whether one-row loops prefetch ahead of their reads (RowGroupPrefetch::kAhead): read
// once per kernel call.
inline bool prefetch_ahead_mode() {
  return row_group_prefetch().load(std::memory_order_relaxed) ==
         static_cast<int>(RowGroupPrefetch::kAhead);
}

// Prefetches the lines of [p + kAheadBytes, p + kAheadBytes + bytes): a loop that
// reads a weight in order calls it for each `bytes` it reads from p (steps of 64
// bytes or less apart), so that lines are asked for a few at a time as it goes, a
// steady drip the core does not wait on.
inline void prefetch_ahead(const void* p, int64_t bytes) {
  const char* ahead = static_cast<const char*>(p) + kAheadBytes;
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
}

// Calls body(n0, num_rows) for each group [n0, n0 + num_rows) of up to kGroupRows
// consecutive rows of a weight with N rows of row_bytes each, starting at weight.
// Groups run in order within a thread; before a group's body, the next group's
// bytes (all of them or the first lines: row_group_prefetch) are prefetched into L1,
// non-temporally where two groups fit there.
template <int64_t kGroupRows, typename Body>
inline void for_each_row_group(int64_t N, const void* weight, int64_t row_bytes,
                               const Body& body) {
  const int64_t num_groups = (N + kGroupRows - 1) / kGroupRows;
  const int64_t per_thread = (num_groups + at::get_num_threads() - 1) / at::get_num_threads();
  const char* bytes = static_cast<const char*>(weight);
  const bool non_temporal = 2 * kGroupRows * row_bytes <= l1_data_cache_bytes();
  const auto prefetch =
      static_cast<RowGroupPrefetch>(row_group_prefetch().load(std::memory_order_relaxed));
  const int64_t max_bytes = prefetch == RowGroupPrefetch::kWholeGroup ? kGroupRows * row_bytes
                            : prefetch == RowGroupPrefetch::kFirstLines ? kFirstLines * 64
                                                                       : 0;  // none, ahead
  at::parallel_for(0, num_groups, per_thread, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kGroupRows;
      if (g + 1 < end) {
        const char* next = bytes + (n0 + kGroupRows) * row_bytes;
        const int64_t next_bytes =
            std::min(std::min(kGroupRows, N - n0 - kGroupRows) * row_bytes, max_bytes);
        if (non_temporal) {
          for (int64_t i = 0; i < next_bytes; i += 64) _mm_prefetch(next + i, _MM_HINT_NTA);
        } else {
          for (int64_t i = 0; i < next_bytes; i += 64) _mm_prefetch(next + i, _MM_HINT_T0);
        }
      }
      body(n0, std::min(kGroupRows, N - n0));
    }
  });
}

}  // namespace kvmesh
