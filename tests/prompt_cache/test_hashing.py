import hashlib

import pytest

from ragspeed.prompt_cache.hashing import (
    block_extras,
    encode_block,
    hash_block_tokens,
    hash_request_blocks,
    resolve_hash_function,
)


def test_one_hash_per_full_block_chained_from_the_parent():
    token_ids = list(range(10))
    hashes = hash_request_blocks(token_ids, 4)
    assert len(hashes) == 2  # tokens 8, 9 form a partial block: no hash
    first = hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes == [first, hash_block_tokens(first, [4, 5, 6, 7])]
    assert len(first) == 32  # sha256 digest bytes


def test_sha256_of_the_documented_encoding():
    encoded = encode_block(None, [1, 2], ())
    assert encoded == b"0:16:" + (1).to_bytes(8, "little") + (2).to_bytes(8, "little") + b"()"
    assert hash_block_tokens(None, [1, 2]) == hashlib.sha256(encoded).digest()


def test_a_block_hash_depends_on_everything_before_it():
    a = hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_request_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix


def test_salt_and_model_key_go_into_block_0_and_change_the_whole_chain():
    token_ids = list(range(12))
    plain = hash_request_blocks(token_ids, 4)
    salted = hash_request_blocks(token_ids, 4, cache_salt="tenant-a")
    other = hash_request_blocks(token_ids, 4, cache_salt="tenant-b")
    keyed = hash_request_blocks(token_ids, 4, extra_key="model-x")
    assert all(len({p, s, o, k}) == 4 for p, s, o, k in zip(plain, salted, other, keyed))
    assert block_extras(0, cache_salt="tenant-a", extra_key="model-x") == (
        ("key", "model-x"),
        ("salt", "tenant-a"),
    )
    assert block_extras(1, cache_salt="tenant-a", extra_key="model-x") == ()
    assert block_extras(2, variant=(2, "documents")) == (("variant", "documents"),)
    assert block_extras(3, variant=(2, "documents")) == ()
    # Only block 0 carries the salt; the chain carries it on.
    assert salted[1] == hash_block_tokens(salted[0], [4, 5, 6, 7])


def test_empty_salt_is_no_salt():
    token_ids = [1, 2, 3, 4]
    assert hash_request_blocks(token_ids, 4, cache_salt="") == hash_request_blocks(token_ids, 4)


def test_algorithms_by_name_or_callable():
    assert hash_request_blocks([1, 2], 2, algo="blake2b") != hash_request_blocks([1, 2], 2)
    assert hash_request_blocks([1, 2], 2, algo=lambda data: b"x") == [b"x"]
    with pytest.raises(ValueError, match="hash_algo 'md4'"):
        resolve_hash_function("md4")
    with pytest.raises(ValueError, match="block_size"):
        hash_request_blocks([1], 0)
