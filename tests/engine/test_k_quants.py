"""GGUF's K-quants unpacked (engine.native.compute.quant.k_quants): integers and fp32 steps whose
`step * q + offset` is `gguf.quants.dequantize` bit for bit, for random valid blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ragspeed.engine.native.compute.quant.k_quants import (
    dequantize_unpacked,
    unpack,
    unpack_q4_k,
    unpack_q6_k,
)
from tests.engine.tiny_gguf import random_k_quant_bytes


def _random_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes with fp16 scales spread over many binades (subnormals and large ones too)."""
    data = random_k_quant_bytes(qtype, rows, cols, seed).reshape(rows * cols // 256, -1)
    rng = np.random.default_rng(seed)
    scales = rng.choice([-1.0, 1.0], size=len(data)) * 2.0 ** rng.uniform(-24, 12, size=len(data))
    fields = scales.astype(np.float16).reshape(-1, 1).view(np.uint8)
    for offset in {"Q4_K": (0, 2), "Q6_K": (208,)}[qtype]:
        data[:, offset : offset + 2] = np.roll(fields, offset, axis=0)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows, cols", [(1, 256), (7, 512), (33, 1536)])
def test_unpacked_blocks_are_the_files_floats(qtype, rows, cols):
    data = _random_blocks(qtype, rows, cols, seed=rows + cols)
    values, scales = unpack(qtype, torch.from_numpy(data))
    reference = dequantize(data, GGMLQuantizationType[qtype])
    assert reference.shape == (rows, cols) and np.isfinite(reference).all()
    assert np.array_equal(dequantize_unpacked(values, scales).numpy(), reference)
    if qtype == "Q4_K":
        assert values.dtype == torch.uint8 and int(values.max()) <= 15
        assert scales.dtype == torch.float32 and scales.shape == (rows, cols // 32, 2)
    else:
        assert values.dtype == torch.int8 and -32 <= int(values.min()) and int(values.max()) <= 31
        assert scales.dtype == torch.float32 and scales.shape == (rows, cols // 16)


def test_q4_k_fields_by_hand():
    """d = 1, dmin = 0.5; sub-block 5's scale 0b110101 and min 0b101010 split over the 12 bytes;
    weight 32 * 5 + 3 is the high nibble of byte 32 * 2 + 3 of the values."""
    block = np.zeros((1, 144), dtype=np.uint8)
    block[0, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    block[0, 2:4] = np.array([0.5], dtype=np.float16).view(np.uint8)
    scales = block[0, 4:16]
    scales[8 + 1] = 0b1010_0101  # sub-block 5: sc's low nibble 0101, m's low nibble 1010
    scales[1] = 0b11 << 6  # sc's top bits 11
    scales[4 + 1] = 0b10 << 6  # m's top bits 10
    block[0, 16 + 64 + 3] = 0x90  # high nibble 9
    q, steps = unpack_q4_k(block)
    assert steps[0, 5].tolist() == [0b110101, -0.5 * 0b101010]
    assert q[0, 32 * 5 + 3] == 9 and q.sum() == 9
    assert dequantize_unpacked(torch.from_numpy(q), torch.from_numpy(steps))[0, 163] == 53 * 9 - 21


def test_q6_k_fields_by_hand():
    """Weight 128 + 32 * 3 + 7: the high nibble of ql byte 64 + 32 + 7, bits 6-7 of qh byte
    32 + 7; its sub-block (14) scale -3, d = 0.25."""
    block = np.zeros((1, 210), dtype=np.uint8)
    block[0, 64 + 32 + 7] = 0xB0  # high nibble 11
    block[0, 128 + 32 + 7] = 0b10 << 6
    block[0, 192 + 14] = np.array([-3], dtype=np.int8).view(np.uint8)[0]
    block[0, 208:210] = np.array([0.25], dtype=np.float16).view(np.uint8)
    q, steps = unpack_q6_k(block)
    index = 128 + 32 * 3 + 7
    assert q[0, index] == 11 + (2 << 4) - 32 and np.count_nonzero(q != -32) == 1
    assert steps[0, 14] == -0.75 and steps[0, 0] == 0.0
    reference = dequantize(block, GGMLQuantizationType.Q6_K)
    assert reference[0, index] == -0.75 * 11


def test_blocks_of_the_wrong_size_are_named():
    with pytest.raises(ValueError, match="Q4_K blocks are uint8 rows of 144 bytes"):
        unpack_q4_k(np.zeros((2, 210), dtype=np.uint8))
    with pytest.raises(ValueError, match="Q6_K blocks are uint8 rows of 210 bytes"):
        unpack_q6_k(np.zeros((2, 210), dtype=np.int8))
