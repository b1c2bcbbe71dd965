// kvmesh::set_row_group_prefetch and kvmesh::row_group_prefetch: how the linear
// kernels' row-group loop (row_groups.h) prefetches, for the whole process.
#include <torch/library.h>

#include "row_groups.h"

namespace {

void set_row_group_prefetch(int64_t mode) {
  TORCH_CHECK(mode >= static_cast<int64_t>(kvmesh::RowGroupPrefetch::kWholeGroup) &&
              mode <= static_cast<int64_t>(kvmesh::RowGroupPrefetch::kAhead),
              "mode must be 0 (the whole next group), 1 (its first lines), 2 (none) or 3 ",
              "(ahead of the reads), got ", mode);
  kvmesh::row_group_prefetch().store(static_cast<int>(mode), std::memory_order_relaxed);
}

int64_t row_group_prefetch() {
  return kvmesh::row_group_prefetch().load(std::memory_order_relaxed);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("set_row_group_prefetch(int mode) -> ()", &set_row_group_prefetch);
  m.def("row_group_prefetch() -> int", &row_group_prefetch);
}
