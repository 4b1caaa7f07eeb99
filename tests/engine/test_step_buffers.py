"""The model runner's step buffers (engine.native.compute.step_buffers): what each step reads from them is that
step's batch, whatever was written before, as the batch grows, shrinks and changes hands."""

from __future__ import annotations

import pytest
import torch

from ragspeed.engine.native.compute.step_buffers import RowBuffer, StepBuffers
from ragspeed.engine.native.models.rotary import RotaryEmbedding

BLOCK_SIZE = 4


def _buffers(max_positions: int = 32) -> tuple[StepBuffers, RotaryEmbedding]:
    rotary = RotaryEmbedding(1.0 / 10000 ** (torch.arange(0, 8, 2) / 8), max_positions)
    return StepBuffers(rotary.freqs_cis, BLOCK_SIZE), rotary


def _rows(buffers: StepBuffers, tables, lens) -> tuple[list[list[int]], list[int]]:
    """Each row's table (its first len(table) entries) and the context lengths, as lists."""
    tables_t, lens_t = buffers.kernel_rows(tables, lens)
    assert tables_t.is_contiguous() and tables_t.shape[0] == len(tables)
    return [row[: len(t)] for row, t in zip(tables_t.tolist(), tables)], lens_t.tolist()


def test_tokens_are_the_lists_and_their_rotations():
    buffers, rotary = _buffers()
    ids, rotations, slot_mapping = buffers.tokens([7, 8, 9, 6], [11, 4, 30, 31], [(3, 1), (16, 3)])
    assert ids.tolist() == [7, 8, 9, 6] and ids.dtype == torch.long
    assert slot_mapping.tolist() == [11, 4, 30, 31]
    assert torch.equal(rotations, rotary.lookup(torch.tensor([3, 16, 17, 18])))
    ids, rotations, _ = buffers.tokens([5], [2], [(9, 1)])  # fewer tokens: the first rows only
    assert ids.tolist() == [5] and torch.equal(rotations, rotary.lookup(torch.tensor([9])))
    with pytest.raises(IndexError, match="past the 32 rotations"):
        buffers.tokens([5, 6], [2, 3], [(31, 2)])


def test_block_tables_follow_the_batch_as_it_changes():
    buffers, _ = _buffers()
    a, b = (3, 5), (1,)
    assert _rows(buffers, [a, b], [7, 2]) == ([[3, 5], [1]], [7, 2])
    a = a + (6,)  # a gained a block
    assert _rows(buffers, [a, b], [9, 3]) == ([[3, 5, 6], [1]], [9, 3])
    # a finished: b moves to row 0, over a's longer table; then c (preempted b's blocks) joins
    assert _rows(buffers, [b], [4]) == ([[1]], [4])
    c = (1, 2)
    assert _rows(buffers, [(0,), c, b, a], [1, 6, 4, 9]) == ([[0], [1, 2], [1], [3, 5, 6]], [1, 6, 4, 9])
    # a table of the same length with other blocks (a request that took over the row)
    assert _rows(buffers, [(4,), (2, 7)], [3, 5]) == ([[4], [2, 7]], [3, 5])


def test_rows_and_width_grow_past_the_first_buffers():
    buffers, _ = _buffers(max_positions=8)  # two blocks a row at first
    tables = [tuple(range(i, i + 2)) for i in range(5)]
    assert _rows(buffers, tables, [8] * 5)[0] == [list(t) for t in tables]
    wide = (9, 8, 7, 6)
    assert _rows(buffers, [wide, tables[1]], [16, 8])[0] == [[9, 8, 7, 6], [1, 2]]


def test_a_row_buffer_hands_the_same_view_until_it_grows():
    buffer = RowBuffer((2,), torch.float32)
    assert buffer.reserve(3) and not buffer.reserve(2)
    view = buffer.rows(2)
    assert buffer.rows(2) is view and view.shape == (2, 2)
    view[1] = torch.tensor([1.0, 2.0])
    assert view.tolist() == [[0.0, 0.0], [1.0, 2.0]]
    assert buffer.reserve(7) and buffer.capacity == 7 and buffer.rows(2) is not view
