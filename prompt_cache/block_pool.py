"""KV blocks, their reference counts, and the O(1) LRU free list (vLLM v1's `BlockPool`).

A block is *referenced* while a request's block table or a pin holds it (`ref_cnt > 0`), and
*free* otherwise. A free block may still be *cached*: it keeps its hash and stored token ids, so
a later request can take it back out of the free list (a hit). Allocation pops the free list from
its head and evicts the popped block's hash, so the free list order is the eviction order:
least recently freed first.

Invariant: a block is in the free list exactly when `ref_cnt == 0`, and at most once;
`cached_blocks[h] is b` exactly when `b.block_hash == h`.

Verification. A cached block stores its token ids, extras and its parent's *cache id* (a number
unique to each caching of a block). A hit must match all three, the parent being the block hit
just before it, so a hit is verified against the whole prefix, not only against its own tokens:
even a weak hash whose parent hashes collide can cost a miss, never wrong KV. A child whose parent
was evicted and cached again (under a new cache id) becomes unreachable until it is evicted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ragspeed.prompt_cache.hashing import BlockHash


@dataclass(eq=False, slots=True)
class Block:
    """One KV block. The engine owns the tensor memory; this is only its bookkeeping."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is cached: its chained hash and the exact content that produced it,
    # kept so that every hit is verified (a hash collision becomes a miss, never wrong KV).
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    parent_hash: BlockHash | None = None  # the hash chained into this one (for re-hashing)
    extras: tuple = ()
    cache_id: int | None = None  # unique to this caching of the block
    parent_cache_id: int | None = None  # the cache id of the parent block; None for block 0
    # Links of the doubly linked free list; None when not in it (or at its ends).
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)

    def reset_hash(self) -> None:
        self.block_hash = None
        self.token_ids = ()
        self.parent_hash = None
        self.extras = ()
        self.cache_id = None
        self.parent_cache_id = None


class FreeBlockQueue:
    """A doubly linked list of free blocks with sentinels: O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(block_id=-1)  # sentinels: never handed out
        self._tail = Block(block_id=-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free block")
        assert block is not None  # between the sentinels every block has both links
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: Block) -> None:
        """Unlink a block from anywhere in the list (a cache hit on a free block)."""
        previous, following = block.prev_free, block.next_free
        assert previous is not None and following is not None, f"block {block.block_id} is not free"
        previous.next_free = following
        following.prev_free = previous
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order (for tests)."""
        return [block.block_id for block in self]

    def check(self) -> None:
        """Assert the links are consistent both ways and the count is right."""
        count, previous, block = 0, self._head, self._head.next_free
        while block is not self._tail:
            assert block is not None, f"broken forward link after block {previous.block_id}"
            assert block.prev_free is previous, f"broken back link at block {block.block_id}"
            count += 1
            previous, block = block, block.next_free
        assert self._tail.prev_free is previous, "broken tail link"
        assert count == self.num_free_blocks, f"free count {self.num_free_blocks} != {count} linked"


class BlockPool:
    """All `num_blocks` blocks, the free list, and the map of cached blocks by hash."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)  # initially ids 0, 1, 2, ... in order
        self.cached_blocks: dict[BlockHash, Block] = {}
        self.num_evictions = 0
        self._next_cache_id = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Pop `num_blocks` from the head of the free list, evicting their hashes; ref_cnt 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, only {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        del self.cached_blocks[block.block_hash]
        block.reset_hash()
        self.num_evictions += 1

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference; a free (cached) block leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[Block]) -> None:
        """Drop a reference; blocks reaching zero join the free list's tail in the given order."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed with ref_cnt {block.ref_cnt}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(
        self,
        block: Block,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        parent_hash: BlockHash | None,
        parent_cache_id: int | None,
        extras: tuple,
    ) -> Block | None:
        """Enter a full block in the cache and return the cached block that now holds its content:
        `block` itself; or, if an identical block is cached already, that twin (`block` stays
        uncached: no duplicates); or None if the hash is taken by other content (a collision)."""
        assert block.block_hash is None, f"block {block.block_id} is already cached"
        holder = self.cached_blocks.get(block_hash)
        if holder is not None:
            same = (holder.token_ids, holder.parent_cache_id, holder.extras) == (
                token_ids,
                parent_cache_id,
                extras,
            )
            return holder if same else None
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_hash = parent_hash
        block.parent_cache_id = parent_cache_id
        block.extras = extras
        block.cache_id = self._next_cache_id
        self._next_cache_id += 1
        self.cached_blocks[block_hash] = block
        return block

    def get_cached_block(
        self,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        parent_cache_id: int | None,
        extras: tuple,
    ) -> tuple[Block | None, bool]:
        """(block, collided): the cached block whose hash AND content match, else None. The
        content is the token ids, the extras and the parent (by cache id).

        `collided` is True when a block has this hash but other content (a hash collision, or a
        child orphaned by its parent's eviction).
        """
        block = self.cached_blocks.get(block_hash)
        if block is None:
            return None, False
        content = (block.token_ids, block.parent_cache_id, block.extras)
        if content != (token_ids, parent_cache_id, extras):
            return None, True
        return block, False

    def reset_prefix_cache(self) -> bool:
        """Drop the hash of every unreferenced cached block; True if the cache is now empty."""
        for block_hash, block in list(self.cached_blocks.items()):
            if block.ref_cnt == 0:
                del self.cached_blocks[block_hash]
                block.reset_hash()
        return not self.cached_blocks
