"""Block hashing: canonical encoding, chaining, cache_salt, cross-process determinism."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.sampling_params import SamplingParams
from services.common.block_hash import (
    NONE_HASH,
    get_request_block_hasher,
    hash_block_tokens,
)
from services.scheduler.request import Request

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_none_hash_is_sha256_of_fixed_seed():
    assert NONE_HASH == hashlib.sha256(b"kvmesh").digest()


def test_encoding_is_parent_then_count_then_int64_le_tokens():
    expected = hashlib.sha256(NONE_HASH + struct.pack("<q", 3) + struct.pack("<3q", 1, 2, 3))
    assert hash_block_tokens(None, [1, 2, 3]) == expected.digest()
    assert hash_block_tokens(NONE_HASH, (1, 2, 3)) == expected.digest()


def test_extra_keys_are_tagged_and_length_prefixed():
    salt = "ab"
    expected = hashlib.sha256(NONE_HASH + struct.pack("<q", 1) + struct.pack("<q", 7)
                              + b"s" + struct.pack("<q", 2) + b"ab")
    assert hash_block_tokens(None, [7], (salt,)) == expected.digest()
    # Same concatenated text, different keys: different hashes.
    assert hash_block_tokens(None, [7], ("ab",)) != hash_block_tokens(None, [7], ("a", "b"))
    assert hash_block_tokens(None, [7], ("1",)) != hash_block_tokens(None, [7], (1,))
    assert hash_block_tokens(None, [7], ()) == hash_block_tokens(None, [7], None)


def test_unsupported_extra_key_type_raises():
    with pytest.raises(TypeError, match="allowed: int, str, bytes"):
        hash_block_tokens(None, [1], (1.5,))


def test_parent_changes_the_hash():
    child_a = hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])
    child_b = hash_block_tokens(hash_block_tokens(None, [9, 2]), [3, 4])
    assert child_a != child_b
    assert len(child_a) == 32


def test_request_hasher_hashes_only_full_blocks_as_a_chain():
    hasher = get_request_block_hasher(4)
    req = Request("r", list(range(10)), SamplingParams(), block_hasher=hasher)
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    assert req.block_hashes == [h0, h1]
    assert hasher(req) == []  # nothing new until another block fills


def test_cache_salt_keys_the_first_block_and_so_the_chain():
    hasher = get_request_block_hasher(4)
    tokens = list(range(8))
    plain = Request("a", tokens, SamplingParams(), block_hasher=hasher)
    salted = Request("b", tokens, SamplingParams(), cache_salt="tenant-1", block_hasher=hasher)
    same_salt = Request("c", tokens, SamplingParams(), cache_salt="tenant-1", block_hasher=hasher)
    assert salted.block_hashes[0] == hash_block_tokens(None, tokens[:4], ("tenant-1",))
    assert salted.block_hashes[1] == hash_block_tokens(salted.block_hashes[0], tokens[4:])
    assert plain.block_hashes[0] != salted.block_hashes[0]
    assert plain.block_hashes[1] != salted.block_hashes[1]
    assert salted.block_hashes == same_salt.block_hashes


def test_hasher_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size is 0, must be >= 1"):
        get_request_block_hasher(0)


_CHILD = """
from services.common.sampling_params import SamplingParams
from services.common.block_hash import get_request_block_hasher
from services.scheduler.request import Request
req = Request("x", list(range(40)), SamplingParams(), cache_salt="s",
              block_hasher=get_request_block_hasher(16))
print(",".join(h.hex() for h in req.block_hashes))
"""


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_hashes_are_identical_in_another_process(hash_seed: str):
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    req = Request("x", list(range(40)), SamplingParams(), cache_salt="s",
                  block_hasher=get_request_block_hasher(16))
    assert out.split(",") == [h.hex() for h in req.block_hashes]
    assert len(req.block_hashes) == 2
