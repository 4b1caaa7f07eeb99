"""Prefix caching inside the native engine: skipped prefill, recomputed tail, chunked prefill,
preemption, tenants and pins; greedy output with and without the cache identical."""

from __future__ import annotations

import pytest

from ragspeed.engine.native.core.prefix_store import pin_prefix, unpin_prefix
from ragspeed.engine.protocol import GenerationRequest, SamplingParams
from tests.engine.conftest import hf_greedy, make_engine, speculate_every_step

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SHARED = tuple(range(10, 50))  # 40 tokens: 5 full blocks of 8


class ComputedTokens:
    """Counts the tokens each step computes (wraps the runner; the model still runs)."""

    def __init__(self, engine):
        self.per_request: dict[str, int] = {}
        execute = engine.runner.execute

        def counting(output):
            for chunk in output.chunks:
                rid = chunk.request.request_id
                self.per_request[rid] = self.per_request.get(rid, 0) + chunk.num_tokens
            return execute(output)

        engine.runner.execute = counting


def run_one(engine, request_id, prompt, salt=None, params=GREEDY):
    return engine.generate([GenerationRequest(request_id, prompt, params, cache_salt=salt)])[request_id]


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    return {
        True: make_engine(tiny_checkpoints["llama"]),
        False: make_engine(tiny_checkpoints["llama"], enable_prefix_caching=False),
    }


def test_shared_full_blocks_skip_prefill_and_the_partial_tail_is_recomputed(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    counter = ComputedTokens(engine)
    first = run_one(engine, "a", SHARED + (60, 61, 62))  # 43 tokens
    second = run_one(engine, "b", SHARED + (70, 71, 72, 73, 74))  # 45: shares 5 full blocks
    # 43 prompt + 7 decodes; the second prefills only 45 - 40 = 5 tokens, then 7 decodes.
    assert (counter.per_request["a"], counter.per_request["b"]) == (50, 12)
    assert (first["num_cached_tokens"], second["num_cached_tokens"]) == (0, 40)
    # A prompt of exactly 5 full blocks: the last block is recomputed (its last token's logits).
    exact = run_one(engine, "c", SHARED)
    assert exact["num_cached_tokens"] == 32 and counter.per_request["c"] == 8 + 7
    engine.manager.check_invariants()


def test_greedy_output_identical_with_and_without_cache(engines, hf_models):
    prompts = [SHARED + (60 + i, 61 + i, 62 + i) for i in range(3)]
    outputs = {}
    for caching, engine in engines.items():
        outputs[caching] = [run_one(engine, f"g{caching}{i}", p)["token_ids"] for i, p in enumerate(prompts)]
    assert outputs[True] == outputs[False]
    assert outputs[True][2] == hf_greedy(hf_models["llama"], list(prompts[2]), 8)


def test_cache_hits_under_chunked_prefill_and_preemption_keep_greedy_output(tiny_checkpoints):
    # 16 blocks of 8 tokens; chunks of at most 16 tokens per step: four 45-token requests at once
    # cannot all fit, so the latest is preempted and prefilled again, from the cache.
    kwargs = dict(num_kv_cache_tokens=128, max_num_batched_tokens=16, max_model_len=96)
    cached = make_engine(tiny_checkpoints["llama"], **kwargs)
    plain = make_engine(tiny_checkpoints["llama"], enable_prefix_caching=False, **kwargs)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    requests = [
        GenerationRequest(f"r{i}", SHARED + (60 + i, 70 + i, 80 + i, 90 + i, 99), params) for i in range(4)
    ]
    with_cache = cached.generate(requests)
    without = plain.generate(requests)
    assert cached.scheduler.num_preemptions > 0
    assert {k: v["token_ids"] for k, v in with_cache.items()} == {
        k: v["token_ids"] for k, v in without.items()
    }
    assert cached.stats()["prefix_cache_hits_tokens"] > 0
    cached.manager.check_invariants()
    assert cached.manager.num_free_blocks == cached.manager.num_blocks


def test_two_tenants_with_the_same_prompt_never_share_a_block(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    first_deltas = {}
    engine.add_request(GenerationRequest("t1", SHARED + (60,), GREEDY, cache_salt="tenant-a"))
    outputs = engine.step()  # prefilled and cached, still running: its blocks are held
    engine.add_request(GenerationRequest("t2", SHARED + (60,), GREEDY, cache_salt="tenant-b"))
    outputs += engine.step()
    for out in outputs:
        first_deltas.setdefault(out.request_id, out.delta.num_cached_tokens)
    assert first_deltas == {"t1": 0, "t2": 0}  # the second tenant's first token shows no hit
    table_a, table_b = engine.manager.block_table("t1"), engine.manager.block_table("t2")
    assert set(table_a).isdisjoint(table_b)
    while engine.has_unfinished():
        engine.step()
    again = run_one(engine, "t3", SHARED + (61,), salt="tenant-b")
    assert again["num_cached_tokens"] == 40  # its own tenant hits
    assert run_one(engine, "t4", SHARED + (61,), salt=None)["num_cached_tokens"] == 0


def test_pinned_blocks_survive_eviction_and_unpin_releases_them(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"], num_kv_cache_tokens=256, max_model_len=96)
    run_one(engine, "w", SHARED + (60,))
    block_ids = pin_prefix(engine, SHARED, None)
    assert len(block_ids) == 5
    # Fill the rest of the pool with other prompts, twice over: unpinned blocks get evicted.
    for i in range(4):
        run_one(engine, f"x{i}", tuple(range(100 + i, 180 + i)))
    assert run_one(engine, "hit", SHARED + (61,))["num_cached_tokens"] == 40
    unpin_prefix(engine, block_ids)
    for i in range(4):
        run_one(engine, f"y{i}", tuple(range(200 + i, 280 + i)))
    assert run_one(engine, "miss", SHARED + (62,))["num_cached_tokens"] == 0
    engine.manager.check_invariants()


def test_draft_tokens_never_enter_the_cache(tiny_checkpoints):
    # A repetitive prompt makes the n-gram proposer draft; rejected drafts must leave no block.
    engine = make_engine(tiny_checkpoints["llama"], speculative="ngram", num_speculative_tokens=4)
    speculate_every_step(engine)
    plain = make_engine(tiny_checkpoints["llama"], enable_prefix_caching=False)
    prompt = tuple(range(10, 22)) * 4
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    out = run_one(engine, "s", prompt, params=params)
    assert engine.stats()["spec_draft_tokens"] > 0  # drafts were proposed (and mostly rejected)
    assert out["token_ids"] == run_one(plain, "p", prompt, params=params)["token_ids"]
    committed = list(prompt) + out["token_ids"]
    bs = engine.manager.block_size
    committed_blocks = {tuple(committed[i : i + bs]) for i in range(0, len(committed) - bs + 1, bs)}
    cached = [block.token_ids for block in engine.manager.block_pool.cached_blocks.values()]
    assert cached and set(cached) <= committed_blocks
    engine.manager.check_invariants()
