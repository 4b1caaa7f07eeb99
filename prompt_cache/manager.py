"""`KVCacheManager`: the engine's one door to the block pool and the prefix cache (vLLM v1 style).

The scheduler's cycle for a request:

1. `get_computed_blocks(token_ids, cache_salt)` -> (cached block ids, num_computed_tokens): the
   longest prefix of full blocks already cached. No references are taken yet.
2. `allocate_slots(request_id, num_tokens, computed_blocks)` -> new block ids, or None for "not
   now" (the pool is short; nothing changed). The first call takes the computed blocks. Later
   calls grow the block table as prefill chunks, decoded tokens and draft tokens need slots.
3. `cache_blocks(request_id, token_ids, num_computed_tokens, cache_salt)` after each step writes
   KV: the newly full blocks of committed tokens enter the cache. Draft tokens are never passed.
4. `commit_speculative(request_id, token_ids, num_computed_tokens)` after a step that verified
   draft tokens: the accepted drafts' full blocks enter the cache and the rejected drafts' blocks
   are dropped (`trim`); `free(request_id)` when finished, aborted or preempted.

Terms: a *computed* token has its KV in the request's blocks; a *cached* block is a full block
with a hash in the pool's map, reusable by any request with the same prefix and salt; a *pinned*
block carries an extra reference from `pin` (a registered static prompt) and is never evicted.

The last prompt token is always recomputed (`num_computed_tokens <= len(token_ids) - 1`), because
its logits are needed to sample the first output token.

Call `get_computed_blocks` and the first `allocate_slots` of a request back to back, with no other
allocation between them (as vLLM's scheduler does): a block found by the lookup could otherwise be
evicted and reused before it is taken. Allocation raises if a computed block lost its hash or the
blocks do not form one hash chain, but cannot see every such reuse.

A prefix restored from disk enters the cache like a prefill: `allocate_slots(tmp_id, n)`, copy the
KV into those blocks, `cache_blocks(tmp_id, token_ids, n)`, `pin(token_ids)`, `free(tmp_id)`.

Not thread-safe: one engine loop owns the manager.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from ragspeed.prompt_cache.block_pool import Block, BlockPool
from ragspeed.prompt_cache.hashing import (
    BlockHash,
    HashFunction,
    Variant,
    block_extras,
    encode_block,
    resolve_hash_function,
)
from ragspeed.prompt_cache.stats import PrefixCacheStats


@dataclass
class _RequestState:
    """What the manager remembers of one request between calls."""

    blocks: list[Block] = field(default_factory=list)  # the block table, in token order
    # Chained hashes of the request's leading full committed blocks, computed once each (a
    # duplicate block left uncached still needs its hash as the next block's parent).
    block_hashes: list[BlockHash] = field(default_factory=list)
    # The cache id of the cached block holding the content of the last hashed block (the request's
    # own block, or an identical twin cached before it); None before block 0. Once a block cannot
    # be cached (its hash is taken by other content), no later block of the request is.
    chain_cache_id: int | None = None
    chain_broken: bool = False
    # `blocks`' ids as a tuple, made when first asked for after the table changed (block_ids).
    table: tuple[int, ...] | None = None

    @property
    def num_cached_blocks(self) -> int:
        """Leading blocks already through `cache_blocks` (or taken as hits)."""
        return len(self.block_hashes)


class KVCacheManager:
    """Block tables of running requests over one `BlockPool`, with hash-chained prefix caching."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        hash_algo: str | HashFunction = "sha256",
        extra_key: str = "",
    ) -> None:
        """`extra_key` is the model (and tokenizer) fingerprint mixed into every chain's block 0,
        so blocks of one model are never hits for another; `hash_algo` a name of
        `prompt_cache.hashing.HASH_FUNCTIONS` or a callable `bytes -> bytes`."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.extra_key = extra_key
        self._hash = resolve_hash_function(hash_algo)
        self.block_pool = BlockPool(num_blocks)
        self._requests: dict[str, _RequestState] = {}
        self._pin_counts: Counter[int] = Counter()  # block id -> references held by pins
        self._queries_tokens = 0
        self._hits_tokens = 0
        self._hash_collisions = 0
        self._num_requests = 0
        # (query tokens, hit tokens) of the last lookup, counted once its request is admitted.
        self._pending_stats: tuple[int, int] | None = None

    # ----------------------------------------------------------------- pool state

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached-but-free ones included (they are evictable)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of all blocks referenced by a request or a pin."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order (empty for an unknown request)."""
        state = self._requests.get(request_id)
        return [] if state is None else [block.block_id for block in state.blocks]

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """`block_table` as a tuple: the same object until the table changes, so a reader that
        keeps what it was last handed knows at a glance whether a table is new (the model
        runner's step buffers write a request's row only then: engine.native.compute.step_buffers)."""
        state = self._requests.get(request_id)
        if state is None:
            return ()
        if state.table is None:
            state.table = tuple(block.block_id for block in state.blocks)
        return state.table

    def has_request(self, request_id: str) -> bool:
        """Whether the request holds a block table (allocated and not freed)."""
        return request_id in self._requests

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------------- lookups

    def _block_key(
        self,
        token_ids: Sequence[int],
        index: int,
        parent: BlockHash | None,
        cache_salt: str | None,
        variant: Variant | None = None,
    ) -> tuple[BlockHash, tuple[int, ...], tuple]:
        """(hash, token ids, extras) of full block `index` of `token_ids`."""
        tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
        extras = block_extras(index, cache_salt=cache_salt, extra_key=self.extra_key, variant=variant)
        return self._hash(encode_block(parent, tokens, extras)), tokens, extras

    def _find_cached_prefix(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        max_blocks: int,
        variant: Variant | None = None,
    ) -> list[Block]:
        """The cached blocks of the longest verified prefix of at most `max_blocks` full blocks.

        Hashing stops at the first miss, so a prompt with no hit costs one block hash here.
        """
        hits: list[Block] = []
        parent: BlockHash | None = None
        parent_cache_id: int | None = None
        for index in range(max_blocks):
            block_hash, tokens, extras = self._block_key(token_ids, index, parent, cache_salt, variant)
            block, collided = self.block_pool.get_cached_block(block_hash, tokens, parent_cache_id, extras)
            if collided:
                self._hash_collisions += 1
            if block is None:
                break
            hits.append(block)
            parent, parent_cache_id = block_hash, block.cache_id
        return hits

    def get_computed_blocks(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        *,
        record_stats: bool = True,
        variant: Variant | None = None,
    ) -> tuple[list[int], int]:
        """Longest prefix of FULL blocks already cached (each hit verified against the stored
        token ids, extras and parent block, so against the whole prefix), capped so that at
        least the last prompt token is recomputed (num_computed_tokens <= len-1, a multiple of
        block_size). Returns (block_ids, num_computed_tokens). Takes no references; records
        query/hit stats in tokens unless `record_stats` is False (a preempted request coming
        back, say).

        The stats are counted when the next first `allocate_slots` of a request succeeds, so a
        waiting request looked up again every step until the pool has room counts once."""
        if not self.enable_caching or not token_ids:
            block_ids, num_computed_tokens = [], 0
        else:
            max_blocks = (len(token_ids) - 1) // self.block_size
            hits = self._find_cached_prefix(token_ids, cache_salt, max_blocks, variant)
            block_ids = [block.block_id for block in hits]
            num_computed_tokens = len(hits) * self.block_size
        # Replaces any earlier uncounted lookup: only the one right before an admission counts.
        recorded = record_stats and len(token_ids) > 0
        self._pending_stats = (len(token_ids), num_computed_tokens) if recorded else None
        return block_ids, num_computed_tokens

    def peek_num_cached_tokens(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """`get_computed_blocks`'s token count, recording nothing: an estimate another thread
        may ask for (each lookup is one dict read; the pool may change meanwhile)."""
        if not self.enable_caching or not token_ids:
            return 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        return len(self._find_cached_prefix(token_ids, cache_salt, max_blocks)) * self.block_size

    def _commit_pending_stats(self) -> None:
        if self._pending_stats is None:
            return
        num_query_tokens, num_hit_tokens = self._pending_stats
        self._pending_stats = None
        self._num_requests += 1
        self._queries_tokens += num_query_tokens
        self._hits_tokens += num_hit_tokens

    # ----------------------------------------------------------------- allocation

    def allocate_slots(
        self, request_id: str, num_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Make the request's block table cover `num_tokens` tokens in total. On the first call
        for a request, `computed_blocks` (from get_computed_blocks) are taken first (ref+1,
        removed from the free list). Returns the NEWLY allocated block ids (possibly empty), or
        None if the free pool cannot supply them — in which case nothing changed (all or
        nothing). Allocation evicts least-recently-freed cached blocks (dropping their hash).

        Raises ValueError for what can never succeed: negative `num_tokens`, more blocks than the
        pool has, `computed_blocks` on a later call or naming blocks that are not cached."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        num_required = self.num_blocks_for(num_tokens)
        if num_required > self.num_blocks:
            raise ValueError(
                f"num_tokens={num_tokens} needs {num_required} blocks; the pool has {self.num_blocks}"
            )
        state = self._requests.get(request_id)
        computed = self._validate_computed_blocks(request_id, state, computed_blocks)
        num_held = len(computed) + (0 if state is None else len(state.blocks))
        num_new = max(0, num_required - num_held)
        # A computed block that is free still sits in the free list: taking it uses a free slot.
        num_free_computed = sum(1 for block in computed if block.ref_cnt == 0)
        if num_new + num_free_computed > self.block_pool.num_free_blocks:
            return None

        if state is None:
            state = self._requests[request_id] = _RequestState()
            self.block_pool.touch(computed)  # before allocating, so they cannot be evicted
            state.blocks.extend(computed)
            # Computed blocks are cached blocks: each has its hash.
            state.block_hashes = [block.block_hash for block in computed if block.block_hash is not None]
            state.chain_cache_id = computed[-1].cache_id if computed else None
            self._commit_pending_stats()
        new_blocks = self.block_pool.get_new_blocks(num_new)
        if new_blocks:
            state.blocks.extend(new_blocks)
            state.table = None
        return [block.block_id for block in new_blocks]

    def _validate_computed_blocks(
        self, request_id: str, state: _RequestState | None, computed_blocks: Sequence[int]
    ) -> list[Block]:
        if not computed_blocks:
            return []
        if state is not None:
            raise ValueError(
                f"computed_blocks given for request {request_id!r}, which already has blocks;"
                " pass them on its first allocate_slots call only"
            )
        blocks: list[Block] = []
        for block_id in computed_blocks:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"computed_blocks: block id {block_id} out of range")
            block = self.block_pool.blocks[block_id]
            if block.block_hash is None:
                raise ValueError(
                    f"computed_blocks: block {block_id} is not cached (evicted since the lookup?)"
                )
            parent_cache_id = blocks[-1].cache_id if blocks else None
            if block.parent_cache_id != parent_cache_id:
                raise ValueError(
                    f"computed_blocks: block {block_id} does not continue the hash chain"
                    " (pass get_computed_blocks' result unchanged, right after the lookup)"
                )
            blocks.append(block)
        return blocks

    def cache_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        cache_salt: str | None = None,
        variant: Variant | None = None,
    ) -> None:
        """The engine has written KV for token_ids[:num_computed_tokens]; every FULL block among
        them not yet cached gets its hash and enters the cache (if an identical block is already
        cached under another id, keep it uncached — no duplicates). Draft tokens are never
        passed here. Unknown requests are an error; each block is hashed once per request."""
        state = self._requests.get(request_id)
        if state is None:
            raise ValueError(f"cache_blocks: unknown request_id {request_id!r}")
        if not 0 <= num_computed_tokens <= len(token_ids):
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} outside [0, len(token_ids)={len(token_ids)}]"
            )
        num_full_blocks = num_computed_tokens // self.block_size
        if num_full_blocks > len(state.blocks):
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} exceeds the {len(state.blocks)} blocks"
                f" allocated to request {request_id!r}"
            )
        if not self.enable_caching or num_full_blocks <= state.num_cached_blocks:
            return
        # The hot loop of a prefill with no hit (hashing every block once), kept inline.
        hashes, blocks, block_size = state.block_hashes, state.blocks, self.block_size
        cache_block, hash_function = self.block_pool.cache_block, self._hash
        for index in range(state.num_cached_blocks, num_full_blocks):
            parent = hashes[index - 1] if index else None
            tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
            extras = block_extras(index, cache_salt=cache_salt, extra_key=self.extra_key, variant=variant)
            block_hash = hash_function(encode_block(parent, tokens, extras))
            hashes.append(block_hash)
            if state.chain_broken:
                continue
            # A fresh block never holds a hash (allocation evicts it). If an identical block is
            # cached already, this one stays uncached and the twin continues the chain.
            holder = cache_block(blocks[index], block_hash, tokens, parent, state.chain_cache_id, extras)
            if holder is None:
                state.chain_broken = True
            else:
                state.chain_cache_id = holder.cache_id

    def trim(self, request_id: str, num_tokens: int) -> list[int]:
        """Drop blocks beyond those needed for num_tokens (speculative rollback); returns freed
        ids (those whose ref count reached zero; shared ones stay referenced by others).
        Trimming into the request's cached blocks is refused: their content is committed."""
        state = self._requests.get(request_id)
        if state is None:
            raise ValueError(f"trim: unknown request_id {request_id!r}")
        if num_tokens < state.num_cached_blocks * self.block_size:
            raise ValueError(
                f"trim: num_tokens={num_tokens} would drop cached (committed) tokens of request"
                f" {request_id!r}, which hold {state.num_cached_blocks * self.block_size}"
            )
        num_keep = self.num_blocks_for(num_tokens)
        dropped = state.blocks[num_keep:]
        del state.blocks[num_keep:]
        state.table = None
        # Trimmed blocks hold uncommitted (draft) tokens: no hash, so their order does not matter
        # for the cache; reverse keeps the convention of `free`.
        self.block_pool.free_blocks(reversed(dropped))
        return [block.block_id for block in dropped if block.ref_cnt == 0]

    def commit_speculative(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        cache_salt: str | None = None,
        variant: Variant | None = None,
    ) -> list[int]:
        """A step verified draft tokens: `token_ids` are the request's tokens after it (accepted
        drafts and the recovered or bonus token appended), the first `num_computed_tokens` of
        them with KV written (the last one's KV is computed by the next step). Their full blocks
        enter the cache; the blocks beyond `len(token_ids)` tokens, which held only rejected
        drafts, are dropped. Returns the freed block ids, as `trim`."""
        self.cache_blocks(request_id, token_ids, num_computed_tokens, cache_salt, variant)
        return self.trim(request_id, len(token_ids))

    def free(self, request_id: str) -> None:
        """Release a finished/aborted request: ref-1 on each block; zero-ref blocks go to the
        free list in reverse order (tail blocks evicted first, as vLLM). Unknown ids ignored.
        Idempotent."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        self.block_pool.free_blocks(reversed(state.blocks))

    # ----------------------------------------------------------------- pins

    def pin(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """An extra reference on the cached full blocks of this prefix (all of its full blocks,
        the last token included), so they are never evicted. Returns the pinned block ids: the
        longest cached prefix, possibly shorter than the prompt (the caller prefills first)."""
        if not self.enable_caching:
            return []
        hits = self._find_cached_prefix(token_ids, cache_salt, len(token_ids) // self.block_size)
        self.block_pool.touch(hits)
        for block in hits:
            self._pin_counts[block.block_id] += 1
        return [block.block_id for block in hits]

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Drop the references taken by `pin` (pass its result back). Unpinned blocks stay cached
        and become evictable. Raises ValueError for a block this manager did not pin."""
        counts = Counter(block_ids)
        for block_id, count in counts.items():
            if self._pin_counts[block_id] < count:
                raise ValueError(f"unpin: block {block_id} is not pinned {count} time(s)")
        for block_id in block_ids:
            self._pin_counts[block_id] -= 1
            if not self._pin_counts[block_id]:
                del self._pin_counts[block_id]
        # Reverse: the prefix's tail blocks become the first to be evicted, as in `free`.
        self.block_pool.free_blocks(self.block_pool.blocks[i] for i in reversed(list(block_ids)))

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by at least one pin."""
        return len(self._pin_counts)

    # ----------------------------------------------------------------- maintenance

    def reset_cache(self) -> bool:
        """Drop all unreferenced cached blocks' hashes. True if the cache is now empty; False if
        referenced (running or pinned) cached blocks remain cached."""
        return self.block_pool.reset_prefix_cache()

    def stats(self) -> PrefixCacheStats:
        """A snapshot of the counters (tokens) and the pool's state."""
        return PrefixCacheStats(
            queries_tokens=self._queries_tokens,
            hits_tokens=self._hits_tokens,
            num_cached_blocks=len(self.block_pool.cached_blocks),
            usage=self.usage,
            evictions=self.block_pool.num_evictions,
            hash_collisions=self._hash_collisions,
            num_requests=self._num_requests,
        )

    def check_invariants(self) -> None:
        """For tests: raise AssertionError if the bookkeeping is inconsistent.

        Every block is either referenced or in the free list, exactly once; its ref count equals
        the block tables and pins holding it; the cache map and the blocks' hashes agree, and
        every cached block's hash recomputes from its stored content."""
        pool = self.block_pool
        pool.free_queue.check()
        free_ids = pool.free_queue.block_ids()
        assert len(free_ids) == len(set(free_ids)), "a block is in the free list twice"
        holders: Counter[int] = Counter(self._pin_counts)
        for request_id, state in self._requests.items():
            ids = [block.block_id for block in state.blocks]
            assert len(ids) == len(set(ids)), f"request {request_id!r} holds a block twice"
            holders.update(ids)
            assert state.num_cached_blocks <= len(state.blocks)
            assert state.table in (None, tuple(ids)), f"request {request_id!r}: block_ids is stale"
        free_set = set(free_ids)
        for block in pool.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {holders[block.block_id]} holders"
            )
            assert (block.ref_cnt == 0) == (block.block_id in free_set), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free list:"
                f" {block.block_id in free_set}"
            )
            if block.block_hash is not None:
                assert pool.cached_blocks.get(block.block_hash) is block, "cached map out of sync"
                content = encode_block(block.parent_hash, block.token_ids, block.extras)
                recomputed = self._hash(content)
                assert recomputed == block.block_hash, f"block {block.block_id}: stale hash"
                assert len(block.token_ids) == self.block_size
        by_cache_id = {block.cache_id: block for block in pool.cached_blocks.values()}
        assert len(by_cache_id) == len(pool.cached_blocks), "two cached blocks share a cache id"
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash, "cached map holds a block under another hash"
            assert (block.parent_cache_id is None) == (block.parent_hash is None)
            parent = by_cache_id.get(block.parent_cache_id)
            if parent is not None:
                assert parent.block_hash == block.parent_hash, "parent cache id and hash disagree"
