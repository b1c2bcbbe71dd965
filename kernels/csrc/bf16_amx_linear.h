// kvmesh's bfloat16 linear on AMX tiles (bf16_amx_linear_cpu.cpp), for the layer op
// that dispatches to it (bf16_linear_cpu.cpp): AVX-512 builds by a compiler that
// knows AMX's intrinsics (GCC 11, Clang 12 and later), which define KVMESH_AMX.
#pragma once

#include <ATen/ATen.h>

#if defined(CPU_CAPABILITY_AVX512) && __has_include(<amxtileintrin.h>)
#define KVMESH_AMX 1

namespace kvmesh {

// Whether this CPU has AMX-BF16 and Linux granted the process the tile state.
bool bf16_amx_available();

// x (bfloat16 [M, K]) @ weight.T, the weight laid out by amx_pack
// ([N/16, K/32, 16, 16, 2]) -> bfloat16 [M, N].
at::Tensor bf16_amx_linear_cpu(const at::Tensor& x, const at::Tensor& packed_weight);

}  // namespace kvmesh
#endif  // KVMESH_AMX
