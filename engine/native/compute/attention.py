"""Attention that reads K and V through block tables of the paged KV cache.

Terms: a *slot* is one token's place in the pool (`block_id * block_size + offset`); a
request's *context* is every token whose K/V is in the cache when its queries attend (cached
prefix, earlier chunks and this step's tokens). The flat batch puts all decode tokens first
(one query each), then each prefill chunk as a contiguous span of queries.

On CPU, decodes with fp32 queries go to ragspeed's kernel (engine.native.compute.cpu_kernels.attention), which
reads keys and values where they lie in the pool, fp32 or fp16 (`--kv-cache-dtype`); so does a
whole step whose chunks are all small (speculative verification, a draft's catch-up), each
query as a row with its own context length. The SDPA path (the reference for it and for any CUDA kernel) gathers each request's
context blocks out of the pool (whole blocks: few, contiguous copies) and calls SDPA:
- decodes: one batched SDPA call; the query heads of a KV head are grouped as rows
  (`[num_decodes, num_kv_heads, group, head_dim]`), which needs neither a repeat of K/V nor a
  causal mask, only a padding mask when context lengths differ;
- prefill chunks: on CPU with fp32 queries, ragspeed's prefill kernel
  (engine.native.compute.cpu_kernels.attention), which reads the context where it lies in the pool; else two
  calls of SDPA's fused flash kernel each, neither with a mask: the chunk's queries over the
  keys before it (every query sees every one) and over its own keys (causal, square), merged by
  their log-sum-exps (`chunk_attention`); so no [n, context] mask nor score matrix exists at
  long contexts. Elsewhere, one SDPA call with a causal mask shifted by the chunk's start
  (`masked_chunk_attention`, also the reference of the CPU paths).

A *scattered* chunk (engine.native.compute.attention_metadata) computes tokens at arbitrary positions of one
request whose other positions already hold KV (document KV reuse, engine.native.core.document_kv): each
query sees the keys up to its own position, the fresh ones of this step and the reused ones
alike. Its queries are rows of the decode kernel on CPU, or one SDPA call with the mask of their
positions. What a step's attention reads (block tables, context lengths, slots, the spans of its
chunks) is its `AttentionMetadata`, built once per step (engine.native.compute.attention_metadata).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from ragspeed.engine.native.compute.attention_metadata import AttentionMetadata, PrefillSpan
from ragspeed.engine.native.compute.cpu_kernels.attention import (
    decode_kernel_applies,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_kernel_applies,
)
from ragspeed.engine.native.compute.cpu_kernels.placement import write_kernel_applies, write_kv

# The profiler event around the prefill chunks' attention (`ragspeed bench engine` sums it).
PREFILL_ATTENTION_EVENT = "ragspeed::prefill_attention"


def gather_context(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    context_len: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """cache [num_slots, kv_heads, D], block_tables [n, blocks] -> [n, context_len, kv_heads, D],
    in `dtype` (default the cache's: an fp16 pool is widened for fp32 queries).

    Whole blocks are copied (index_select on the block axis: few, contiguous copies), those
    the longest context needs (a table may be wider), then the padding past it is cut off.
    """
    num_slots, num_kv_heads, head_dim = cache.shape
    blocks = cache.view(num_slots // block_size, block_size, num_kv_heads, head_dim)
    n = block_tables.shape[0]
    num_blocks = -(-context_len // block_size)
    gathered = blocks.index_select(0, block_tables[:, :num_blocks].reshape(-1))
    context = gathered.view(n, num_blocks * block_size, num_kv_heads, head_dim)[:, :context_len]
    return context if dtype is None else context.to(dtype)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the pool, attend; returns [num_tokens, num_heads * head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    block_size = meta.block_size
    if write_kernel_applies(k, v, k_cache):
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.num_threads)
    else:
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    out: torch.Tensor | None
    if meta.row_block_tables is not None and decode_kernel_applies(q, num_kv_heads):
        assert meta.row_context_lens is not None  # set with row_block_tables
        out = paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.row_block_tables,
            meta.row_context_lens,
            block_size,
            scale,
            meta.num_threads,
        )
        return out.view(num_tokens, num_heads * head_dim)
    nd = meta.num_decodes
    if nd == num_tokens and nd:
        out = None  # decodes only: SDPA's output is the result
    else:
        out = q.new_empty(num_tokens, num_heads, head_dim)
    if nd and decode_kernel_applies(q, num_kv_heads):
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        od = paged_decode_attention(
            q[:nd],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            block_size,
            scale,
            meta.num_threads,
        )
        if out is None:
            return od.view(num_tokens, num_heads * head_dim)
        out[:nd] = od
    elif nd:
        assert meta.decode_block_tables is not None
        group = num_heads // num_kv_heads
        qd = q[:nd].reshape(nd, num_kv_heads, group, head_dim)
        ctx = meta.decode_context_len
        kd = gather_context(k_cache, meta.decode_block_tables, block_size, ctx, q.dtype).transpose(1, 2)
        vd = gather_context(v_cache, meta.decode_block_tables, block_size, ctx, q.dtype).transpose(1, 2)
        # [nd, kv_heads, group, D]: each KV head's query heads as rows, no K/V repeat needed
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        if out is None:
            return od.reshape(num_tokens, num_heads * head_dim)
        out[:nd] = od.reshape(nd, num_heads, head_dim)
    assert out is not None  # a step of decodes alone returned above
    cpu = q.device.type == "cpu"
    kernel = meta.prefill_kernel and prefill_kernel_applies(q, num_kv_heads)
    with record_function(PREFILL_ATTENTION_EVENT):
        for span in meta.prefills:
            if kernel and span.query_positions is None:
                out[span.query_start : span.query_end] = paged_prefill_attention(
                    q[span.query_start : span.query_end],
                    k_cache,
                    v_cache,
                    span.block_table,
                    span.num_cached,
                    block_size,
                    scale,
                    meta.num_threads,
                    int16_attention=meta.int16_attention,
                )
                continue
            attend = chunk_attention if cpu and span.query_positions is None else masked_chunk_attention
            table = span.block_table.unsqueeze(0)
            # [1, kv_heads, context_len, D]
            kp = gather_context(k_cache, table, block_size, span.context_len, q.dtype).transpose(1, 2)
            vp = gather_context(v_cache, table, block_size, span.context_len, q.dtype).transpose(1, 2)
            qp = q[span.query_start : span.query_end].transpose(0, 1).unsqueeze(0)
            op = attend(qp, kp, vp, span, scale)  # [1, num_heads, n, head_dim]
            out[span.query_start : span.query_end] = op[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)


def masked_chunk_attention(
    q: torch.Tensor,  # [1, num_heads, n, head_dim]
    k: torch.Tensor,  # [1, num_kv_heads, context_len, head_dim]
    v: torch.Tensor,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    """One SDPA call with the span's shifted causal mask: [1, num_heads, n, head_dim]."""
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=span.mask,
        is_causal=span.mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def chunk_attention(
    q: torch.Tensor,  # [1, num_heads, n, head_dim]
    k: torch.Tensor,  # [1, num_kv_heads, context_len, head_dim]
    v: torch.Tensor,
    span: PrefillSpan,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk after `span.num_cached` earlier keys, without a mask, on CPU:
    [1, num_heads, n, head_dim].

    Softmax over all keys is the two partial softmaxes weighted by their share of the total
    mass: out = o_before * w + o_own * (1 - w), w = sigmoid(lse_before - lse_own). The fused
    kernel takes the query heads of a KV head as they are (GQA) and returns the log-sum-exp in
    fp32 for bf16 / fp16 inputs, so the merge runs in that precision.
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cached = span.num_cached
    own, own_lse = flash(q, k[:, :, cached:], v[:, :, cached:], 0.0, True, scale=scale)
    if not cached:  # the kernel cannot take zero keys (it dies of SIGFPE)
        return own
    before, before_lse = flash(q, k[:, :, :cached], v[:, :, :cached], 0.0, False, scale=scale)
    weight = torch.sigmoid(before_lse - own_lse).unsqueeze(-1)  # [1, num_heads, n, 1]
    merged = torch.lerp(own.to(weight.dtype), before.to(weight.dtype), weight)
    return merged.to(q.dtype)
