"""A GGUF file's header and tensor table, read strictly, its tensors left in the file.

``gguf.GGUFReader`` turns every metadata value into numpy views, the tokenizer's
~100k vocabulary and merge strings included, which cost seconds on each worker
start. The worker needs a few scalars and the tensors' bytes, so this reads
the header with ``struct`` on an mmap of the file: metadata arrays are stepped
over, never decoded, and each tensor is a zero-copy view of its bytes.

Layout (GGUF v2 and v3, little-endian; v1's 32-bit counts are not read):
magic ``GGUF``, uint32 version, uint64 tensor count, uint64 metadata count, the
metadata (string key, uint32 value type, value), the tensor infos (string
name, uint32 n_dims, uint64 dims innermost first, uint32 ggml type, uint64
offset), padding, then the data section, aligned to ``general.alignment``
(default 32); each tensor's offset counts from that section's start and is a
multiple of the alignment. Strings are a uint64 byte length and UTF-8 bytes.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, KEY_GENERAL_ALIGNMENT,
                  GGMLQuantizationType, GGUFValueType)

SUPPORTED_VERSIONS = (2, 3)
# ggml tensors have at most four dimensions (GGML_MAX_DIMS); llama.cpp refuses more.
MAX_DIMS = 4

# The fixed-size value types, as struct formats (little-endian).
_SCALAR_FORMATS: dict[GGUFValueType, struct.Struct] = {
    value_type: struct.Struct("<" + fmt) for value_type, fmt in (
        (GGUFValueType.UINT8, "B"), (GGUFValueType.INT8, "b"),
        (GGUFValueType.UINT16, "H"), (GGUFValueType.INT16, "h"),
        (GGUFValueType.UINT32, "I"), (GGUFValueType.INT32, "i"),
        (GGUFValueType.UINT64, "Q"), (GGUFValueType.INT64, "q"),
        (GGUFValueType.FLOAT32, "f"), (GGUFValueType.FLOAT64, "d"),
        (GGUFValueType.BOOL, "?"))}
_U32 = _SCALAR_FORMATS[GGUFValueType.UINT32]
_U64 = _SCALAR_FORMATS[GGUFValueType.UINT64]

MetadataValue = int | float | bool | str


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor: ``shape`` outermost first (as numpy and torch order it, the
    reverse of GGUF's dims) and ``data``, a read-only uint8 view of its bytes
    in the file, [*shape[:-1], bytes of a row]."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """A GGUF file's header: ``metadata`` holds every scalar and string value
    by key (arrays, such as the tokenizer's vocabulary, are stepped over and
    left out); ``tensors`` every tensor by name, in the file's order."""

    path: Path
    version: int
    alignment: int
    metadata: dict[str, MetadataValue]
    tensors: dict[str, GGUFTensor]


class _Cursor:
    """Reads little-endian values from ``buffer`` in order; a read past its end
    raises ValueError naming the file, the offset and what was being read."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer, self.path, self.offset = buffer, path, 0
        self.size = len(buffer)

    def error(self, what: str) -> ValueError:
        return ValueError(f"GGUF file {self.path}: {what}")

    def skip(self, num_bytes: int, what: str) -> int:
        """Moves past ``num_bytes`` bytes; returns where they start."""
        start = self.offset
        if num_bytes > self.size - start:
            raise self.error(f"truncated: {what} needs {num_bytes} bytes at offset {start}, "
                             f"the file has {self.size} bytes")
        self.offset = start + num_bytes
        return start

    def scalar(self, fmt: struct.Struct, what: str) -> int | float | bool:
        return fmt.unpack_from(self.buffer, self.skip(fmt.size, what))[0]

    def string(self, what: str) -> str:
        num_bytes = self.scalar(_U64, what)
        start = self.skip(num_bytes, what)
        try:
            return self.buffer[start:self.offset].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(f"{what} at offset {start} is not UTF-8 ({e.reason})") from None

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.scalar(_U32, what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.error(f"{what} has value type {raw}; allowed: 0 to "
                             f"{max(GGUFValueType)}") from None

    def value(self, value_type: GGUFValueType, what: str) -> MetadataValue | None:
        """Reads a value of ``value_type``; an array is stepped over (None)."""
        if value_type == GGUFValueType.STRING:
            return self.string(what)
        if value_type != GGUFValueType.ARRAY:
            return self.scalar(_SCALAR_FORMATS[value_type], what)
        item_type = self.value_type(f"{what} item type")
        num_items = self.scalar(_U64, f"{what} length")
        if item_type in _SCALAR_FORMATS:
            self.skip(num_items * _SCALAR_FORMATS[item_type].size, what)
        elif item_type == GGUFValueType.STRING:
            self._skip_strings(num_items, what)
        else:  # nested arrays: each item says its own length
            for _ in range(num_items):
                self.value(item_type, what)
        return None

    def _skip_strings(self, num_items: int, what: str) -> None:
        """Steps over ``num_items`` strings without decoding them: a tokenizer's
        vocabulary is ~100k of them, so this is the header's one hot loop."""
        offset, unpack_from, buffer = self.offset, _U64.unpack_from, self.buffer
        try:
            for _ in range(num_items):
                offset += 8 + unpack_from(buffer, offset)[0]
        except (struct.error, OverflowError):  # a length field past the end
            offset = self.size + 1
        if offset > self.size:
            raise self.error(f"truncated: {what}: {num_items} strings from offset "
                             f"{self.offset} run past the end ({self.size} bytes)")
        self.offset = offset


def read_gguf(path: Path) -> GGUFFile:
    """Reads ``path``'s header and tensor table; the tensors' ``data`` are views
    of a read-only mmap of the file, which stays mapped while any is referenced.

    ValueError, naming the file and what is wrong, for: bad magic, a version
    other than 2 or 3 (or a big-endian file), a file truncated anywhere in the
    header, an unknown value or ggml type, a non-power-of-two or non-UINT32
    ``general.alignment``, a duplicate tensor name, more than four dims, a row
    that is not whole blocks, a tensor offset not a multiple of the alignment,
    and tensor data past the end of the file.
    """
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:  # mmap refuses an empty file
            raise ValueError(f"GGUF file {path}: truncated: the file is empty")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buffer, path)
    if cursor.scalar(_U32, "magic") != GGUF_MAGIC:
        raise cursor.error(f"bad magic {bytes(buffer[:4])!r}; a GGUF file starts with b'GGUF'")
    version = cursor.scalar(_U32, "version")
    if version not in SUPPORTED_VERSIONS:
        endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise cursor.error(f"unsupported version {version}{endian}; supported: "
                           f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
    num_tensors = cursor.scalar(_U64, "tensor count")
    num_kvs = cursor.scalar(_U64, "metadata count")
    metadata, alignment = _read_metadata(cursor, num_kvs)
    infos = [_read_tensor_info(cursor, i) for i in range(num_tensors)]
    data_start = -(-cursor.offset // alignment) * alignment
    file_bytes = np.frombuffer(buffer, dtype=np.uint8)
    tensors: dict[str, GGUFTensor] = {}
    for name, tensor_type, shape, offset in infos:
        if name in tensors:
            raise cursor.error(f"tensor {name!r} appears twice")
        tensors[name] = _tensor_view(cursor, file_bytes, data_start, alignment,
                                     name, tensor_type, shape, offset)
    return GGUFFile(path, version, alignment, metadata, tensors)


def _read_metadata(cursor: _Cursor, num_kvs: int) -> tuple[dict[str, MetadataValue], int]:
    """The non-array metadata by key, and the data section's alignment."""
    metadata: dict[str, MetadataValue] = {}
    alignment = GGUF_DEFAULT_ALIGNMENT
    for i in range(num_kvs):
        key = cursor.string(f"metadata key {i}")
        value_type = cursor.value_type(f"metadata {key!r}")
        value = cursor.value(value_type, f"metadata {key!r}")
        if key == KEY_GENERAL_ALIGNMENT:
            # As gguf.GGUFReader and llama.cpp: only a UINT32 power of two.
            if value_type != GGUFValueType.UINT32 or value <= 0 or value & (value - 1):
                raise cursor.error(f"{key} is {value_type.name} {value!r}; it must be a "
                                   "UINT32 power of two")
            alignment = value
        if value is not None:
            metadata[key] = value
    return metadata, alignment


def _read_tensor_info(cursor: _Cursor, index: int
                      ) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
    """(name, ggml type, shape outermost first, offset in the data section)."""
    name = cursor.string(f"tensor {index} name")
    what = f"tensor {name!r}"
    num_dims = cursor.scalar(_U32, f"{what} n_dims")
    if num_dims > MAX_DIMS:
        raise cursor.error(f"{what} has {num_dims} dims; at most {MAX_DIMS}")
    dims = [cursor.scalar(_U64, f"{what} dims") for _ in range(num_dims)]
    raw_type = cursor.scalar(_U32, f"{what} type")
    try:
        tensor_type = GGMLQuantizationType(raw_type)
    except ValueError:
        raise cursor.error(f"{what} has unknown ggml type {raw_type}") from None
    offset = cursor.scalar(_U64, f"{what} offset")
    return name, tensor_type, tuple(reversed(dims)), offset


def _tensor_view(cursor: _Cursor, file_bytes: np.ndarray, data_start: int, alignment: int,
                 name: str, tensor_type: GGMLQuantizationType, shape: tuple[int, ...],
                 offset: int) -> GGUFTensor:
    """The tensor's bytes in the file, checked to be aligned and inside it."""
    what = f"tensor {name!r} ({tensor_type.name}, shape {list(shape)})"
    block_size, block_bytes = GGML_QUANT_SIZES[tensor_type]
    row_len = shape[-1] if shape else 1
    if row_len % block_size:
        raise cursor.error(f"{what}: rows of {row_len} are not whole blocks of {block_size}")
    if offset % alignment:
        raise cursor.error(f"{what}: offset {offset} is not a multiple of the alignment "
                           f"{alignment}")
    row_bytes = row_len // block_size * block_bytes
    num_bytes = math.prod(shape[:-1]) * row_bytes
    start = data_start + offset
    if start + num_bytes > cursor.size:
        raise cursor.error(f"{what}: data at offset {start} to {start + num_bytes} is past the "
                           f"end of the file ({cursor.size} bytes)")
    data = file_bytes[start:start + num_bytes].reshape(*shape[:-1], row_bytes)
    return GGUFTensor(name, tensor_type, shape, data)
