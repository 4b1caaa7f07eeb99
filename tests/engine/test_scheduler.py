"""The scheduler on literal token lists over a real KVCacheManager (no model)."""

from __future__ import annotations

from ragspeed.engine.native.core.request import Request, RequestStatus
from ragspeed.engine.native.core.sampling import SamplingState
from ragspeed.engine.native.core.scheduler import Scheduler
from ragspeed.engine.protocol import GenerationRequest, SamplingParams
from ragspeed.prompt_cache.manager import KVCacheManager


def make_request(request_id: str, num_prompt: int, max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompt = tuple(range(100 + len(request_id), 100 + len(request_id) + num_prompt))
    return Request(
        GenerationRequest(request_id, prompt, params),
        SamplingState.create(params, (), "cpu"),
        detokenizer=None,
    )


def shape(output) -> list[tuple[str, int, int, tuple[int, ...]]]:
    return [(c.request.request_id, c.start, c.num_tokens, c.block_table) for c in output.chunks]


def finish_step(scheduler: Scheduler, output, next_token: int = 7) -> None:
    """What the engine does after the forward pass: commit KV, append sampled tokens."""
    scheduler.update_computed(output)
    for chunk in output.chunks:
        if chunk.samples:
            chunk.request.all_token_ids.append(next_token)


def test_chunked_prefill_shares_one_token_budget():
    manager = KVCacheManager(16, 4, enable_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=16)
    a, b = make_request("a", 20), make_request("b", 10)
    scheduler.add(a)
    scheduler.add(b)

    out = scheduler.schedule()
    assert shape(out) == [("a", 0, 16, (0, 1, 2, 3))]  # b waits: the budget is spent
    assert not out.chunks[0].samples
    finish_step(scheduler, out)

    out = scheduler.schedule()
    # a's last 4 prompt tokens, then b's whole prompt in the 12 left
    assert shape(out) == [("a", 16, 4, (0, 1, 2, 3, 4)), ("b", 0, 10, (5, 6, 7))]
    assert [c.samples for c in out.chunks] == [True, True]
    finish_step(scheduler, out)

    out = scheduler.schedule()
    assert [c.request.request_id for c in out.decodes] == ["a", "b"]
    assert shape(out) == [("a", 20, 1, (0, 1, 2, 3, 4, 5 + 3)), ("b", 10, 1, (5, 6, 7))]
    assert manager.num_free_blocks == 16 - 9  # a: 6 blocks for 21 tokens, b: 3 for 11


def test_decodes_go_before_prefill_chunks():
    manager = KVCacheManager(32, 4, enable_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=8)
    first, second = make_request("first", 12), make_request("second", 3)
    scheduler.add(first)
    scheduler.add(second)
    finish_step(scheduler, scheduler.schedule())  # first: 8 of 12
    out = scheduler.schedule()  # first: last 4; second: 3
    assert shape(out) == [("first", 8, 4, (0, 1, 2)), ("second", 0, 3, (3,))]
    finish_step(scheduler, out)
    late = make_request("late", 30)
    scheduler.add(late)
    out = scheduler.schedule()
    assert [c.request.request_id for c in out.decodes] == ["first", "second"]
    assert [(c.request.request_id, c.num_tokens) for c in out.prefills] == [("late", 6)]


def test_preemption_frees_the_latest_arrival_and_requeues_it_first():
    manager = KVCacheManager(6, 4, enable_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = make_request("a", 8), make_request("b", 12), make_request("c", 4)
    for r in (a, b, c):
        scheduler.add(r)
    out = scheduler.schedule()
    # a: 2 blocks, b: 3 blocks; c needs 1 block and gets the last one
    assert shape(out) == [("a", 0, 8, (0, 1)), ("b", 0, 12, (2, 3, 4)), ("c", 0, 4, (5,))]
    finish_step(scheduler, out)
    out = scheduler.schedule()
    # every decode needs a new block and the pool is empty: for a, the latest arrival (c) is
    # preempted; for b, b itself is now the latest, so b goes too
    assert out.preempted == ("c", "b")
    assert shape(out) == [("a", 8, 1, (0, 1, 5))]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.WAITING, 0, 1)
    manager.check_invariants()
    finish_step(scheduler, out)
    out = scheduler.schedule()
    # b comes back first (FCFS), recomputing prompt + its output token: 13 tokens, 4 blocks
    assert [(ch.request.request_id, ch.start, ch.num_tokens) for ch in out.chunks] == [("a", 9, 1)]
    assert manager.num_free_blocks == 3  # b's 4 blocks do not fit in 3 yet: nobody overtakes
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_fcfs_head_of_queue_blocks_smaller_requests_behind_it():
    manager = KVCacheManager(4, 4, enable_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    big, small = make_request("big", 12), make_request("small", 2)
    holder = make_request("holder", 4)
    scheduler.add(holder)
    finish_step(scheduler, scheduler.schedule())
    scheduler.add(big)
    scheduler.add(small)
    out = scheduler.schedule()
    # holder decodes into a 2nd block; big needs 3 of the 2 left and waits; small may not pass
    assert shape(out) == [("holder", 4, 1, (0, 1))]
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]


def test_max_num_seqs_caps_the_running_batch():
    manager = KVCacheManager(32, 4, enable_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=2, max_num_batched_tokens=64)
    for name in ("r1", "r2", "r3"):
        scheduler.add(make_request(name, 3))
    out = scheduler.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r1", "r2"]
    assert [r.request_id for r in scheduler.waiting] == ["r3"]


def test_finish_frees_blocks_and_prefix_cache_hits_skip_compute():
    manager = KVCacheManager(16, 4, enable_caching=True)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    first = make_request("x", 10)
    scheduler.add(first)
    out = scheduler.schedule()
    finish_step(scheduler, out)
    scheduler.finish(first, "stop")
    assert manager.num_free_blocks == 16
    again = make_request("y", 10)  # same length id -> same prompt tokens
    scheduler.add(again)
    out = scheduler.schedule()
    # 2 full cached blocks (8 tokens) reused; tokens 8, 9 computed
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(8, 2)]
    assert again.num_cached_tokens == 8
    manager.check_invariants()


def _decode_with_drafts(scheduler: Scheduler, request: Request, drafts: list[int]):
    """Prefill `request`, append its first token 7, then schedule one decode with `drafts`."""
    finish_step(scheduler, scheduler.schedule())
    request.spec_token_ids = drafts
    out = scheduler.schedule()
    scheduler.update_computed(out)
    return out


def test_update_from_output_commits_accepted_drafts_and_trims_rejected_blocks():
    manager = KVCacheManager(8, 4, enable_caching=True)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=16)
    a = make_request("a", 6)  # prompt 101..106
    scheduler.add(a)
    out = _decode_with_drafts(scheduler, a, [8, 9, 10, 11, 12, 13])
    # 7 tokens + 6 drafts need 4 blocks; the decode queries its last token and the drafts
    assert shape(out) == [("a", 6, 7, (0, 1, 2, 3))]
    assert out.chunks[0].draft_token_ids == (8, 9, 10, 11, 12, 13)
    assert a.num_computed_tokens == 7  # the drafts' KV is written, not yet committed

    # Verification accepted drafts 8 and 9, then drew 42 where 10 was proposed.
    a.all_token_ids.extend([8, 9, 42])
    scheduler.update_from_output(out, {"a": [8, 9, 42]})
    assert a.num_computed_tokens == 9  # the prompt, 7, 8 and 9; 42 is the next decode
    assert a.spec_token_ids == []
    assert manager.block_table("a") == [0, 1, 2]  # 10 tokens fit in 3 blocks; block 3 freed
    assert manager.num_free_blocks == 5
    # Blocks 0 and 1 (101..106, 7, 8) are committed: another request with that prefix hits them.
    hit = manager.get_computed_blocks([101, 102, 103, 104, 105, 106, 7, 8, 5], record_stats=False)
    assert hit == ([0, 1], 8)
    manager.check_invariants()

    out = scheduler.schedule()
    assert shape(out) == [("a", 9, 1, (0, 1, 2))]


def test_update_from_output_with_every_draft_rejected_keeps_only_the_decode():
    manager = KVCacheManager(8, 4, enable_caching=True)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=16)
    a = make_request("a", 6)
    scheduler.add(a)
    out = _decode_with_drafts(scheduler, a, [8, 9, 10, 11, 12, 13])
    a.all_token_ids.append(42)  # the first draft was rejected: only the recovered token
    scheduler.update_from_output(out, {"a": [42]})
    assert a.num_computed_tokens == 7
    assert manager.block_table("a") == [0, 1]  # 8 tokens fill 2 blocks; blocks 2 and 3 freed
    assert manager.num_free_blocks == 6
    # Block 1 (105, 106, 7, 42) is full but 42 has no KV yet: only block 0 is cached.
    hit = manager.get_computed_blocks([101, 102, 103, 104, 105, 106, 7, 42, 5], record_stats=False)
    assert hit == ([0], 4)
    manager.check_invariants()


def test_update_from_output_skips_a_request_that_finished_in_its_accepted_drafts():
    manager = KVCacheManager(8, 4, enable_caching=True)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=16)
    a = make_request("a", 6)
    scheduler.add(a)
    out = _decode_with_drafts(scheduler, a, [8, 9, 10])
    a.all_token_ids.append(8)  # a stop token among the accepted drafts ends the request
    scheduler.finish(a, "stop")
    scheduler.update_from_output(out, {"a": [8, 9, 42]})
    assert a.num_computed_tokens == 7
    assert manager.block_table("a") == [] and manager.num_free_blocks == 8
    assert not scheduler.has_unfinished()
    manager.check_invariants()
