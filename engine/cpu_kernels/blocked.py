"""One weight in the layout of kernels.c and its product with a few rows.

Layout: W [n, k] as blocks of 16 output columns, `[ceil(n / 16), k, 16]`, the last block padded
with zero columns; per-column scales (int8) and the bias padded to whole blocks the same way.
fp32 weights are used as they are; int8 weights carry one fp32 scale per output column and
the product keeps the activations in fp32 (weight-only quantization).

Measured on the 2-core development CPU over bench-135m's 121 matrices (two threads), per product
of all of them, against the engine's packed kernels: fp32 1 row 11-18 ms vs oneDNN 21-27 ms,
4 rows 16-19 vs 18-22, 8 rows about equal; int8 1 row 4.6 vs fbgemm 6.5-7.2 ms, 2 rows 5.2
vs 7.4, 4 rows equal, more rows slower (each 16 weights are widened to fp32 once per pass of
four rows; of six since, with AVX-512). The linear kinds use these kernels up to `max_rows` rows and their packed kernels
beyond.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ragspeed.engine.cpu_kernels.build import load_library

BLOCK = 16

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
    """W [out_features, in_features] (fp32, or int8 with per-row `scales`) and an optional
    bias, in the kernel's layout; `forward(x)` is `x @ W.T * scales + bias`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None):
        library = load_library()
        assert library is not None, "blocked_kernels_available() first"
        if weight.dtype == torch.int8:
            assert scales is not None, "int8 weights need their per-row scales"
            self._kernel = library.ragspeed_gemv_i8
        else:
            assert weight.dtype == torch.float32 and scales is None, weight.dtype
            self._kernel = library.ragspeed_gemv_f32
        self.out_features, self.in_features = weight.shape
        num_blocks = -(-self.out_features // BLOCK)
        padded = torch.zeros(num_blocks * BLOCK, self.in_features, dtype=weight.dtype)
        padded[: self.out_features] = weight
        self.blocks = padded.view(num_blocks, BLOCK, self.in_features).transpose(1, 2).contiguous()
        self.scales = None if scales is None else _pad_to_blocks(scales, num_blocks)
        self.bias = None if bias is None else _pad_to_blocks(bias, num_blocks)

    @property
    def num_bytes(self) -> int:
        extra = sum(t.numel() * 4 for t in (self.scales, self.bias) if t is not None)
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
