"""Greedy outputs of the native engine equal transformers `generate()` token for token."""

from __future__ import annotations

import pytest

from ragspeed.engine.native.compute import attention as attention_module
from ragspeed.engine.native.compute.attention_metadata import SMALL_CHUNK_QUERIES
from ragspeed.engine.protocol import GenerationRequest, SamplingParams
from tests.engine.conftest import FAMILIES, assert_all_blocks_free, hf_greedy, make_engine

# 8 requests of different lengths: (prompt length, max_tokens)
SHAPES = [(3, 12), (17, 20), (33, 8), (8, 16), (50, 10), (21, 24), (64, 6), (12, 18)]


def prompt_of(i: int, length: int) -> list[int]:
    return [(7 * i + 13 * j) % 380 + 2 for j in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_interleaved(engine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    """Add request i just before step i, so requests join while others decode or prefill."""
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    pending = list(requests)
    while pending or engine.has_unfinished():
        if pending:
            engine.add_request(pending.pop(0))
        for out in engine.step():
            outputs[out.request_id].extend(out.delta.token_ids)
    return outputs


@pytest.mark.parametrize("family", FAMILIES)
def test_one_request_matches_transformers(family, tiny_checkpoints, hf_models):
    engine = make_engine(tiny_checkpoints[family])
    prompt = prompt_of(1, 40)
    result = engine.generate([GenerationRequest("r0", tuple(prompt), greedy(24))])
    assert result["r0"]["token_ids"] == hf_greedy(hf_models[family], prompt, 24)
    assert result["r0"]["finish_reason"] == "length"
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "mode, overrides",
    [
        # prompts of up to 64 tokens in chunks of at most 16 tokens per step, shared by all
        ("chunked_prefill", dict(max_num_batched_tokens=16)),
        # 18 blocks of 8 tokens: the 8 requests need ~60 blocks together
        ("preemption", dict(num_kv_cache_tokens=144, max_model_len=128)),
    ],
)
def test_interleaved_requests_match_transformers(family, mode, overrides, tiny_checkpoints, hf_models):
    engine = make_engine(tiny_checkpoints[family], **overrides)
    requests = [
        GenerationRequest(f"r{i}", tuple(prompt_of(i, n)), greedy(m)) for i, (n, m) in enumerate(SHAPES)
    ]
    outputs = run_interleaved(engine, requests)
    for i, (n, m) in enumerate(SHAPES):
        assert outputs[f"r{i}"] == hf_greedy(hf_models[family], prompt_of(i, n), m), f"r{i}"
    if mode == "preemption":
        assert engine.scheduler.num_preemptions > 0
    else:
        assert engine.num_steps > sum(n for n, _ in SHAPES) // 16
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
def test_long_chunks_after_earlier_chunks_match_transformers(
    family, attention, monkeypatch, tiny_checkpoints, hf_models
):
    """Chunks past SMALL_CHUNK_QUERIES, so prefills take the layer-by-layer path (the prefill
    kernel, or SDPA's in chunk_attention), after cached keys whose count is not a multiple of
    the block size."""
    num_cached = []
    kernel, sdpa = attention_module.paged_prefill_attention, attention_module.chunk_attention

    def kernel_spy(q, k_cache, v_cache, table, cached, *args, **kwargs):
        num_cached.append(cached)
        return kernel(q, k_cache, v_cache, table, cached, *args, **kwargs)

    def sdpa_spy(q, k, v, span, scale):
        num_cached.append(span.num_cached)
        return sdpa(q, k, v, span, scale)

    monkeypatch.setattr(attention_module, "paged_prefill_attention", kernel_spy)
    monkeypatch.setattr(attention_module, "chunk_attention", sdpa_spy)
    budget = SMALL_CHUNK_QUERIES + 21
    shapes = [(n + SMALL_CHUNK_QUERIES, m) for n, m in SHAPES]
    engine = make_engine(tiny_checkpoints[family], max_num_batched_tokens=budget)
    engine.runner.prefill_kernel = attention == "kernel"
    requests = [
        GenerationRequest(f"r{i}", tuple(prompt_of(i, n)), greedy(m)) for i, (n, m) in enumerate(shapes)
    ]
    outputs = run_interleaved(engine, requests)
    for i, (n, m) in enumerate(shapes):
        assert outputs[f"r{i}"] == hf_greedy(hf_models[family], prompt_of(i, n), m), f"r{i}"
    assert 0 in num_cached  # a first chunk
    assert any(c % 8 for c in num_cached)  # a chunk after an unaligned prefix (block size 8)
    assert_all_blocks_free(engine)
