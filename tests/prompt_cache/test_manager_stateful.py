"""Hypothesis state machines: random engine-like call sequences keep the manager's invariants.

The machine plays the engine, including its KV memory: `kv[(block_id, offset)]` records what a
slot holds, as (salt, every token up to and including this one), since a token's KV depends on
the whole prefix. Each hit must point at slots whose recorded content equals the query's, so an
unverified hit, a cross-tenant hit or a cached block overwritten by another request all fail.
A one-byte hash makes collisions frequent in the second machine.
"""

import hashlib

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ragspeed.prompt_cache.manager import KVCacheManager

BLOCK_SIZE = 2
NUM_BLOCKS = 12
MAX_TOKENS = NUM_BLOCKS * BLOCK_SIZE  # more can never be allocated (allocate_slots raises)

tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)
salts = st.sampled_from([None, "tenant-a"])


class _Request:
    def __init__(self, token_ids, salt, num_computed):
        self.token_ids = list(token_ids)
        self.salt = salt
        self.num_computed = num_computed  # tokens whose KV is written and committed


class ManagerMachine(RuleBasedStateMachine):
    hash_algo = "sha256"

    def __init__(self):
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, hash_algo=self.hash_algo)
        self.requests: dict[str, _Request] = {}
        self.pins: list[list[int]] = []
        self.kv: dict[tuple[int, int], tuple] = {}
        self.next_id = 0

    def write_kv(self, request_id, token_ids, salt, start, end):
        table = self.manager.block_table(request_id)
        for position in range(start, end):
            slot = (table[position // BLOCK_SIZE], position % BLOCK_SIZE)
            self.kv[slot] = (salt, tuple(token_ids[: position + 1]))

    def check_hits(self, token_ids, salt, block_ids, num_computed):
        assert num_computed == len(block_ids) * BLOCK_SIZE
        assert num_computed <= len(token_ids) - 1
        for index, block_id in enumerate(block_ids):
            for offset in range(BLOCK_SIZE):
                position = index * BLOCK_SIZE + offset
                assert self.kv.get((block_id, offset)) == (salt, tuple(token_ids[: position + 1]))

    @rule(token_ids=tokens, salt=salts, chunk=st.integers(1, 8))
    def start_request(self, token_ids, salt, chunk):
        snapshot = self.pool_snapshot()
        block_ids, num_computed = self.manager.get_computed_blocks(token_ids, salt)
        self.check_hits(token_ids, salt, block_ids, num_computed)
        event("hit" if block_ids else "miss")
        request_id = f"r{self.next_id}"
        self.next_id += 1
        end = min(len(token_ids), num_computed + chunk)
        if self.manager.allocate_slots(request_id, end, block_ids) is None:
            assert self.pool_snapshot() == snapshot and not self.manager.has_request(request_id)
            return
        assert self.manager.block_table(request_id)[: len(block_ids)] == block_ids
        self.write_kv(request_id, token_ids, salt, num_computed, end)
        self.manager.cache_blocks(request_id, token_ids, end, salt)
        self.requests[request_id] = _Request(token_ids, salt, end)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), step=st.integers(1, 6), new_tokens=tokens)
    def advance(self, data, step, new_tokens):
        """A prefill chunk or decode steps: more committed tokens (generated past the prompt)."""
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        request = self.requests[request_id]
        end = request.num_computed + step
        if end > MAX_TOKENS:
            return
        while len(request.token_ids) < end:
            request.token_ids.extend(new_tokens)
        snapshot = self.pool_snapshot()
        if self.manager.allocate_slots(request_id, end) is None:
            assert self.pool_snapshot() == snapshot
            return
        self.write_kv(request_id, request.token_ids, request.salt, request.num_computed, end)
        request.num_computed = end
        self.manager.cache_blocks(request_id, request.token_ids, end, request.salt)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), drafts=tokens, num_accepted=st.integers(0, 3))
    def speculate(self, data, drafts, num_accepted):
        """Draft tokens get slots and KV, then all but the accepted ones are trimmed away."""
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        request = self.requests[request_id]
        start = request.num_computed
        sequence = request.token_ids[:start] + drafts
        if len(sequence) > MAX_TOKENS:
            return
        if self.manager.allocate_slots(request_id, len(sequence)) is None:
            return
        self.write_kv(request_id, sequence, request.salt, start, len(sequence))
        accepted = min(num_accepted, len(drafts))
        request.token_ids = sequence[: start + accepted]
        request.num_computed = start + accepted
        self.manager.trim(request_id, request.num_computed)
        self.manager.cache_blocks(request_id, request.token_ids, request.num_computed, request.salt)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        del self.requests[request_id]
        self.manager.free(request_id)
        self.manager.free(request_id)  # idempotent

    @rule(token_ids=tokens, salt=salts)
    def pin(self, token_ids, salt):
        block_ids = self.manager.pin(token_ids, salt)
        # Pinned blocks are a verified cached prefix, the last full block included.
        self.check_hits(token_ids + [0], salt, block_ids, len(block_ids) * BLOCK_SIZE)
        self.pins.append(block_ids)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        self.manager.unpin(self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1))))

    @rule()
    def reset(self):
        self.manager.reset_cache()

    def pool_snapshot(self):
        pool = self.manager.block_pool
        return (
            pool.free_queue.block_ids(),
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {rid: self.manager.block_table(rid) for rid in self.requests},
        )

    @invariant()
    def invariants_hold(self):
        self.manager.check_invariants()  # block_ids, cached below, must follow every change
        for request_id in self.requests:
            assert list(self.manager.block_ids(request_id)) == self.manager.block_table(request_id)
        if self.manager.stats().hash_collisions:
            event("hash collision seen")
        if self.manager.stats().evictions:
            event("eviction seen")
        referenced = sum(1 for block in self.manager.block_pool.blocks if block.ref_cnt > 0)
        assert referenced + self.manager.num_free_blocks == NUM_BLOCKS
        stats = self.manager.stats()
        assert 0 <= stats.hits_tokens <= stats.queries_tokens


class WeakHashMachine(ManagerMachine):
    hash_algo = staticmethod(lambda data: hashlib.sha256(data).digest()[:1])


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestWeakHashMachine = WeakHashMachine.TestCase
TestWeakHashMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
