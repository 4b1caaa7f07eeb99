"""GGUF's K-quants Q4_K and Q6_K unpacked into small integers and fp32 group steps.

A K-quant block holds 256 weights of a row, in sub-blocks with scales of their own:

- Q4_K, 144 bytes: fp16 d and dmin, 12 bytes packing a 6-bit scale sc and a 6-bit min m for
  each of 8 sub-blocks of 32, then 128 bytes of 4-bit q; w = (d sc) q - (dmin m).
- Q6_K, 210 bytes: 128 bytes of the low 4 bits of q, 64 bytes of its high 2 bits, 16 int8
  scales sc for sub-blocks of 16, fp16 d; w = (d sc) (q - 32).

Unpacked, a row is its integers and, per sub-block, an fp32 step (d sc) and offset (-dmin m):
Q4_K's q in 0..15 with a step and an offset per 32 weights, Q6_K's q - 32 in -32..31 with a
step per 16. Every step and offset is exact in fp32 (11 significant bits times at most 8), and
so is a step times its integer (at most 24 bits): `step * q + offset` rounds once, as
`gguf.quants.dequantize` does, and gives its floats bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

QK_K = 256  # weights a block
Q4_K_GROUP = 32  # weights a Q4_K step and offset
Q6_K_GROUP = 16  # weights a Q6_K step
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}


def unpack_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 blocks [n, 144] -> q uint8 [n, 256] in 0..15 and fp32 [n, 8, 2]: each sub-block's
    step d sc and offset -dmin m."""
    blocks = _check(blocks, "Q4_K")
    n = len(blocks)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    # 12 bytes, three rows of four: sc[0:4] and m[0:4] in the low 6 bits of rows 0 and 1;
    # sc[4:8] and m[4:8] as row 2's low and high nibbles, their top 2 bits in rows 0 and 1.
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    low, high, rest = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([low & 0x3F, (rest & 0x0F) | ((low >> 2) & 0x30)], axis=1)
    m = np.concatenate([high & 0x3F, (rest >> 4) | ((high >> 2) & 0x30)], axis=1)
    steps = d * sc.astype(np.float32)  # [n, 8]
    offsets = -(dmin * m.astype(np.float32))
    # 4 runs of 32 bytes: sub-block 2i in the low nibbles of run i, sub-block 2i + 1 in its high.
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, QK_K)
    return q, np.stack([steps, offsets], axis=2)


def unpack_q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 blocks [n, 210] -> q - 32 int8 [n, 256] in -32..31 and each sub-block's step d sc,
    fp32 [n, 16]."""
    blocks = _check(blocks, "Q6_K")
    n = len(blocks)
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)  # [n, 16]
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)  # [n, 1]
    # Two halves of 128 weights; in half h, weight 32 j + i (j < 4) takes the low (j < 2) or
    # high nibble of ql byte 64 h + 32 (j % 2) + i and bits 2 j, 2 j + 1 of qh byte 32 h + i.
    low: np.ndarray = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low & 0x0F).reshape(n, 2, 4, 32)
    high: np.ndarray = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & 0x03).reshape(n, 2, 4, 32)
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, QK_K)
    return q, d * sc


def unpack(qtype: str, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix's rows of blocks, uint8 [rows, blocks a row * bytes a block], unpacked: its
    integers [rows, in_features] and fp32 scales, Q4_K [rows, in_features / 32, 2] (steps and
    offsets), Q6_K [rows, in_features / 16] (steps)."""
    rows = data.shape[0]
    blocks = data.numpy().reshape(-1, BLOCK_BYTES[qtype])
    q, scales = (unpack_q4_k if qtype == "Q4_K" else unpack_q6_k)(blocks)
    values = torch.from_numpy(q.reshape(rows, -1))
    return values, torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, -1, *scales.shape[2:])))


def dequantize_unpacked(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, in_features] of `unpack`'s pair: step * q + offset, rounded once, which is
    what gguf.quants.dequantize gives for the blocks."""
    rows, in_features = values.shape
    if scales.dim() == 2:  # Q6_K: steps only
        grouped = values.view(rows, scales.shape[1], -1).float()
        return (grouped * scales.unsqueeze(-1)).view(rows, in_features)
    step, offset = scales.unbind(-1)
    grouped = values.view(rows, scales.shape[1], -1).float()
    return (grouped * step.unsqueeze(-1) + offset.unsqueeze(-1)).view(rows, in_features)


def _check(blocks: np.ndarray, qtype: str) -> np.ndarray:
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != BLOCK_BYTES[qtype]:
        raise ValueError(
            f"{qtype} blocks are uint8 rows of {BLOCK_BYTES[qtype]} bytes, "
            f"got {blocks.dtype} of shape {blocks.shape}"
        )
    return blocks
