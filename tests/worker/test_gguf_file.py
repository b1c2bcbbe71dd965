"""read_gguf against gguf.GGUFReader (the shipped GGUF and small synthetic ones), and
every malformed file it must refuse: a ValueError naming the file and the fault."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from services.common.model_files import default_gguf_path
from services.worker.gguf_file import GGUFFile, read_gguf

# Two tensors whose names have one length, so one can be renamed to the other in place.
Q8_NAME, F32_NAME = "blk.0.attn_q.weight", "blk.0.attn_k.weight"


def _write_gguf(path: Path, alignment: int | None = None) -> Path:
    """A small llama GGUF: scalars of several types, arrays of strings, ints and
    arrays (stepped over), a Q8_0 tensor [2, 64] and an F32 tensor [3, 4]."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint32("llama.block_count", 1)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_int64("test.int64", -5)
    writer.add_float64("test.float64", 0.25)
    writer.add_string("test.unicode", "naïve ✓")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "ü"])
    writer.add_array("tokenizer.ggml.token_type", [1, 2, 3])
    writer.add_array("test.nested", [["x", "yz"], ["w"]])
    rng = np.random.default_rng(0)
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64), dtype=np.float32),
                              GGMLQuantizationType.Q8_0)
    writer.add_tensor(Q8_NAME, q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor(F32_NAME, rng.standard_normal((3, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _assert_agrees_with_gguf_reader(ours: GGUFFile, path: Path) -> None:
    reader = gguf.GGUFReader(path)
    assert ours.version == reader.fields["GGUF.version"].contents()
    assert ours.alignment == reader.alignment
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for theirs in reader.tensors:
        tensor = ours.tensors[theirs.name]
        assert tensor.tensor_type == theirs.tensor_type, theirs.name
        assert tensor.shape == tuple(int(d) for d in reversed(theirs.shape)), theirs.name
        assert tensor.data.dtype == np.uint8 and not tensor.data.flags.writeable
        assert tensor.data.shape[:-1] == tensor.shape[:-1], theirs.name
        assert tensor.data.tobytes() == theirs.data.tobytes(), theirs.name
    scalars = {key: field.contents() for key, field in reader.fields.items()
               if not key.startswith("GGUF.") and field.types[0] != GGUFValueType.ARRAY}
    assert ours.metadata == scalars
    assert {key: type(value) for key, value in ours.metadata.items()} == \
        {key: type(value) for key, value in scalars.items()}


@pytest.mark.slow
def test_the_shipped_gguf_reads_as_gguf_reader_reads_it() -> None:
    path = default_gguf_path()
    ours = read_gguf(path)
    assert ours.metadata["general.architecture"] == "llama"
    assert "tokenizer.ggml.tokens" not in ours.metadata  # an array: stepped over
    _assert_agrees_with_gguf_reader(ours, path)


@pytest.mark.parametrize("alignment", [None, 64])
def test_a_synthetic_gguf_reads_as_gguf_reader_reads_it(tmp_path: Path,
                                                        alignment: int | None) -> None:
    path = _write_gguf(tmp_path / "small.gguf", alignment)
    ours = read_gguf(path)
    assert ours.alignment == (alignment or 32)
    assert ours.metadata["test.unicode"] == "naïve ✓"
    assert ours.tensors[Q8_NAME].shape == (2, 64)
    assert ours.tensors[Q8_NAME].data.shape == (2, 68)  # two Q8_0 blocks of 34 bytes a row
    np.testing.assert_array_equal(ours.tensors[F32_NAME].data.view(np.float32),
                                  gguf.GGUFReader(path).tensors[1].data)
    _assert_agrees_with_gguf_reader(ours, path)


# ---- malformed files: each corrupts a good one where the fault belongs ----------


def _field_offset(data: bytes, name: str) -> int:
    """Where the bytes after string ``name`` (a key or tensor name) start."""
    encoded = name.encode()
    start = data.index(struct.pack("<Q", len(encoded)) + encoded)
    return start + 8 + len(encoded)


def _tensor_offset_field(data: bytes, name: str) -> int:
    """Where tensor ``name``'s uint64 data offset is (its info: n_dims, dims, type)."""
    at = _field_offset(data, name)
    (num_dims,) = struct.unpack_from("<I", data, at)
    return at + 4 + 8 * num_dims + 4


def _data_end(path: Path) -> int:
    """Where the last tensor's bytes end (the writer pads the file past it)."""
    return max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(path).tensors)


def _corrupt(path: Path, edit) -> Path:
    data = bytearray(path.read_bytes())
    data = edit(data) or data
    bad = path.with_name("bad.gguf")
    bad.write_bytes(bytes(data))
    return bad


def _expect_error(path: Path, message: str) -> None:
    with pytest.raises(ValueError, match=f"GGUF file {re.escape(str(path))}: .*{message}"):
        read_gguf(path)


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return _write_gguf(tmp_path / "good.gguf")


def test_bad_magic(good: Path) -> None:
    bad = _corrupt(good, lambda d: d.__setitem__(slice(0, 4), b"GGML"))
    _expect_error(bad, "bad magic b'GGML'")


@pytest.mark.parametrize(("version", "message"), [
    (1, "unsupported version 1; supported: 2, 3"),
    (4, "unsupported version 4; supported: 2, 3"),
    (3 << 24, r"unsupported version 50331648 \(a big-endian file\?\)"),
])
def test_unsupported_version(good: Path, version: int, message: str) -> None:
    _expect_error(_corrupt(good, lambda d: struct.pack_into("<I", d, 4, version)), message)


def test_version_2_is_read(good: Path) -> None:
    """v2 differs from v3 only in what v3 allows (big-endian files): same layout."""
    assert read_gguf(_corrupt(good, lambda d: struct.pack_into("<I", d, 4, 2))).version == 2


def test_every_truncation_is_refused(good: Path) -> None:
    """Cut anywhere: in the header it is 'truncated', in the data 'past the end'."""
    data = good.read_bytes()
    header_end = _tensor_offset_field(data, F32_NAME) + 8
    for size in range(_data_end(good)):  # past it lies only the writer's padding
        bad = good.with_name(f"cut{size}.gguf")  # a new file: a kept mapping never shrinks
        bad.write_bytes(data[:size])
        _expect_error(bad, "truncated" if size < header_end else "past the end")


def test_tensor_data_past_the_end(good: Path) -> None:
    bad = _corrupt(good, lambda d: d.__delitem__(slice(_data_end(good) - 1, None)))
    _expect_error(bad, f"tensor '{F32_NAME}' \\(F32, shape \\[3, 4\\]\\): data at offset "
                       r"\d+ to \d+ is past the end of the file")


def test_misaligned_tensor_offset(good: Path) -> None:
    def shift(data: bytearray) -> None:
        at = _tensor_offset_field(data, F32_NAME)
        struct.pack_into("<Q", data, at, struct.unpack_from("<Q", data, at)[0] + 4)

    _expect_error(_corrupt(good, shift), f"tensor '{F32_NAME}'.*: offset \\d+ is not a "
                                         "multiple of the alignment 32")


def test_a_string_array_running_past_the_end(good: Path) -> None:
    def lengthen_first_token(data: bytearray) -> None:
        at = _field_offset(data, "tokenizer.ggml.tokens") + 4 + 8  # item type, length
        struct.pack_into("<Q", data, at, 1 << 40)

    _expect_error(_corrupt(good, lengthen_first_token),
                  "truncated: metadata 'tokenizer.ggml.tokens': 3 strings from offset \\d+ "
                  r"run past the end")


@pytest.mark.parametrize(("alignment", "value_type"), [(24, GGUFValueType.UINT32),
                                                       (0, GGUFValueType.UINT32),
                                                       (32, GGUFValueType.INT32)])
def test_bad_alignment(tmp_path: Path, alignment: int, value_type: GGUFValueType) -> None:
    def set_alignment(data: bytearray) -> None:
        at = _field_offset(data, gguf.KEY_GENERAL_ALIGNMENT)
        struct.pack_into("<II", data, at, value_type, alignment)

    bad = _corrupt(_write_gguf(tmp_path / "aligned.gguf", alignment=64), set_alignment)
    _expect_error(bad, f"general.alignment is {value_type.name} {alignment}; it must be a "
                       "UINT32 power of two")


def test_unknown_value_type(good: Path) -> None:
    bad = _corrupt(good, lambda d: struct.pack_into(
        "<I", d, _field_offset(d, "test.int64"), 13))
    _expect_error(bad, "metadata 'test.int64' has value type 13; allowed: 0 to 12")


def test_unknown_ggml_type(good: Path) -> None:
    def set_type(data: bytearray) -> None:
        struct.pack_into("<I", data, _tensor_offset_field(data, F32_NAME) - 4, 4)  # Q4_2: gone

    _expect_error(_corrupt(good, set_type), f"tensor '{F32_NAME}' has unknown ggml type 4")


def test_rows_not_whole_blocks(good: Path) -> None:
    def retype(data: bytearray) -> None:  # F32 [3, 4] read as Q8_0: 4 is not 32 weights
        struct.pack_into("<I", data, _tensor_offset_field(data, F32_NAME) - 4,
                         GGMLQuantizationType.Q8_0)

    _expect_error(_corrupt(good, retype), "rows of 4 are not whole blocks of 32")


def test_too_many_dims(good: Path) -> None:
    bad = _corrupt(good, lambda d: struct.pack_into("<I", d, _field_offset(d, F32_NAME), 5))
    _expect_error(bad, f"tensor '{F32_NAME}' has 5 dims; at most 4")


def test_duplicate_tensor_name(good: Path) -> None:
    def rename(data: bytearray) -> None:
        at = _field_offset(data, F32_NAME) - len(F32_NAME)
        data[at:at + len(F32_NAME)] = Q8_NAME.encode()

    _expect_error(_corrupt(good, rename), f"tensor '{Q8_NAME}' appears twice")


def test_a_key_that_is_not_utf8(good: Path) -> None:
    def garble(data: bytearray) -> None:
        at = _field_offset(data, "test.unicode") - len("test.unicode")
        data[at] = 0xFF

    _expect_error(_corrupt(good, garble), r"metadata key \d+ at offset \d+ is not UTF-8")


def test_an_empty_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _expect_error(empty, "truncated: the file is empty")
