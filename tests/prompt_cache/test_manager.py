"""KVCacheManager on small pools with literal block ids (in the manner of vLLM's
tests/v1/core/test_prefix_caching.py). Block size 4 throughout; a fresh pool hands out ids
0, 1, 2, ... in order."""

import hashlib

import pytest

from ragspeed.prompt_cache.hashing import hash_request_blocks
from ragspeed.prompt_cache.manager import KVCacheManager

COMMON = list(range(8))  # two full blocks shared by the requests below


def run_prefill(manager, request_id, token_ids, cache_salt=None):
    """What the engine does for a new request: look up, allocate, (prefill), cache."""
    computed, num_computed = manager.get_computed_blocks(token_ids, cache_salt)
    new = manager.allocate_slots(request_id, len(token_ids), computed)
    if new is not None:
        manager.cache_blocks(request_id, token_ids, len(token_ids), cache_salt)
    return computed, num_computed, new


def test_prefill_hit_free_order_and_eviction_of_tail_blocks_first():
    manager = KVCacheManager(num_blocks=10, block_size=4)

    assert run_prefill(manager, "0", COMMON + [100, 101, 102]) == ([], 0, [0, 1, 2])
    assert manager.stats().num_cached_blocks == 2  # block 2 is partial: not cached

    # Same two full blocks: a hit on 0 and 1, one new block for the rest.
    assert run_prefill(manager, "1", COMMON + [200, 201, 202]) == ([0, 1], 8, [3])
    assert manager.block_table("1") == [0, 1, 3]
    assert [manager.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]

    manager.free("0")  # reverse order: 2 reaches zero; 1 and 0 still held by "1"
    manager.free("1")  # reverse order: 3, 1, 0
    assert manager.block_pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert manager.num_free_blocks == 10 and manager.usage == 0.0
    manager.check_invariants()

    # Pressure: a fresh 36-token request takes every free block; 1 goes before 0.
    fresh = list(range(1000, 1036))
    assert manager.allocate_slots("2", 28) == [4, 5, 6, 7, 8, 9, 2]
    assert manager.allocate_slots("2", 32) == [3]
    assert manager.allocate_slots("2", 36) == [1]
    assert manager.stats().evictions == 1
    assert manager.get_computed_blocks(COMMON + [300]) == ([0], 4)
    manager.cache_blocks("2", fresh, 36)
    manager.check_invariants()

    stats = manager.stats()
    # Requests "0" and "1" count; the last lookup was never followed by an allocation.
    assert (stats.queries_tokens, stats.hits_tokens, stats.num_requests) == (22, 8, 2)
    assert stats.hit_rate == pytest.approx(8 / 22)
    assert stats.usage == 0.9 and stats.num_cached_blocks == 10


def test_the_last_prompt_token_is_always_recomputed():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    run_prefill(manager, "0", COMMON)
    manager.free("0")
    assert manager.get_computed_blocks(COMMON) == ([0], 4)  # 8 tokens: at most 7 computed
    assert manager.get_computed_blocks(COMMON + [9]) == ([0, 1], 8)
    assert manager.get_computed_blocks([]) == ([], 0)
    assert manager.get_computed_blocks(COMMON[:4]) == ([], 0)


def test_tenants_with_the_same_prompt_never_share_a_block():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prompt = COMMON + [50]
    assert run_prefill(manager, "a", prompt, "tenant-a") == ([], 0, [0, 1, 2])
    assert manager.get_computed_blocks(prompt, "tenant-b") == ([], 0)
    assert manager.get_computed_blocks(prompt) == ([], 0)
    assert run_prefill(manager, "b", prompt, "tenant-b") == ([], 0, [3, 4, 5])
    assert manager.get_computed_blocks(prompt, "tenant-a") == ([0, 1], 8)
    assert manager.get_computed_blocks(prompt, "tenant-b") == ([3, 4], 8)
    assert manager.stats().num_cached_blocks == 4
    manager.check_invariants()


def test_a_variants_blocks_are_shared_before_its_first_block_and_its_own_from_it_on():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    prompt = COMMON + list(range(50, 59))  # 4 full blocks and a token
    variant = (2, "documents:reuse")
    computed, _ = manager.get_computed_blocks(prompt)
    manager.allocate_slots("assembled", len(prompt), computed)
    manager.cache_blocks("assembled", prompt, len(prompt), variant=variant)
    manager.free("assembled")
    assert manager.get_computed_blocks(prompt) == ([0, 1], 8)  # a plain prompt: blocks 0-1 only
    assert manager.get_computed_blocks(prompt, variant=variant) == ([0, 1, 2, 3], 16)
    assert manager.get_computed_blocks(prompt, variant=(2, "documents:sink")) == ([0, 1], 8)
    assert manager.get_computed_blocks(prompt, variant=(3, "documents:reuse")) == ([0, 1], 8)
    manager.check_invariants()


def test_a_model_key_separates_managers_like_a_salt():
    prompt = COMMON + [1]
    hashes = []
    for key in ("model-a", "model-b"):
        manager = KVCacheManager(num_blocks=4, block_size=4, extra_key=key)
        run_prefill(manager, "r", prompt)
        hashes.append(manager.block_pool.blocks[0].block_hash)
    assert hashes[0] != hashes[1]


def test_a_hash_collision_is_never_a_hit():
    # Every block hashes to the same bytes: the first cached block owns the hash.
    manager = KVCacheManager(num_blocks=8, block_size=4, hash_algo=lambda data: b"same")
    assert run_prefill(manager, "0", COMMON + [9]) == ([], 0, [0, 1, 2])
    assert manager.stats().num_cached_blocks == 1  # block 1 collides: left uncached
    # Same first block: a verified hit; second block's hash points at block 0's content: miss.
    assert manager.get_computed_blocks(COMMON + [9]) == ([0], 4)
    # Different tokens, same hash: refused.
    assert manager.get_computed_blocks([7, 7, 7, 7, 7]) == ([], 0)
    assert manager.stats().hash_collisions == 2
    manager.check_invariants()


def hash_ignoring_the_parent(data: bytes) -> bytes:
    """A broken hash: only the block's own tokens and extras count (see encode_block)."""
    parent_length, _, rest = data.split(b":", 2)
    return hashlib.sha256(rest[int(parent_length) :]).digest()


def test_a_hit_is_verified_against_the_whole_prefix_not_just_its_block():
    manager = KVCacheManager(num_blocks=8, block_size=4, hash_algo=hash_ignoring_the_parent)
    # Blocks 0 and 1 hold the same tokens, so they collide; block 2 chains from block 1's hash,
    # which equals block 0's. Caching stops at the first collision.
    run_prefill(manager, "a", [1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 0])
    assert manager.stats().num_cached_blocks == 1
    # Block 2's KV belongs to the prefix 1111 1111; this prompt's prefix is 1111.
    assert manager.get_computed_blocks([1, 1, 1, 1, 3, 3, 3, 3, 0]) == ([0], 4)
    manager.check_invariants()


def test_identical_blocks_computed_concurrently_are_not_duplicated():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prompt = COMMON + [9]
    # Both look up before either has cached anything (batched prefill).
    assert manager.get_computed_blocks(prompt) == ([], 0)
    assert manager.allocate_slots("a", 9) == [0, 1, 2]
    assert manager.allocate_slots("b", 9) == [3, 4, 5]
    manager.cache_blocks("a", prompt, 9)
    manager.cache_blocks("b", prompt, 9)
    assert sorted(b.block_id for b in manager.block_pool.cached_blocks.values()) == [0, 1]
    manager.free("a")
    manager.free("b")
    assert manager.get_computed_blocks(prompt) == ([0, 1], 8)
    manager.check_invariants()


def test_allocate_slots_is_all_or_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    run_prefill(manager, "a", COMMON + [9])  # blocks 0, 1 cached, 2 partial
    manager.free("a")  # free list: [3, 2, 1, 0]
    assert manager.allocate_slots("c", 4) == [3]  # free list: [2, 1, 0]

    computed, num_computed = manager.get_computed_blocks(COMMON + [10])
    assert (computed, num_computed) == ([0, 1], 8)
    # Two new blocks plus the two free cached ones: 4 > 3 free. Nothing may change.
    assert manager.allocate_slots("b", 16, computed) is None
    assert not manager.has_request("b") and manager.block_table("b") == []
    assert manager.block_pool.free_queue.block_ids() == [2, 1, 0]
    assert manager.stats().num_cached_blocks == 2 and manager.stats().evictions == 0

    assert manager.allocate_slots("b", 12, computed) == [2]
    assert manager.block_table("b") == [0, 1, 2]
    assert manager.allocate_slots("b", 13) is None  # pool empty; the table is unchanged
    assert manager.allocate_slots("b", 12) == []  # already covered
    assert manager.block_table("b") == [0, 1, 2]
    manager.check_invariants()


def test_a_request_looked_up_again_while_waiting_counts_once():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    run_prefill(manager, "warm", COMMON + [1])
    manager.free("warm")
    assert manager.allocate_slots("big", 8) == [3, 2]  # leaves 0, 1 (cached) free
    prompt = COMMON + [2, 3, 4, 5, 6]  # needs 4 blocks: 2 hits + 2 new, only 2 free
    for _ in range(3):  # the scheduler retries every step
        computed, num_computed = manager.get_computed_blocks(prompt)
        assert manager.allocate_slots("waiting", len(prompt), computed) is None
    manager.free("big")
    computed, num_computed = manager.get_computed_blocks(prompt)
    assert manager.allocate_slots("waiting", len(prompt), computed) == [2, 3]
    stats = manager.stats()
    assert (stats.queries_tokens, stats.hits_tokens, stats.num_requests) == (9 + 13, 8, 2)
    # A preempted request coming back is looked up without stats, and a lookup whose request
    # was not admitted is not charged to the next one admitted.
    manager.free("waiting")
    manager.get_computed_blocks([5] * 20)  # would need 5 blocks: never admitted
    computed, _ = manager.get_computed_blocks(prompt, record_stats=False)
    manager.allocate_slots("waiting", len(prompt), computed)
    assert manager.stats().num_requests == 2


def test_allocate_slots_refuses_what_can_never_succeed():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="num_tokens"):
        manager.allocate_slots("a", -1)
    with pytest.raises(ValueError, match="needs 5 blocks; the pool has 4"):
        manager.allocate_slots("a", 17)
    with pytest.raises(ValueError, match="block 0 is not cached"):
        manager.allocate_slots("a", 4, [0])
    run_prefill(manager, "a", COMMON + [1])
    with pytest.raises(ValueError, match="first allocate_slots call only"):
        manager.allocate_slots("a", 12, [0])
    with pytest.raises(ValueError, match="out of range"):
        manager.allocate_slots("b", 4, [9])
    with pytest.raises(ValueError, match="block 1 does not continue the hash chain"):
        manager.allocate_slots("b", 8, [1])  # block 1 alone: its parent is block 0
    with pytest.raises(ValueError, match="block 0 does not continue the hash chain"):
        manager.allocate_slots("b", 8, [0, 0])
    with pytest.raises(ValueError, match="unknown request_id"):
        manager.cache_blocks("zzz", COMMON, 8)
    manager.check_invariants()


def test_trim_rolls_back_draft_blocks_but_never_cached_ones():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prompt = [1, 2, 3, 4, 5]
    run_prefill(manager, "a", prompt)  # blocks [0, 1]; block 0 cached
    assert manager.allocate_slots("a", 5 + 6) == [2]  # six draft tokens need block 2
    assert manager.trim("a", 11) == []
    assert manager.trim("a", 7) == [2]  # two drafts accepted: 7 tokens fit in 2 blocks
    assert manager.block_table("a") == [0, 1]
    assert manager.block_pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 2]
    with pytest.raises(ValueError, match="would drop cached"):
        manager.trim("a", 3)
    with pytest.raises(ValueError, match="unknown request_id"):
        manager.trim("b", 0)
    manager.check_invariants()


def test_block_ids_is_one_tuple_until_the_table_changes():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    run_prefill(manager, "a", [1, 2, 3, 4, 5])
    table = manager.block_ids("a")
    assert table == (0, 1)
    assert manager.allocate_slots("a", 8) == [] and manager.block_ids("a") is table
    assert manager.allocate_slots("a", 9) == [2]  # a new block: a new tuple
    grown = manager.block_ids("a")
    assert grown == (0, 1, 2) and table == (0, 1)
    manager.trim("a", 8)
    assert manager.block_ids("a") == (0, 1) and manager.block_ids("a") is not grown
    manager.free("a")
    assert manager.block_ids("a") == ()


def test_pinned_blocks_survive_pressure_until_unpinned():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    run_prefill(manager, "warm", COMMON)
    assert manager.pin(COMMON) == [0, 1]  # all full blocks, the last token included
    manager.free("warm")
    assert manager.num_free_blocks == 2 and manager.num_pinned_blocks == 2

    assert manager.allocate_slots("x", 8) == [2, 3]
    assert manager.allocate_slots("y", 4) is None  # pinned blocks are not evictable
    manager.free("x")
    assert manager.allocate_slots("y", 8) == [3, 2]
    assert manager.get_computed_blocks(COMMON + [9]) == ([0, 1], 8)

    manager.unpin([0, 1])
    assert manager.block_pool.free_queue.block_ids() == [1, 0]  # tail block evicted first
    with pytest.raises(ValueError, match="not pinned"):
        manager.unpin([0])
    assert manager.pin([99] * 8) == []  # nothing cached: nothing pinned
    manager.check_invariants()


def test_free_is_idempotent_and_ignores_unknown_ids():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    run_prefill(manager, "a", COMMON + [1])
    manager.free("a")
    manager.free("a")
    manager.free("never-seen")
    assert manager.num_free_blocks == 4
    manager.check_invariants()


def test_reset_cache_drops_only_unreferenced_blocks():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    run_prefill(manager, "a", COMMON + [1])
    run_prefill(manager, "b", [5] * 9)
    manager.free("b")
    assert manager.reset_cache() is False  # "a" still holds two cached blocks
    assert manager.stats().num_cached_blocks == 2
    assert manager.get_computed_blocks([5] * 9) == ([], 0)
    manager.free("a")
    assert manager.reset_cache() is True
    assert manager.get_computed_blocks(COMMON + [1]) == ([], 0)
    manager.check_invariants()


def test_caching_disabled_allocates_without_hits():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    assert run_prefill(manager, "a", COMMON + [1]) == ([], 0, [0, 1, 2])
    manager.free("a")
    assert run_prefill(manager, "b", COMMON + [1]) == ([], 0, [3, 4, 5])
    assert manager.pin(COMMON) == []
    stats = manager.stats()
    assert (stats.queries_tokens, stats.hits_tokens, stats.num_cached_blocks) == (18, 0, 0)
    manager.check_invariants()


def test_chunked_prefill_caches_blocks_as_they_fill():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(20, 33))  # 13 tokens
    assert manager.allocate_slots("a", 6) == [0, 1]
    manager.cache_blocks("a", prompt, 6)
    assert manager.stats().num_cached_blocks == 1
    assert manager.allocate_slots("a", 13) == [2, 3]
    manager.cache_blocks("a", prompt, 13)
    assert manager.stats().num_cached_blocks == 3
    # Decoded tokens extend the sequence; the next full block is cached too.
    sequence = prompt + [7, 7, 7]
    assert manager.allocate_slots("a", 16) == []
    manager.cache_blocks("a", sequence, 16)
    assert manager.get_computed_blocks(sequence + [1]) == ([0, 1, 2, 3], 16)
    with pytest.raises(ValueError, match="exceeds the 4 blocks"):
        manager.cache_blocks("a", sequence + [1] * 4, 20)
    manager.check_invariants()


def test_constructor_validates_its_parameters():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError, match="hash_algo"):
        KVCacheManager(num_blocks=4, block_size=4, hash_algo="crc")


def test_stats_to_dict_has_every_number():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    run_prefill(manager, "a", COMMON + [1])
    run_prefill(manager, "b", COMMON + [2])
    assert manager.stats().to_dict() == {
        "queries_tokens": 18,
        "hits_tokens": 8,
        "num_cached_blocks": 2,
        "usage": 1.0,
        "evictions": 0,
        "hash_collisions": 0,
        "num_requests": 2,
        "hit_rate": 8 / 18,
    }


def test_block_hashes_equal_hash_request_blocks():
    manager = KVCacheManager(num_blocks=8, block_size=4, extra_key="model-x")
    prompt = list(range(30, 43))
    run_prefill(manager, "a", prompt, "tenant")
    cached = [manager.block_pool.blocks[i].block_hash for i in manager.block_table("a")[:3]]
    assert cached == hash_request_blocks(prompt, 4, cache_salt="tenant", extra_key="model-x")


def test_commit_speculative_caches_accepted_blocks_and_drops_rejected_ones():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    prompt = [1, 2, 3, 4, 5]
    run_prefill(manager, "a", prompt)  # blocks [0, 1]; block 0 cached
    assert manager.allocate_slots("a", 5 + 6) == [2]  # six draft tokens need block 2
    # Drafts 6, 7, 8 accepted, then 9 drawn: 9 tokens, the first 8 with KV.
    tokens = prompt + [6, 7, 8, 9]
    assert manager.commit_speculative("a", tokens, 8) == []  # 9 tokens still need block 2
    assert manager.block_table("a") == [0, 1, 2]
    assert manager.get_computed_blocks(tokens, record_stats=False) == ([0, 1], 8)
    manager.check_invariants()
