"""One weight in the layout of kernels.c and its product with a few rows.

Layout: W [n, k] as blocks of 16 output columns, the last block padded with zero columns; the
bias padded to whole blocks the same way. fp32 blocks are `[ceil(n / 16), k, 16]`. int8 blocks
hold their inputs in pairs, `[ceil(n / 16), ceil(k / 2), 16, 2]` (an odd k padded with a zero
weight), with one fp16 scale per `INT8_GROUP` consecutive inputs of each output column
(engine.quant.groupwise) laid out per block as `[ceil(n / 16), ceil(k / INT8_GROUP), 16]`. The
int8 kernel quantizes each input row per group to int16, sums each group's products exactly
in int32 and scales it once (kernels.c): the activations' rounding is far below the weights'.

A product is bound by reading the weight: the kernel streams each block once per pass of a few
rows (four with AVX2, six with AVX-512). The linear kinds use it up to their `max_rows` rows and
for every product of a decode-type step, their packed kernels beyond.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ragspeed.engine.cpu_kernels.build import load_library

BLOCK = 16
INT8_GROUP = 32  # kernels.c's GROUP; the library reports its own (test_cpu_kernels checks)

# Set by the model runner and the draft proposer around a step whose chunks are all small.
_DECODE_STEP = contextvars.ContextVar("ragspeed_decode_step", default=False)


@contextmanager
def decode_step(active: bool) -> Iterator[None]:
    """Within a decode-type step (decodes and verifications only), every product goes to the
    blocked kernels whatever its row count. They give a row the same bits in any batch, so a
    request's tokens do not depend on how many others ran beside it, nor on whether they were
    verified drafts: greedy decoding with speculation stays identical to decoding without
    it. (The packed kernels that prefill uses sum in another order.)"""
    token = _DECODE_STEP.set(active)
    try:
        yield
    finally:
        _DECODE_STEP.reset(token)


def in_decode_step() -> bool:
    return _DECODE_STEP.get()


def takes_blocked(num_rows: int, max_rows: int) -> bool:
    """Whether a linear kind's product of `num_rows` rows goes to its blocked copy: a few rows
    (up to the kind's `max_rows`), or any number within a decode-type step."""
    return num_rows <= max_rows or _DECODE_STEP.get()


def blocked_kernels_available(device: torch.device) -> bool:
    return device.type == "cpu" and load_library() is not None


def _pad_to_blocks(vector: torch.Tensor, num_blocks: int) -> torch.Tensor:
    padded = torch.zeros(num_blocks * BLOCK, dtype=torch.float32)
    padded[: vector.numel()] = vector.float()
    return padded


class BlockedWeight:
    """W [out_features, in_features] (fp32, or int8 with fp16 group `scales` [out_features,
    ceil(in_features / INT8_GROUP)]) and an optional bias, in the kernel's layout; `forward(x)`
    is `x @ (W * scales per group).T + bias` (int8: with x rounded per group to int16)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, scales: torch.Tensor | None = None
    ):
        library = load_library()
        assert library is not None, "blocked_kernels_available() first"
        if weight.dtype == torch.int8:
            num_groups = -(-weight.shape[1] // INT8_GROUP)
            assert scales is not None and tuple(scales.shape) == (weight.shape[0], num_groups), (
                "int8 weights need their group scales [out_features, ceil(in / INT8_GROUP)]"
            )
            assert scales.dtype == torch.float16, f"group scales are fp16, got {scales.dtype}"
            self._kernel = library.ragspeed_gemv_i8
        else:
            assert weight.dtype == torch.float32 and scales is None, weight.dtype
            self._kernel = library.ragspeed_gemv_f32
        self.out_features, self.in_features = weight.shape
        num_blocks = -(-self.out_features // BLOCK)
        if weight.dtype == torch.int8:  # [blocks, pairs, 16, 2]
            pairs = -(-self.in_features // 2)
            padded = torch.zeros(num_blocks * BLOCK, pairs * 2, dtype=torch.int8)
            padded[: self.out_features, : self.in_features] = weight
            self.blocks = padded.view(num_blocks, BLOCK, pairs, 2).transpose(1, 2).contiguous()
        else:  # [blocks, k, 16]
            padded = torch.zeros(num_blocks * BLOCK, self.in_features, dtype=weight.dtype)
            padded[: self.out_features] = weight
            self.blocks = padded.view(num_blocks, BLOCK, self.in_features).transpose(1, 2).contiguous()
        self.scales = None  # int8: [num_blocks, num_groups, 16]
        if scales is not None:
            padded_scales = torch.zeros(num_blocks * BLOCK, scales.shape[1], dtype=torch.float16)
            padded_scales[: self.out_features] = scales
            self.scales = padded_scales.view(num_blocks, BLOCK, -1).transpose(1, 2).contiguous()
        self.bias = None if bias is None else _pad_to_blocks(bias, num_blocks)

    def unblocked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight [out_features, in_features] as given, and its group scales (int8) or
        None: what another layout of the same weight is built from."""
        columns = self.blocks.transpose(1, 2).reshape(-1, self.blocks[0].numel() // BLOCK)
        weight = columns[: self.out_features, : self.in_features].contiguous()
        if self.scales is None:
            return weight, None
        scales = self.scales.transpose(1, 2).reshape(-1, self.scales.shape[1])
        return weight, scales[: self.out_features]

    @property
    def num_bytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in (self.scales, self.bias) if t is not None)
        return self.blocks.numel() * self.blocks.element_size() + extra

    def forward(self, x: torch.Tensor, num_threads: int) -> torch.Tensor:
        """x fp32 [num_rows, in_features] -> fp32 [num_rows, out_features]."""
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        pointers = [self.blocks.data_ptr()]
        if self.scales is not None:
            pointers.append(self.scales.data_ptr())
        pointers += [None if self.bias is None else self.bias.data_ptr(), x.data_ptr(), y.data_ptr()]
        self._kernel(*pointers, x.shape[0], self.out_features, self.in_features, num_threads)
        return y
