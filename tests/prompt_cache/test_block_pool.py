import pytest

from ragspeed.prompt_cache.block_pool import BlockPool


def test_free_queue_pops_left_appends_right_and_removes_from_the_middle():
    pool = BlockPool(5)
    queue = pool.free_queue
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    assert queue.popleft().block_id == 0
    queue.remove(pool.blocks[2])
    assert queue.block_ids() == [1, 3, 4]
    queue.append(pool.blocks[2])
    queue.append(pool.blocks[0])
    assert queue.block_ids() == [1, 3, 4, 2, 0]
    assert queue.num_free_blocks == 5
    queue.check()


def test_get_new_blocks_evicts_the_hash_of_the_popped_block():
    pool = BlockPool(3)
    [block] = pool.get_new_blocks(1)
    assert pool.cache_block(block, b"h0", (1, 2), None, None, ()) is block
    pool.free_blocks([block])  # ref 0, cached, at the tail: [1, 2, 0]
    assert pool.free_queue.block_ids() == [1, 2, 0]
    assert pool.get_cached_block(b"h0", (1, 2), None, ()) == (block, False)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 0]
    assert pool.cached_blocks == {} and pool.num_evictions == 1
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)


def test_cached_lookup_checks_content_and_refuses_duplicates():
    pool = BlockPool(4)
    first, twin, other, child = pool.get_new_blocks(4)
    assert pool.cache_block(first, b"h", (1, 2), None, None, ()) is first
    assert first.cache_id == 0
    # Same content: the twin stays uncached and the cached block is returned.
    assert pool.cache_block(twin, b"h", (1, 2), None, None, ()) is first
    assert twin.block_hash is None
    # Same hash, other content: a collision, nothing cached.
    assert pool.cache_block(other, b"h", (9, 9), None, None, ()) is None
    assert pool.get_cached_block(b"h", (1, 3), None, ()) == (None, True)
    assert pool.get_cached_block(b"h", (1, 2), 7, ()) == (None, True)  # other parent
    assert pool.get_cached_block(b"h", (1, 2), None, (("salt", "a"),)) == (None, True)
    assert pool.get_cached_block(b"g", (1, 2), None, ()) == (None, False)
    # A child names its parent by cache id, which a re-cached parent does not keep.
    assert pool.cache_block(child, b"c", (3, 4), b"h", first.cache_id, ()) is child
    assert pool.get_cached_block(b"c", (3, 4), 0, ()) == (child, False)
    pool.free_blocks([first])
    pool.get_new_blocks(1)  # evicts `first`
    assert pool.cache_block(first, b"h", (1, 2), None, None, ()).cache_id == 2
    assert pool.get_cached_block(b"c", (3, 4), 2, ()) == (None, True)  # orphan: a miss


def test_reset_keeps_referenced_cached_blocks():
    pool = BlockPool(2)
    held, freed = pool.get_new_blocks(2)
    pool.cache_block(held, b"a", (1,), None, None, ())
    pool.cache_block(freed, b"b", (2,), None, None, ())
    pool.free_blocks([freed])
    assert pool.reset_prefix_cache() is False
    assert list(pool.cached_blocks) == [b"a"] and freed.block_hash is None
    pool.free_blocks([held])
    assert pool.reset_prefix_cache() is True


def test_num_blocks_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
