"""Block hashing: the prefix cache's keys (vLLM V1's hash_block_tokens).

Block hashes must agree across processes (frontends, schedulers and Redis all
compare them), so they are sha256 over a canonical byte encoding, never
Python's salted ``hash()`` or pickle.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Protocol

BlockHash = bytes

# Parent of every first block: a fixed value, the same in every process.
NONE_HASH: BlockHash = hashlib.sha256(b"kvmesh").digest()

_INT64 = struct.Struct("<q")


class HashedTokens(Protocol):
    """What a block hasher reads of a request (``Request`` has these attributes)."""

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def block_hashes(self) -> list[BlockHash]: ...

    @property
    def cache_salt(self) -> str | None: ...


# Returns the hashes of the request's FULL blocks not yet in ``block_hashes``.
BlockHasher = Callable[[HashedTokens], list[BlockHash]]


def _encode_extra_key(key: object) -> bytes:
    """Type tag + length + payload, so that ("ab",) and ("a", "b") differ."""
    if isinstance(key, bool) or not isinstance(key, (int, str, bytes)):
        raise TypeError(
            f"extra key {key!r} has type {type(key).__name__}; allowed: int, str, bytes")
    if isinstance(key, int):
        return b"i" + _INT64.pack(key)
    payload = key.encode() if isinstance(key, str) else key
    return (b"s" if isinstance(key, str) else b"b") + _INT64.pack(len(payload)) + payload


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """sha256(parent hash, little-endian int64 token ids, extra keys).

    ``parent_block_hash`` None means "first block" and hashes as NONE_HASH, so
    the hash of a block depends on every token before it.
    """
    h = hashlib.sha256(parent_block_hash if parent_block_hash is not None else NONE_HASH)
    h.update(_INT64.pack(len(curr_block_token_ids)))
    h.update(struct.pack(f"<{len(curr_block_token_ids)}q", *curr_block_token_ids))
    for key in extra_keys or ():
        h.update(_encode_extra_key(key))
    return h.digest()


def get_request_block_hasher(block_size: int) -> BlockHasher:
    """Returns f(request) -> hashes of its FULL blocks not yet in ``request.block_hashes``.

    ``cache_salt`` is an extra key of the first block only: every later hash
    chains through it, so the salt isolates the whole sequence.
    """
    if block_size < 1:
        raise ValueError(f"block_size is {block_size}, must be >= 1")

    def request_block_hasher(request: HashedTokens) -> list[BlockHash]:
        token_ids = request.all_token_ids
        start = len(request.block_hashes) * block_size
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes: list[BlockHash] = []
        while start + block_size <= len(token_ids):
            salted = start == 0 and request.cache_salt is not None
            extra_keys = (request.cache_salt,) if salted else None
            parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra_keys)
            new_hashes.append(parent)
            start += block_size
        return new_hashes

    return request_block_hasher
