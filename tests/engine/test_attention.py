"""Paged attention through block tables against dense attention on the same keys."""

from __future__ import annotations

import math

import pytest
import torch

from ragspeed.engine.native.compute import attention as attention_module
from ragspeed.engine.native.compute.attention import chunk_attention, masked_chunk_attention, paged_attention
from ragspeed.engine.native.compute.attention_metadata import (
    SMALL_CHUNK_QUERIES,
    PrefillSpan,
    build_metadata,
    causal_mask,
)
from ragspeed.engine.native.compute.cpu_kernels import load_library


def test_causal_mask_shifts_by_the_cached_prefix():
    assert causal_mask(2, 5, "cpu").int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def dense_reference(q, keys, values, num_cached):
    """q [n, H, D]; keys/values [ctx, Hkv, D] (ctx = num_cached + n): causal GQA attention."""
    n, num_heads, head_dim = q.shape
    group = num_heads // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
    mask = causal_mask(n, keys.shape[0], "cpu")
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)


@pytest.fixture(params=["kernel", "sdpa"])
def decode_path(request, monkeypatch):
    """Decodes through ragspeed's CPU kernel (engine.native.compute.cpu_kernels) or the SDPA reference."""
    if request.param == "kernel" and load_library() is None:
        pytest.skip("ragspeed's CPU kernels could not be built here")
    if request.param == "sdpa":
        monkeypatch.setattr(attention_module, "decode_kernel_applies", lambda q, n: False)
    return request.param


# (num_heads, num_kv_heads, head_dim): GQA 2, bench-135m's 9/3/64, MQA with a head_dim that is
# not a multiple of 16 (the kernel's scalar tail).
HEAD_LAYOUTS = [(4, 2, 8), (9, 3, 64), (8, 1, 20)]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", HEAD_LAYOUTS)
@pytest.mark.parametrize("chunks", ["none", "small", "large"])
def test_mixed_batch_of_decodes_and_chunks_matches_dense_attention(
    decode_path, num_heads, num_kv_heads, head_dim, chunks
):
    """chunks: decodes only; with small chunks (all through the kernel on CPU, each query a
    row); with a chunk longer than SMALL_CHUNK_QUERIES too (decodes in the kernel, chunks SDPA)."""
    torch.manual_seed(0)
    block_size, num_blocks = 4, 64
    k_cache = torch.zeros(num_blocks * block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    # (block table, tokens already cached, new tokens this step): two decodes of different
    # context lengths, a chunk after a cached prefix, and a fresh prefill; tables scattered.
    layout = [([9, 3, 17], 9, 1), ([5], 2, 1), ([30, 1, 12, 7], 6, 7), ([20, 21], 0, 5)]
    if chunks == "none":
        layout = layout[:2]
    elif chunks == "large":
        large = SMALL_CHUNK_QUERIES + 4
        layout.append((list(range(32, 32 + -(-(2 + large) // block_size))), 2, large))
    history = {}
    for i, (table, num_cached, _) in enumerate(layout):
        keys = torch.randn(num_cached, num_kv_heads, head_dim)
        values = torch.randn(num_cached, num_kv_heads, head_dim)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(num_cached)]
        k_cache[slots], v_cache[slots] = keys, values
        history[i] = (keys, values)
    qs, ks, vs, slot_mapping = [], [], [], []
    for table, num_cached, n in layout:
        qs.append(torch.randn(n, num_heads, head_dim))
        ks.append(torch.randn(n, num_kv_heads, head_dim))
        vs.append(torch.randn(n, num_kv_heads, head_dim))
        slot_mapping += [
            table[p // block_size] * block_size + p % block_size for p in range(num_cached, num_cached + n)
        ]
    decodes, prefills = layout[:2], layout[2:]
    meta = build_metadata(
        decode_tables=[t for t, _, _ in decodes],
        decode_context_lens=[c + n for _, c, n in decodes],
        prefill_tables=[t for t, _, _ in prefills],
        prefill_context_lens=[c + n for _, c, n in prefills],
        prefill_num_queries=[n for _, _, n in prefills],
        slot_mapping=slot_mapping,
        block_size=block_size,
        device="cpu",
    )
    assert (meta.row_block_tables is not None) == (chunks == "small")
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, head_dim**-0.5)
    assert out.shape == (sum(n for _, _, n in layout), num_heads * head_dim)
    start = 0
    for i, (_table, num_cached, n) in enumerate(layout):
        keys = torch.cat([history[i][0], ks[i]])
        values = torch.cat([history[i][1], vs[i]])
        expected = dense_reference(qs[i], keys, values, num_cached)
        torch.testing.assert_close(out[start : start + n], expected, atol=1e-5, rtol=1e-5)
        start += n
    # the new K/V landed in their slots
    torch.testing.assert_close(k_cache[slot_mapping], torch.cat(ks))


# (context_len, num_queries): a lone token, a whole prompt, a chunk after 11 cached keys (not a
# multiple of the block size 16), a long prompt, a chunk after 255 keys, one query after 299.
CHUNKS = [(1, 1), (17, 17), (17, 6), (300, 300), (300, 45), (300, 1)]


def span_of(context_len: int, num_queries: int, dtype=torch.float32) -> PrefillSpan:
    table = torch.arange(-(-context_len // 16))
    return PrefillSpan(3, 3 + num_queries, table, context_len, dtype)


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", HEAD_LAYOUTS)
@pytest.mark.parametrize("context_len, num_queries", CHUNKS)
def test_chunk_attention_without_masks_matches_the_masked_sdpa_call(
    num_heads, num_kv_heads, head_dim, context_len, num_queries
):
    torch.manual_seed(0)
    q = torch.randn(1, num_heads, num_queries, head_dim)
    k = torch.randn(1, num_kv_heads, context_len, head_dim)
    v = torch.randn(1, num_kv_heads, context_len, head_dim)
    span = span_of(context_len, num_queries)
    assert span.num_cached == context_len - num_queries
    out = chunk_attention(q, k, v, span, head_dim**-0.5)
    assert out.shape == (1, num_heads, num_queries, head_dim) and out.dtype == torch.float32
    expected = masked_chunk_attention(q, k, v, span, head_dim**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_chunk_attention_in_bf16_merges_in_fp32_and_returns_bf16():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 9, 45, 64), torch.randn(1, 3, 300, 64), torch.randn(1, 3, 300, 64)
    span = span_of(300, 45, torch.bfloat16)
    out = chunk_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), span, 0.125)
    assert out.dtype == torch.bfloat16
    expected = masked_chunk_attention(q, k, v, span_of(300, 45), 0.125)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_the_shifted_mask_is_built_only_for_a_chunk_after_earlier_keys():
    assert span_of(17, 17).mask is None
    assert span_of(5, 2).mask.tolist() == [[0, 0, 0, 0, float("-inf")], [0, 0, 0, 0, 0]]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 2, 8)])
def test_several_long_chunks_and_decodes_match_the_masked_path(
    monkeypatch, decode_path, num_heads, num_kv_heads, head_dim
):
    """paged_attention over a batch of two decodes and three chunks past SMALL_CHUNK_QUERIES
    (no prefix; after 13 cached keys; after 283), fused-kernel path against the masked one."""
    torch.manual_seed(0)
    block_size = 16
    # (block table, tokens already cached, new tokens this step)
    past = SMALL_CHUNK_QUERIES
    layout = [
        ([7], 9, 1),
        ([2, 3], 20, 1),
        (list(range(40, 45)), 0, past + 1),
        (list(range(8, 14)), 13, past + 4),
        (list(range(14, 36)), 283, past + 1),
    ]
    k_cache = torch.randn(64 * block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    num_tokens = sum(n for _, _, n in layout)
    q = torch.randn(num_tokens, num_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim)
    v = torch.randn(num_tokens, num_kv_heads, head_dim)
    slot_mapping = []
    for table, num_cached, n in layout:
        slot_mapping += [
            table[p // block_size] * block_size + p % block_size for p in range(num_cached, num_cached + n)
        ]
    decodes, prefills = layout[:2], layout[2:]

    def attend():
        meta = build_metadata(
            decode_tables=[t for t, _, _ in decodes],
            decode_context_lens=[c + n for _, c, n in decodes],
            prefill_tables=[t for t, _, _ in prefills],
            prefill_context_lens=[c + n for _, c, n in prefills],
            prefill_num_queries=[n for _, _, n in prefills],
            slot_mapping=slot_mapping,
            block_size=block_size,
            device="cpu",
        )
        assert meta.row_block_tables is None  # the chunks are not all small
        assert [s.num_cached for s in meta.prefills] == [0, 13, 283]
        return paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, head_dim**-0.5)

    out = attend()
    monkeypatch.setattr(attention_module, "chunk_attention", masked_chunk_attention)
    torch.testing.assert_close(out, attend(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_large_chunk", [False, True])  # rows of the decode kernel; SDPA
def test_a_scattered_chunk_sees_the_keys_up_to_each_of_its_positions(decode_path, with_large_chunk):
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 4
    k_cache = torch.randn(128 * block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    context = 2 * SMALL_CHUNK_QUERIES + 16
    table = torch.randperm(100, generator=torch.Generator().manual_seed(1))[: context // block_size].tolist()
    positions = sorted(set(range(1, context - 1, 2)) - {9, 11}) + [context - 1]
    assert len(positions) > SMALL_CHUNK_QUERIES  # more queries than a small chunk's
    chunks = [(table, context, len(positions), tuple(positions))]
    large = SMALL_CHUNK_QUERIES + 4
    if with_large_chunk:  # a plain prefill longer than a small chunk beside it
        chunks.append((list(range(100, 100 + -(-large // block_size))), large, large, None))
    num_tokens = sum(n for _, _, n, _ in chunks)
    q = torch.randn(num_tokens, num_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim)
    v = torch.randn(num_tokens, num_kv_heads, head_dim)
    slot_of = lambda t, p: t[p // block_size] * block_size + p % block_size  # noqa: E731
    slot_mapping = [slot_of(table, p) for p in positions]
    if with_large_chunk:
        slot_mapping += [slot_of(chunks[1][0], p) for p in range(large)]
    meta = build_metadata(
        decode_tables=[],
        decode_context_lens=[],
        prefill_tables=[t for t, _, _, _ in chunks],
        prefill_context_lens=[c for _, c, _, _ in chunks],
        prefill_num_queries=[n for _, _, n, _ in chunks],
        slot_mapping=slot_mapping,
        block_size=block_size,
        device="cpu",
        prefill_query_positions=[p for _, _, _, p in chunks],
    )
    assert (meta.row_block_tables is None) == with_large_chunk
    out = paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5).view(
        num_tokens, num_heads, head_dim
    )
    group = num_heads // num_kv_heads
    for i, p in enumerate(positions):  # the pool holds the chunk's new keys where it wrote them
        seen = [slot_of(table, j) for j in range(p + 1)]
        keys = k_cache[seen].repeat_interleave(group, dim=1)  # [p + 1, H, D]
        values = v_cache[seen].repeat_interleave(group, dim=1)
        weights = (torch.einsum("hd,khd->hk", q[i], keys) * head_dim**-0.5).softmax(-1)
        torch.testing.assert_close(out[i], torch.einsum("hk,khd->hd", weights, values), atol=1e-5, rtol=1e-5)
