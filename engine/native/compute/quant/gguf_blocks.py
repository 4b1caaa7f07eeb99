"""A GGUF file's quantized weights as stored: its blocks, decoded by the kernels.

`GgufBlocks` is one weight's rows as the file holds them, `data` [rows, bytes a row], with its
type. The loader reorders and joins rows (the Q and K permutations, the fused QKV and gate-up
projections) without touching a block, and the linear kind hands `kernel_weight()` to
engine.native.compute.cpu_kernels.BlockedWeight:

- Q8_0 (32 int8 q, fp16 d: w = d q) is exactly the int8 kernel's group-wise weight;
- Q4_1 (32 4-bit q, fp16 d and m: w = d q + m) is the 4-bit kernel's;
- Q4_0 (w = d (q - 8)) is Q4_1 with m = -8 d, exact in fp16 (a power of two);
- the K-quants Q4_K and Q6_K (256 weights a block, scales per sub-block) are unpacked once
  (engine.native.compute.quant.k_quants) into the K-quant kernels' integers and fp32 steps.

A fused projection whose parts the file stores in different types (Q4_K_M's QKV: Q and K in
Q4_K, V in Q6_K) is `MixedBlocks`: each part's rows converted (`as_mixed`) to one form every type
takes exactly, int8 values with an fp32 step per 16 inputs and an fp32 offset per 32, the
mixed kernel's (1.375 bytes a weight, where one dense fp32 weight would take 4).

No weight is rounded a second time: each product is the fp32 product of what
`gguf.quants.dequantize` gives for the file, but for the activations' int16 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ragspeed.engine.native.compute.quant import k_quants

GROUP = 32  # weights a Q4_0 / Q4_1 / Q8_0 block (engine.native.compute.cpu_kernels.blocked.INT8_GROUP)
# type name -> bytes a block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, **k_quants.BLOCK_BYTES}
# type name -> weights a block
BLOCK_WEIGHTS = {"Q4_0": GROUP, "Q4_1": GROUP, "Q8_0": GROUP, "Q4_K": k_quants.QK_K, "Q6_K": k_quants.QK_K}
KERNEL_TYPES = tuple(BLOCK_BYTES)


@dataclass(frozen=True)
class GgufBlocks:
    qtype: str  # one of KERNEL_TYPES
    data: torch.Tensor  # uint8 [rows, in_features / BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]]

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"no kernel for GGUF type {self.qtype}; these run: {', '.join(KERNEL_TYPES)}")
        if (
            self.data.dtype != torch.uint8
            or self.data.dim() != 2
            or self.data.shape[1] % BLOCK_BYTES[self.qtype]
        ):
            raise ValueError(
                f"{self.qtype} rows are whole blocks of {BLOCK_BYTES[self.qtype]} bytes, "
                f"got a {self.data.dtype} tensor of shape {tuple(self.data.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """[out_features, in_features], as the weight it stands for."""
        return self.data.shape[0], self.data.shape[1] // BLOCK_BYTES[self.qtype] * BLOCK_WEIGHTS[self.qtype]

    @property
    def num_bytes(self) -> int:
        return self.data.numel()

    def map_rows(self, reorder: Callable[[torch.Tensor], torch.Tensor]) -> GgufBlocks:
        """The weight with its rows reordered by `reorder` (which moves whole rows only)."""
        return GgufBlocks(self.qtype, reorder(self.data).contiguous())

    def _blocks(self) -> np.ndarray:
        rows, _ = self.shape
        return self.data.numpy().reshape(rows, -1, BLOCK_BYTES[self.qtype])

    def dequantize(self) -> torch.Tensor:
        """fp32 [out_features, in_features]: what `gguf.quants.dequantize` gives."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.data.numpy(), GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.shape)

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 [len(rows), in_features]: those rows of `dequantize()`, the same floats (an
        embedding lookup on the blocks)."""
        if self.qtype in k_quants.BLOCK_BYTES:
            return k_quants.dequantize_unpacked(*k_quants.unpack(self.qtype, self.data[rows]))
        blocks = self.data[rows].view(len(rows), -1, BLOCK_BYTES[self.qtype])
        d = blocks[:, :, 0:2].contiguous().view(torch.float16).float()  # [rows, groups, 1]
        if self.qtype == "Q8_0":
            return (d * blocks[:, :, 2:].contiguous().view(torch.int8).float()).view(len(rows), -1)
        if self.qtype == "Q4_1":
            m, packed = blocks[:, :, 2:4].contiguous().view(torch.float16).float(), blocks[:, :, 4:]
        else:
            m, packed = None, blocks[:, :, 2:]
        q = torch.cat([packed & 0x0F, packed >> 4], dim=2).float()
        values = d * (q - 8) if m is None else d * q + m
        return values.view(len(rows), -1)

    def kernel_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight and scales engine.native.compute.cpu_kernels.BlockedWeight takes: Q8_0 as int8 [out, in]
        with fp16 scales [out, in / GROUP]; Q4_x as uint8 q in 0..15 [out, in] with fp16 steps
        and offsets [out, in / GROUP, 2]; the K-quants as k_quants.unpack gives them (fp32)."""
        if self.qtype in k_quants.BLOCK_BYTES:
            return k_quants.unpack(self.qtype, self.data)
        rows, in_features = self.shape
        blocks = self._blocks()
        d = blocks[:, :, 0:2].copy().view(np.float16)  # [rows, groups, 1]
        if self.qtype == "Q8_0":
            q = blocks[:, :, 2:].copy().view(np.int8).reshape(rows, in_features)
            return torch.from_numpy(q), torch.from_numpy(d[:, :, 0].copy())
        if self.qtype == "Q4_1":
            m, packed = blocks[:, :, 2:4].copy().view(np.float16), blocks[:, :, 4:]
        else:  # Q4_0: q - 8 = q + m / d with m = -8 d
            m, packed = -8 * d, blocks[:, :, 2:]
            if not np.isfinite(m).all():
                raise ValueError("a Q4_0 step times 8 overflows fp16")
        # A block's 16 bytes hold q[i] in the low nibble of byte i and q[16 + i] in its high one.
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(rows, in_features)
        scales = np.concatenate([d, m], axis=2)
        return torch.from_numpy(q), torch.from_numpy(scales)


@dataclass(frozen=True)
class MixedBlocks:
    """A projection's rows stacked from parts of different types, each part the file's blocks."""

    parts: tuple[GgufBlocks, ...]

    def __post_init__(self) -> None:
        if len({part.shape[1] for part in self.parts}) != 1:
            widths = [part.shape[1] for part in self.parts]
            raise ValueError(f"stacked rows need one in_features, got {widths}")

    @property
    def qtype(self) -> str:
        """Its parts' types in order, e.g. "Q4_K+Q6_K"."""
        return "+".join(dict.fromkeys(part.qtype for part in self.parts))

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].shape[1]

    @property
    def num_bytes(self) -> int:
        return sum(part.num_bytes for part in self.parts)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])

    def kernel_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixed kind's int8 values [out, in] and fp32 scales [out, in / GROUP, 3] of
        every part's rows (`as_mixed`)."""
        pairs = [as_mixed(*part.kernel_weight()) for part in self.parts]
        return torch.cat([values for values, _ in pairs]), torch.cat([scales for _, scales in pairs])


def as_mixed(values: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A `kernel_weight()` pair of any type in the mixed kind's form, the same weights: int8
    values [out, in] and fp32 scales [out, in / GROUP, 3], each group's step for its first and
    its second 16 inputs and its offset (w = step q + offset). Q8_0's fp16 d and Q4_x's d and m
    widen exactly; Q4_K's step and offset per 32 serve both halves; Q6_K's offset is 0."""
    rows, in_features = values.shape
    if in_features % GROUP:
        raise ValueError(f"mixed rows come in groups of {GROUP} inputs, got {in_features}")
    groups = in_features // GROUP
    if scales.dim() == 2 and scales.dtype == torch.float16:  # Q8_0: a step per 32
        steps = scales.float().unsqueeze(-1).expand(rows, groups, 2)
        offsets = torch.zeros(rows, groups, 1)
    elif scales.dim() == 2:  # Q6_K: a step per 16
        steps = scales.view(rows, groups, 2)
        offsets = torch.zeros(rows, groups, 1)
    else:  # Q4_0, Q4_1, Q4_K: a step and an offset per 32
        step, offset = scales.float().unbind(-1)
        steps, offsets = step.unsqueeze(-1).expand(rows, groups, 2), offset.unsqueeze(-1)
    return values.to(torch.int8), torch.cat([steps, offsets], dim=-1).contiguous()


def kernel_dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [out, in] of a `kernel_weight()` or `as_mixed` pair, equal to the file's
    `dequantize()`: every product and sum here is exact in fp32 (d has 11 significant bits, q at
    most 8, and Q4_0's d q - 8 d is d (q - 8)); the K-quants' fp32 steps round once, as gguf's."""
    rows, in_features = values.shape
    if scales.dtype == torch.float32 and scales.dim() == 3 and scales.shape[-1] == 3:  # mixed
        halves = values.view(rows, -1, 2, GROUP // 2).float()
        weight = halves * scales[:, :, :2].unsqueeze(-1) + scales[:, :, 2:].unsqueeze(-1)
        return weight.view(rows, in_features)
    if scales.dtype == torch.float32:
        return k_quants.dequantize_unpacked(values, scales)
    grouped = values.view(rows, -1, GROUP).float()
    if values.dtype == torch.int8:
        return (grouped * scales.float().unsqueeze(-1)).view(rows, in_features)
    d, m = scales.float().unbind(-1)
    return (grouped * d.unsqueeze(-1) + m.unsqueeze(-1)).view(rows, in_features)


def cat_rows(weights: list[torch.Tensor | GgufBlocks]) -> torch.Tensor | GgufBlocks | MixedBlocks:
    """Weights stacked by rows: blocks of one type stay blocks, blocks of several types are
    `MixedBlocks`; anything with a dense weight among them becomes fp32."""
    blocks = [w for w in weights if isinstance(w, GgufBlocks)]
    if len(blocks) < len(weights):
        return torch.cat([dense(w) for w in weights])
    if len({w.qtype for w in blocks}) == 1:
        return GgufBlocks(blocks[0].qtype, torch.cat([w.data for w in blocks]))
    return MixedBlocks(tuple(blocks))


def dense(weight: torch.Tensor | GgufBlocks | MixedBlocks) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize()


def map_rows(weight: torch.Tensor | GgufBlocks, reorder: Callable[[torch.Tensor], torch.Tensor]):
    return weight.map_rows(reorder) if isinstance(weight, GgufBlocks) else reorder(weight)
