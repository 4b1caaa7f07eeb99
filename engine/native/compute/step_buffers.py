"""The tensors a step's flat batch is written into, kept from step to step.

A decode step of a small model on a CPU is short, so what surrounds the kernels' call counts:
every fresh tensor (`torch.tensor` of a list, `torch.empty`) and every torch op costs
microseconds, and several times more right after the call has streamed the weights through
the caches. So the model runner's per-step inputs live in buffers allocated once and grown
when a step needs more rows: lists are written through ctypes arrays over the buffers' memory
(no torch op; numpy's assignment costs twice as much there), and the tensor views a step hands
on are made once per row count.

Block tables are written incrementally: each row remembers the table last written to it; a
table that is the same object (the manager's tuple of an unchanged table:
`KVCacheManager.block_ids`) costs nothing, one that only gained blocks writes just those. A
row is as wide as the longest table the buffer has held; the decode kernel reads each row up to
its own context, and what lies past a row's table (zeros or an earlier table's block ids, all
valid blocks) is never read unmasked.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch


class RowBuffer:
    """A CPU tensor `[capacity, *row_shape]` kept across steps; `rows(n)` is a view of its
    first n rows (the same view object for the same n); `words`, for an int64 buffer, a ctypes
    array over all its elements."""

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype):
        self.row_shape = row_shape
        self.dtype = dtype
        self.capacity = -1
        self.reserve(0)

    def reserve(self, num_rows: int) -> bool:
        """Room for `num_rows` rows; True when the buffer was replaced (by zeros)."""
        if num_rows <= self.capacity:
            return False
        self.capacity = max(num_rows, 2 * self.capacity)
        self.tensor = torch.zeros(self.capacity, *self.row_shape, dtype=self.dtype)
        self.address = self.tensor.data_ptr()
        self.row_bytes = self.tensor[0].nbytes if self.capacity else 0
        self.words: ctypes.Array[ctypes.c_int64] | None = None
        if self.dtype == torch.long:
            self.words = (ctypes.c_int64 * self.tensor.numel()).from_address(self.address)
        self._views: dict[int, torch.Tensor] = {}
        return True

    def rows(self, num_rows: int) -> torch.Tensor:
        """[num_rows, *row_shape], contiguous; valid until the next `reserve` that grows."""
        view = self._views.get(num_rows)
        if view is None:
            view = self._views[num_rows] = self.tensor[:num_rows]
        return view


class StepBuffers:
    """The model runner's inputs of a step: token ids, their rotations and K/V slots, and the
    decode kernel's rows (block table, context length). What a step returns stays valid until
    the next step writes."""

    def __init__(self, rotations: torch.Tensor, block_size: int):
        # [max_positions, head_dim/2] complex64: RotaryEmbedding.freqs_cis, read on the CPU.
        self._rotation_table = rotations.cpu().contiguous()
        self._num_positions, half = self._rotation_table.shape
        self._rotation_address = self._rotation_table.data_ptr()
        self.token_ids = RowBuffer((), torch.long)
        self.slot_mapping = RowBuffer((), torch.long)
        self.rotations = RowBuffer((1, half), self._rotation_table.dtype)  # [n, 1, head_dim/2]
        self.context_lens = RowBuffer((), torch.long)
        self._table_width = -(-self._num_positions // block_size)
        self.block_tables = RowBuffer((self._table_width,), torch.long)
        self._written: list[Sequence[int]] = []  # the table last written to each row

    def tokens(
        self,
        token_ids: Sequence[int],
        slot_mapping: Sequence[int],
        position_spans: Sequence[tuple[int, int]],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's tokens: ids [n] int64, rotations [n, 1, head_dim/2] (as
        RotaryEmbedding.lookup gives them) and slots [n] int64. `position_spans`: the tokens'
        positions in order, as (first position, number of consecutive positions)."""
        n = len(token_ids)
        for buffer in (self.token_ids, self.slot_mapping, self.rotations):
            buffer.reserve(n)
        token_words, slot_words = self.token_ids.words, self.slot_mapping.words
        assert token_words is not None and slot_words is not None  # int64 buffers
        # A ctypes array's slice takes any sequence; mypy's ctypes plugin types it as a list only.
        token_words[:n] = token_ids  # type: ignore[call-overload]
        slot_words[:n] = slot_mapping  # type: ignore[call-overload]
        table, row_bytes = self._rotation_address, self.rotations.row_bytes
        address = self.rotations.address
        for first, count in position_spans:
            if not 0 <= first <= first + count <= self._num_positions:
                raise IndexError(
                    f"positions {first}..{first + count} past the {self._num_positions} rotations"
                )
            ctypes.memmove(address, table + first * row_bytes, count * row_bytes)
            address += count * row_bytes
        assert address == self.rotations.address + n * row_bytes, "the spans do not cover the tokens"
        return self.token_ids.rows(n), self.rotations.rows(n), self.slot_mapping.rows(n)

    def kernel_rows(
        self, tables: Sequence[Sequence[int]], context_lens: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the decode kernel: block tables [n, width] int64 (row i starts with
        tables[i]) and context lengths [n] int64."""
        n = len(tables)
        longest = max(map(len, tables), default=0)
        if longest > self._table_width:  # wider rows: every row is written afresh
            self._table_width = longest
            self.block_tables = RowBuffer((longest,), torch.long)
        if self.block_tables.reserve(n):
            self._written = [()] * self.block_tables.capacity
        self.context_lens.reserve(n)
        words, lens_words = self.block_tables.words, self.context_lens.words
        assert words is not None and lens_words is not None  # int64 buffers
        # A ctypes array's slice takes any sequence; mypy's ctypes plugin types it as a list only.
        lens_words[:n] = context_lens  # type: ignore[call-overload]
        written, width = self._written, self._table_width
        for row, table in enumerate(tables):
            before = written[row]
            if table is before:
                continue
            start, num_kept = row * width, len(before)
            if len(table) >= num_kept and table[:num_kept] == before:  # it gained blocks
                words[start + num_kept : start + len(table)] = table[num_kept:]  # type: ignore[call-overload]
            else:
                words[start : start + len(table)] = table  # type: ignore[call-overload]
            written[row] = table
        return self.block_tables.rows(n), self.context_lens.rows(n)
