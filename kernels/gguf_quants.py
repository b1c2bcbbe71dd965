"""GGUF's Q4_0, Q4_1 and Q8_0 weight blocks in PyTorch, byte for byte as GGUF stores them.

A row of K weights is K / 32 blocks, each a float16 scale ``d`` (little-endian) and
then the block's 32 quants:

  * ``Q4_0`` (18 bytes): ``d``, 16 bytes of nibbles; w = d * (q - 8).
  * ``Q4_1`` (20 bytes): ``d``, float16 min ``m``, 16 bytes of nibbles; w = d * q + m.
  * ``Q8_0`` (34 bytes): ``d``, 32 int8; w = d * q.

Byte i of the nibbles holds element i in its low nibble and element i + 16 in its
high one. ``quantize`` rounds as the ``gguf`` package (and llama.cpp's reference
quantizers) do, so it writes the same bytes; it exists for tests and benchmarks.
"""

from __future__ import annotations

import enum

import torch

BLOCK_SIZE = 32


class GGMLQuantizationType(enum.IntEnum):
    """The block types served, by GGUF's names and ids (``gguf.GGMLQuantizationType``)."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8


# Bytes per block of 32 weights.
BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20,
               GGMLQuantizationType.Q8_0: 34}


def row_bytes(quant_type: int, num_cols: int) -> int:
    """Bytes of one row of ``num_cols`` weights (a multiple of 32)."""
    if num_cols % BLOCK_SIZE:
        raise ValueError(f"num_cols={num_cols} must be a multiple of {BLOCK_SIZE}")
    return num_cols // BLOCK_SIZE * BLOCK_BYTES[GGMLQuantizationType(quant_type)]


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).view(torch.uint8)


def _fp16_from(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    return q[:, :16] | (q[:, 16:] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def dequantize(qweight: torch.Tensor, quant_type: int, num_cols: int) -> torch.Tensor:
    """``qweight`` uint8 [N, row_bytes] -> float32 [N, ``num_cols``]."""
    quant_type = GGMLQuantizationType(quant_type)
    num_rows = qweight.shape[0]
    if qweight.dtype != torch.uint8 or qweight.shape[1] != row_bytes(quant_type, num_cols):
        raise ValueError(f"qweight must be uint8 [N, {row_bytes(quant_type, num_cols)}], "
                         f"got {qweight.dtype} {list(qweight.shape)}")
    blocks = qweight.reshape(-1, BLOCK_BYTES[quant_type])
    d = _fp16_from(blocks, 0)
    if quant_type == GGMLQuantizationType.Q8_0:
        w = d * blocks[:, 2:].contiguous().view(torch.int8).float()
    elif quant_type == GGMLQuantizationType.Q4_0:
        w = d * (_unpack_nibbles(blocks[:, 2:]).float() - 8)
    else:
        w = d * _unpack_nibbles(blocks[:, 4:]).float() + _fp16_from(blocks, 2)
    return w.reshape(num_rows, num_cols)


def _round_half_away(values: torch.Tensor) -> torch.Tensor:
    # As the gguf package's np_roundf: floor(a + 0.5) can round up at a = 0.5 - ulp.
    a = values.abs()
    floored = a.floor()
    return values.sign() * (floored + (2 * (a - floored)).floor())


def quantize(weight: torch.Tensor, quant_type: int) -> torch.Tensor:
    """``weight`` [N, K] (K a multiple of 32) -> uint8 [N, K / 32 * block_bytes]."""
    quant_type = GGMLQuantizationType(quant_type)
    num_rows, num_cols = weight.shape
    row_bytes(quant_type, num_cols)  # checks K
    blocks = weight.float().reshape(-1, BLOCK_SIZE)
    if quant_type == GGMLQuantizationType.Q8_0:
        d = blocks.abs().amax(dim=1, keepdim=True) / 127
        inv_d = torch.where(d == 0, 0, 1 / d)
        q = _round_half_away(blocks * inv_d).to(torch.int8).view(torch.uint8)
        packed = torch.cat([_fp16_bytes(d), q], dim=1)
    elif quant_type == GGMLQuantizationType.Q4_0:
        # d maps the block's largest magnitude, with its sign, to -8.
        peak = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
        d = peak / -8
        inv_d = torch.where(d == 0, 0, 1 / d)
        q = (blocks * inv_d + 8.5).trunc().clamp(0, 15).to(torch.uint8)
        packed = torch.cat([_fp16_bytes(d), _pack_nibbles(q)], dim=1)
    else:
        low = blocks.amin(dim=1, keepdim=True)
        d = (blocks.amax(dim=1, keepdim=True) - low) / 15
        inv_d = torch.where(d == 0, 0, 1 / d)
        q = ((blocks - low) * inv_d + 0.5).trunc().clamp(0, 15).to(torch.uint8)
        packed = torch.cat([_fp16_bytes(d), _fp16_bytes(low), _pack_nibbles(q)], dim=1)
    return packed.reshape(num_rows, -1)
