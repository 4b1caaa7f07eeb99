"""What a step's attention reads, built once per step and shared by all layers: where each new
token's K/V goes (its *slot*, `block_id * block_size + offset`), the decodes' block tables and
context lengths, the prefill chunks' spans, and, on a CPU, each query as a row of the decode
kernel (block table, context length) when the step's chunks are small.

Terms as in engine.native.compute.attention. A chunk is *scattered* when its queries sit at given positions
of its request (an assembled request's fresh tokens, engine.native.core.document_kv): query i sees the keys
of positions 0 .. positions[i]; else its queries are the last positions of its context. This
module imports nothing of the engine, so the kernels that read the metadata stand below it too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


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
    # Threads of the attention kernels: the engine's count, like the linear products (the decode
    # kernel's tasks, one per sequence and KV head, read the KV pool from memory in parallel).
    num_threads: int = 1
    # Prefill chunks through the prefill kernel where it applies (fp32 queries on CPU); False:
    # SDPA's flash kernel, its reference.
    prefill_kernel: bool = True
    # The prefill kernel's products (scores, weighted sums) on int16: where the quality gate
    # passed them (engine.native.core.precision).
    int16_attention: bool = False
    # Among rows, the queries of the step's last prefill chunks (`row_spans`) that attend in the
    # prefill kernel, inside the fused decoder; the rows before them attend a row at a time.
    row_spans: tuple[int, ...] = ()

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
# A chunk of rows attends in the prefill kernel (its tiles of keys serve all of its rows) when it
# has at least this many queries, no drafts, and only such chunks follow it in the step.
SPAN_MIN_QUERIES = 16


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
    prefill_kernel: bool = True,
    prefill_num_drafts: Sequence[int] = (),
    int16_attention: bool = False,
) -> AttentionMetadata:
    """A step's metadata. `prefill_query_positions`: per prefill chunk, its query positions
    (ascending) when it is *scattered* (query i sees the keys of positions 0 .. positions[i],
    as in a document assembly), else None (its queries are the last of its context).
    `kernel_rows` writes the decode kernel's rows into tensors, by default fresh ones; the model
    runner's writes them, like its `slot_mapping` tensor, into its step buffers
    (engine.native.compute.step_buffers), so that a step makes no tensors of its own.
    `prefill_num_drafts`: per prefill chunk, its draft tokens (a verification's; default none)."""
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
    spans = row_spans(prefill_num_queries, scattered, prefill_num_drafts) if rows and prefill_kernel else ()
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
        prefill_kernel=prefill_kernel,
        int16_attention=int16_attention,
        row_spans=spans,
    )


def row_spans(
    num_queries: Sequence[int], positions: Sequence[tuple[int, ...] | None], num_drafts: Sequence[int]
) -> tuple[int, ...]:
    """The queries of the last prefill chunks that attend in the prefill kernel among rows
    (AttentionMetadata.row_spans): plain chunks of at least SPAN_MIN_QUERIES queries, from the
    step's last chunk back to the first that is not one (a verification, whose rows must be
    computed as a plain decode's, a scattered chunk or a short one)."""
    drafts = list(num_drafts) or [0] * len(num_queries)
    spans: list[int] = []
    for n, scattered, d in zip(reversed(num_queries), reversed(positions), reversed(drafts)):
        if scattered is not None or d or n < SPAN_MIN_QUERIES:
            break
        spans.append(n)
    return tuple(reversed(spans))


def _fresh_kernel_rows(
    tables: Sequence[Sequence[int]], context_lens: Sequence[int], block_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`KernelRows` as new tensors, as wide as the longest context needs."""
    width = -(-max(context_lens) // block_size)
    tables_t = padded_tables([list(t) for t in tables], width, device)
    return tables_t, torch.tensor(context_lens, dtype=torch.long, device=device)
