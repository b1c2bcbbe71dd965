"""Dynamic int8 x int8 linear (per-channel int8 weights, activations quantized to
int8 per token at every call): kvmesh's C++ kernel, else a PyTorch reference that
computes the same bits.

Each activation row gets s_x = absmax / 127 and q_x = round(x * (127 / absmax)),
half to even, in [-127, 127] (a row with a NaN or an infinity: s_x = NaN, so its
outputs, and no other row's, are NaN; a row below ``_MIN_ABSMAX``: zeros). Then
``out = float(q_x @ qweight.T) * s_x * scales`` with the integer product exact.
``kvmesh::int8_dynamic_linear_cpu`` (kernels/csrc, built by `kernels.cpu_extension`
for AVX2 and AVX-512 CPUs) does the product with AVX512-VNNI's vpdpbusd where the
CPU has it (which needs ``weight_sums``, see `weight_sums`), else AVX2: a few rows
cost little more than one, where weight-only int8 converts every weight to float.
From 16 rows on, the VNNI path is a GEMM with the activation rows in a vector's
lanes and no sum reduced across a vector; on a Zen 5 (2 threads) it took
0.51-0.77x the time of oneDNN's prepacked bfloat16 linear at 16-256 rows.
The reference computes the integer product in float64 (exact: every partial sum
is an integer below 2**53) and scales in the kernel's order, so the two agree
bit for bit.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import has_cpu_kernel

# Rows below this absmax quantize to zero (127 / absmax would overflow float32).
_MIN_ABSMAX = 1e-30
# The C++ kernel takes whole 64-byte vectors of K, and K up to int32's bound on
# its unsigned sums (255 * 128 per element).
CPU_KERNEL_K_MULTIPLE = 64
CPU_KERNEL_MAX_K = (2**31 - 1) // (255 * 128)


def weight_sums(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N]: each row's sum of ``qweight`` int8 [N, K]. The VNNI path multiplies
    q_x + 128 (unsigned) by the weights and subtracts 128 * this; compute it once,
    when the weight is loaded."""
    return qweight.sum(dim=1, dtype=torch.int32)


def quantize_activations_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (q_x int8 [M, K] in [-127, 127], s_x float32 [M]): the values the
    kernel multiplies, x ~= q_x * s_x[:, None]. A row with a NaN or an infinity has
    q_x = 0 and s_x = NaN; an all-zero (or subnormal) row q_x = 0 and s_x = 0."""
    xf = x.float()
    absmax = xf.abs().amax(dim=1, keepdim=True)
    bad = ~torch.isfinite(xf).all(dim=1, keepdim=True)
    ok = ~bad & (absmax >= _MIN_ABSMAX)
    # Tensor divisions: a scalar operand may be applied as a reciprocal multiply,
    # off by an ulp at times, which flips ties (bfloat16 activations hit exact halves).
    k127 = torch.full_like(absmax, 127.0)
    inv_s = torch.where(ok, k127 / absmax, 0.0)
    q = torch.where(ok, torch.round(xf * inv_s), 0.0).to(torch.int8)
    s = torch.where(bad, torch.nan, torch.where(ok, absmax / k127, 0.0))
    return q, s.squeeze(1)


def int8_dynamic_linear_ref(x: torch.Tensor, qweight: torch.Tensor,
                            scales: torch.Tensor) -> torch.Tensor:
    """The kernel's product in PyTorch, bit for bit: exact integer dot products
    (float64 holds them), then ``float32(dot) * s_x * scales`` in that order."""
    q, s = quantize_activations_per_token(x)
    dots = (q.double() @ qweight.double().T).float()
    return (dots * s[:, None] * scales.float()[None, :]).to(x.dtype)


def int8_dynamic_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        sums: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] (float32 or bfloat16) @ (``qweight`` int8 [N, K] * ``scales``
    float32 [N, 1]).T -> [M, N] in ``x``'s dtype, with ``sums`` = `weight_sums`
    (qweight). The C++ kernel where it is built and K fits it, else the reference."""
    K = x.shape[1]
    if (x.dtype in (torch.float32, torch.bfloat16) and K % CPU_KERNEL_K_MULTIPLE == 0
            and K <= CPU_KERNEL_MAX_K and has_cpu_kernel("int8_dynamic_linear_cpu")):
        return torch.ops.kvmesh.int8_dynamic_linear_cpu(x.contiguous(), qweight, scales, sums)
    return int8_dynamic_linear_ref(x, qweight, scales)
