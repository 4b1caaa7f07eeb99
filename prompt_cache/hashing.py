"""Chained block hashes (docs/architecture.md, contract 3).

A *block* is `block_size` consecutive token ids of a prompt; only *full* blocks are hashed and
cached. The hash of block i is `H(hash of block i-1, token ids of block i, extras of block i)`,
so a block hash identifies the whole prefix up to and including that block, not just its tokens.

*Extras* are what the tokens alone do not say: the model fingerprint (`extra_key`) and the
tenant's `cache_salt`. Both go into block 0 only; the chain carries them into every later block,
so two tenants with the same system prompt never produce a common block hash. A *variant*
(first block, tag) marks KV that is not a plain prefill's, a document assembly's: its tag goes
into that block, so the blocks before it stay shared with plain prompts and the blocks from it
on are found only by requests of the same variant.

The hash function is chosen by name from `HASH_FUNCTIONS` (sha256 by default: collision
resistant, safe for several tenants) or passed as a callable `bytes -> bytes` (tests use a weak
one to force collisions). Whatever the function, the manager verifies every hit against the
stored token ids, extras and parent block (block_pool.py), so a collision can only cost a miss,
never wrong KV.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence

# A block hash is the digest bytes of the chosen function (32 bytes for sha256).
BlockHash = bytes
HashFunction = Callable[[bytes], bytes]

HASH_FUNCTIONS: dict[str, HashFunction] = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    # blake2b with a 32-byte digest: as collision resistant (slightly slower than sha256 on CPUs
    # with SHA extensions).
    "blake2b": lambda data: hashlib.blake2b(data, digest_size=32).digest(),
}


def resolve_hash_function(algo: str | HashFunction) -> HashFunction:
    """A name of `HASH_FUNCTIONS`, or a callable `bytes -> bytes` returned as is."""
    if callable(algo):
        return algo
    function = HASH_FUNCTIONS.get(algo)
    if function is None:
        raise ValueError(
            f"unknown hash_algo {algo!r}; choose one of {', '.join(HASH_FUNCTIONS)} or pass a callable"
        )
    return function


# (index of the first block whose KV differs from a plain prefill's, tag)
Variant = tuple[int, str]


def block_extras(
    block_index: int, *, cache_salt: str | None = None, extra_key: str = "", variant: Variant | None = None
) -> tuple:
    """The extras mixed into block `block_index`: tagged (name, value) pairs; the key and the
    salt in block 0 only, a variant's tag in its first block only.

    An empty `cache_salt` counts as no salt. Tags keep a salt from ever equalling an extra key.
    """
    extras: tuple = ()
    if block_index == 0:
        if extra_key:
            extras += (("key", extra_key),)
        if cache_salt:
            extras += (("salt", cache_salt),)
    if variant is not None and block_index == variant[0]:
        extras += (("variant", variant[1]),)
    return extras


@functools.lru_cache(maxsize=64)
def _int64_struct(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<{num_tokens}q")


def encode_block(parent: BlockHash | None, token_ids: Sequence[int], extras: tuple = ()) -> bytes:
    """The unambiguous byte string that is hashed: byte lengths of the parent and the tokens,
    the parent hash, the tokens as little-endian int64, then repr(extras)."""
    parent_bytes = b"" if parent is None else parent
    token_bytes = _int64_struct(len(token_ids)).pack(*token_ids)
    header = b"%d:%d:" % (len(parent_bytes), len(token_bytes))
    return header + parent_bytes + token_bytes + (repr(extras).encode() if extras else b"()")


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extras: tuple = (),
    *,
    algo: str | HashFunction = "sha256",
) -> BlockHash:
    """The chained hash of one block: `algo(parent, token_ids, extras)`."""
    return resolve_hash_function(algo)(encode_block(parent, token_ids, extras))


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    extra_key: str = "",
    algo: str | HashFunction = "sha256",
) -> list[BlockHash]:
    """One chained hash per FULL block of `token_ids` (a trailing partial block gets none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hash_function = resolve_hash_function(algo)
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for index in range(len(token_ids) // block_size):
        block = token_ids[index * block_size : (index + 1) * block_size]
        extras = block_extras(index, cache_salt=cache_salt, extra_key=extra_key)
        parent = hash_function(encode_block(parent, block, extras))
        hashes.append(parent)
    return hashes
