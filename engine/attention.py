"""Attention that reads K and V through block tables of the paged KV cache.

Terms: a *slot* is one token's place in the pool (`block_id * block_size + offset`); a
request's *context* is every token whose K/V is in the cache when its queries attend (cached
prefix, earlier chunks and this step's tokens). The flat batch puts all decode tokens first
(one query each), then each prefill chunk as a contiguous span of queries.

On CPU, decodes with fp32 queries go to ragspeed's kernel (engine.cpu_kernels.attention), which
reads keys and values where they lie in the pool, fp32 or fp16 (`--kv-cache-dtype`); so does a
whole step whose chunks are all small (speculative verification, a draft's catch-up), each
query as a row with its own context length. The SDPA path (the reference for it and for any CUDA kernel) gathers each request's
context blocks out of the pool (whole blocks: few, contiguous copies) and calls SDPA:
- decodes: one batched SDPA call; the query heads of a KV head are grouped as rows
  (`[num_decodes, num_kv_heads, group, head_dim]`), which needs neither a repeat of K/V nor a
  causal mask, only a padding mask when context lengths differ;
- prefill chunks: on CPU, two calls of SDPA's fused flash kernel each, neither with a mask: the
  chunk's queries over the keys before it (every query sees every one) and over its own keys
  (causal, square), merged by their log-sum-exps (`chunk_attention`); so no [n, context] mask
  nor score matrix exists at long contexts. Elsewhere, one SDPA call with a causal mask shifted
  by the chunk's start (`masked_chunk_attention`, also the reference of the CPU path).

A *scattered* step (`scattered_metadata`) computes tokens at arbitrary positions of one request
whose other positions already hold KV (document KV reuse, engine.document_kv): each query sees
the keys up to its own position, the fresh ones of this step and the reused ones alike. Its
queries are rows of the decode kernel on CPU, or one SDPA call with the mask of their positions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from ragspeed.engine.cpu_kernels.attention import decode_kernel_applies, paged_decode_attention


@dataclass(frozen=True)
class PrefillSpan:
    query_start: int  # index of the chunk's first token in the flat batch
    query_end: int
    block_table: torch.Tensor  # [num_blocks] blocks holding the chunk's whole context
    context_len: int  # keys the chunk attends to: cached prefix, earlier chunks, itself
    dtype: torch.dtype  # of the additive mask
    # A scattered chunk's query positions [num_queries] int64; None: the chunk's queries are
    # the last positions of its context, in order.
    query_positions: torch.Tensor | None = None

    @property
    def num_cached(self) -> int:
        """Keys before the chunk's first query: cached prefix and earlier chunks."""
        return self.context_len - (self.query_end - self.query_start)

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[num_queries, context_len] 0 / -inf for `masked_chunk_attention`, built on its first
        use (once a step, not per layer); None when plainly causal (no keys before the chunk:
        SDPA's is_causal aligns the diagonal top-left)."""
        if self.query_positions is not None:
            cols = torch.arange(self.context_len, device=self.query_positions.device)
            return additive(cols.unsqueeze(0) <= self.query_positions.unsqueeze(1), self.dtype)
        if not self.num_cached:
            return None
        num_queries = self.query_end - self.query_start
        return additive(causal_mask(num_queries, self.context_len, self.block_table.device), self.dtype)


@dataclass(frozen=True)
class AttentionMetadata:
    """Built once per step by the model runner, shared by all layers. What only the SDPA path
    reads (the decode padding mask, the prefill spans) is built on its first use: steps whose
    queries all go to the decode kernel never build it."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded with block 0
    decode_context_len: int  # the longest decode context (gathered keys are cut there)
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64
    # Each prefill chunk, in batch order after the decodes: (block table, context length,
    # number of queries, its query positions when scattered, else None).
    prefill_chunks: tuple[tuple[list[int], int, int, tuple[int, ...] | None], ...]
    block_size: int
    dtype: torch.dtype = torch.float32  # of the additive masks
    # When every chunk has at most SMALL_CHUNK_QUERIES queries: each query of the flat batch as
    # a row of the decode kernel, [num_tokens, max_blocks] and [num_tokens] int64; else None.
    row_block_tables: torch.Tensor | None = None
    row_context_lens: torch.Tensor | None = None
    # Threads of the decode-attention kernel: the engine's count, like the linear products
    # (its tasks, one per sequence and KV head, read the KV pool from memory in parallel).
    num_threads: int = 1

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor | None:
        """[num_decodes, 1, 1, decode_context_len] 0 / -inf; None when all decode contexts are
        equally long."""
        lens = self.decode_context_lens
        if lens is None or int(lens.min()) == self.decode_context_len:
            return None
        cols = torch.arange(self.decode_context_len, device=lens.device)
        valid = (cols.unsqueeze(0) < lens.unsqueeze(1)).view(len(lens), 1, 1, -1)
        return additive(valid, self.dtype)

    @functools.cached_property
    def prefills(self) -> tuple[PrefillSpan, ...]:
        """The prefill chunks as SDPA's spans: queries in the flat batch, blocks."""
        device = self.slot_mapping.device
        spans = []
        start = self.num_decodes
        for table, context_len, num_queries, positions in self.prefill_chunks:
            table_t = padded_tables([table], -(-context_len // self.block_size), device)[0]
            query_positions = None
            if positions is not None:
                query_positions = torch.tensor(positions, dtype=torch.long, device=device)
            span = PrefillSpan(start, start + num_queries, table_t, context_len, self.dtype, query_positions)
            spans.append(span)
            start += num_queries
        return tuple(spans)


# Chunks of at most this many queries (1 + k for verification, a prefill chunk beside decodes)
# go to the decode kernel, their step to the fused decoder on the blocked products: measured on
# SmolLM2's Q4_1 blocks (AVX-512), a 64-token prompt costs 0.76 ms a token there against 0.99 ms
# layer by layer, where oneDNN's packed products and SDPA win only on chunks of hundreds.
SMALL_CHUNK_QUERIES = 64
# The profiler event around the prefill chunks' attention (`ragspeed bench engine` sums it).
PREFILL_ATTENTION_EVENT = "ragspeed::prefill_attention"


def padded_tables(tables: list[list[int]], num_blocks: int, device="cpu") -> torch.Tensor:
    """Block tables as one [len(tables), num_blocks] int64 tensor, cut or padded with block 0."""
    rows = [t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in tables]
    return torch.tensor(rows, dtype=torch.long, device=device)


def slots(block_table, start: int, end: int, block_size: int) -> list[int]:
    """The pool slots of positions `start .. end` of a request with `block_table`."""
    return slots_at(block_table, range(start, end), block_size)


def slots_at(block_table, positions, block_size: int) -> list[int]:
    """The pool slots of `positions` of a request with `block_table`."""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


def causal_mask(num_queries: int, context_len: int, device: torch.device | str) -> torch.Tensor:
    """[num_queries, context_len] bool: query i (at position context_len - num_queries + i)
    sees keys up to and including its own position."""
    offset = context_len - num_queries
    rows = torch.arange(num_queries, device=device).unsqueeze(1)
    cols = torch.arange(context_len, device=device).unsqueeze(0)
    return cols <= rows + offset


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as 0 / -inf in the compute dtype, converted once per step, not per layer."""
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill_(~mask, float("-inf"))


def decode_kernel_rows(
    decode_tables: Sequence[Sequence[int]],
    decode_context_lens: Sequence[int],
    prefill_tables: Sequence[Sequence[int]],
    prefill_context_lens: Sequence[int],
    prefill_num_queries: Sequence[int],
    prefill_query_positions: Sequence[tuple[int, ...] | None],
    device: torch.device,
) -> tuple[list[Sequence[int]], list[int]] | None:
    """Each query of the flat batch as a row of the decode kernel, (block tables, context
    lengths), on a CPU when every contiguous chunk is small; else None. A scattered chunk, of any
    size, is rows too: it reads its context once per chunk of keys there, and SDPA would need a
    mask as large as its queries times its context."""
    contiguous = [n for n, p in zip(prefill_num_queries, prefill_query_positions) if p is None]
    small = prefill_num_queries and (not contiguous or max(contiguous) <= SMALL_CHUNK_QUERIES)
    if not small or device.type != "cpu":
        return None
    tables, lens = list(decode_tables), list(decode_context_lens)
    for table, context_len, num_queries, positions in zip(
        prefill_tables, prefill_context_lens, prefill_num_queries, prefill_query_positions
    ):  # query i of the chunk sees the keys up to its own position
        if positions is not None:
            lens += [p + 1 for p in positions]
        else:
            lens += range(context_len - num_queries + 1, context_len + 1)
        tables += [table] * (len(lens) - len(tables))
    return tables, lens


# Writes rows of the decode kernel (block tables, context lengths) as tensors: block tables
# [n, max_blocks] int64, each row starting with its table, and context lengths [n] int64.
KernelRows = Callable[[Sequence[Sequence[int]], Sequence[int]], tuple[torch.Tensor, torch.Tensor]]


def build_metadata(
    decode_tables: Sequence[Sequence[int]],
    decode_context_lens: Sequence[int],
    prefill_tables: list[list[int]],
    prefill_context_lens: list[int],
    prefill_num_queries: list[int],
    slot_mapping: list[int] | torch.Tensor,
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    num_threads: int = 1,
    prefill_query_positions: list[tuple[int, ...] | None] | None = None,
    kernel_rows: KernelRows | None = None,
) -> AttentionMetadata:
    """A step's metadata. `prefill_query_positions`: per prefill chunk, its query positions
    (ascending) when it is *scattered* (query i sees the keys of positions 0 .. positions[i],
    as in a document assembly), else None (its queries are the last of its context).
    `kernel_rows` writes the decode kernel's rows into tensors, by default fresh ones; the model
    runner's writes them, like its `slot_mapping` tensor, into its step buffers
    (engine.step_buffers), so that a step makes no tensors of its own."""
    num_decodes = len(decode_tables)
    scattered = prefill_query_positions or [None] * len(prefill_tables)
    rows = decode_kernel_rows(
        decode_tables,
        decode_context_lens,
        prefill_tables,
        prefill_context_lens,
        prefill_num_queries,
        scattered,
        torch.device(device),
    )
    decode_tables_t = decode_lens_t = row_tables = row_lens = None
    if num_decodes or rows is not None:
        if kernel_rows is None:
            kernel_rows = functools.partial(_fresh_kernel_rows, block_size=block_size, device=device)
        # One write serves both: a small step's rows start with its decodes' rows.
        tables_t, lens_t = kernel_rows(*(rows or (decode_tables, decode_context_lens)))
        if rows is not None:
            row_tables, row_lens = tables_t, lens_t
        if num_decodes:
            decode_tables_t = tables_t if rows is None else tables_t[:num_decodes]
            decode_lens_t = lens_t if rows is None else lens_t[:num_decodes]
    if not isinstance(slot_mapping, torch.Tensor):
        slot_mapping = torch.tensor(slot_mapping, dtype=torch.long, device=device)
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decodes=num_decodes,
        decode_block_tables=decode_tables_t,
        decode_context_len=max(decode_context_lens, default=0),
        decode_context_lens=decode_lens_t,
        prefill_chunks=tuple(zip(prefill_tables, prefill_context_lens, prefill_num_queries, scattered)),
        block_size=block_size,
        dtype=dtype,
        row_block_tables=row_tables,
        row_context_lens=row_lens,
        num_threads=num_threads,
    )


def _fresh_kernel_rows(
    tables: Sequence[Sequence[int]], context_lens: Sequence[int], block_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`KernelRows` as new tensors, as wide as the longest context needs."""
    width = -(-max(context_lens) // block_size)
    tables_t = padded_tables([list(t) for t in tables], width, device)
    return tables_t, torch.tensor(context_lens, dtype=torch.long, device=device)


def scattered_metadata(
    block_table: list[int],
    positions: list[int],
    block_size: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    num_threads: int = 1,
) -> AttentionMetadata:
    """One request's tokens at `positions` (ascending), computed over the KV its other
    positions hold: query i sees the keys of positions 0 .. positions[i]."""
    return build_metadata(
        [],
        [],
        [block_table],
        [positions[-1] + 1],
        [len(positions)],
        slots_at(block_table, positions, block_size),
        block_size,
        device,
        dtype,
        num_threads,
        prefill_query_positions=[tuple(positions)],
    )


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
    with record_function(PREFILL_ATTENTION_EVENT):
        for span in meta.prefills:
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
