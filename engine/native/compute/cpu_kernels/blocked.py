"""One weight in the layout of the decode products (gemv.c, gemv_gguf.c) and its product with a
few rows.

Layout: W [n, k] as blocks of 16 output columns, the last block padded with zero columns; the
bias padded to whole blocks the same way. fp32 blocks are `[ceil(n / 16), k, 16]`. int8 blocks
hold their inputs in pairs, `[ceil(n / 16), ceil(k / 2), 16, 2]` (an odd k padded with a zero
weight), with one fp16 scale per `INT8_GROUP` consecutive inputs of each output column
(engine.native.compute.quant.groupwise) laid out per block as `[ceil(n / 16), ceil(k / INT8_GROUP), 16]`.
4-bit blocks (GGUF's Q4_0 and Q4_1, engine.native.compute.quant.gguf_blocks) hold the int8 layout's values two
a byte, `[ceil(n / 16), k / 2, 16]` bytes (value i of a pair's 32 in the low nibble of byte i,
value 16 + i in its high one), with each group's fp16 step and offset `[ceil(n / 16), k /
INT8_GROUP, 2, 16]`. GGUF's K-quants, unpacked (engine.native.compute.quant.k_quants), take the same layouts
with fp32 scales: Q4_K the 4-bit one, its steps and offsets fp32; Q6_K the int8 one, with an
fp32 step per `Q6K_STEP` inputs, `[ceil(n / 16), k / Q6K_STEP, 16]`. A projection whose rows
come in several GGUF types (engine.native.compute.quant.gguf_blocks.as_mixed) takes the int8 layout too, with
an fp32 step per `Q6K_STEP` inputs and an fp32 offset per `INT8_GROUP`, `[ceil(n / 16), k /
INT8_GROUP, 3, 16]` (a group's two steps, then its offset). The int8, 4-bit, K-quant and mixed
kernels quantize each input row per group to int16, sum each group's products exactly in int32
and scale it once (gemv.c): the activations' rounding is far below the weights'.

A product is bound by reading the weight: the kernel streams each block once per pass of a few
rows (four with AVX2, six with AVX-512). The linear kinds use it up to their `max_rows` rows and
for every product of a decode-type step, their packed kernels beyond.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ragspeed.engine.native.compute.cpu_kernels.build import load_library
from ragspeed.engine.native.compute.huge_pages import gather_on_huge_pages

BLOCK = 16
INT8_GROUP = 32  # kernels_common.h's GROUP; the library reports its own (test_cpu_kernels checks)
Q6K_STEP = 16  # gemv.h's STEP: inputs a Q6_K step scales
# (weight dtype, scales dtype, scales dimensions) -> kind
_KINDS = {
    (torch.float32, None, None): "fp32",
    (torch.int8, torch.float16, 2): "int8",
    (torch.uint8, torch.float16, 3): "q4",
    (torch.uint8, torch.float32, 3): "q4k",
    (torch.int8, torch.float32, 2): "q6k",
    (torch.int8, torch.float32, 3): "kmix",
}
BLOCKED_KINDS = tuple(_KINDS.values())  # each has a WEIGHT_* in kernels.h (its upper-case name)

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
    """W [out_features, in_features] and an optional bias in the kernel's layout, one of six
    kinds by the dtypes of the weight and its scales (and the scales' dimensions):

    - fp32;
    - int8 with fp16 group `scales` [out_features, ceil(in_features / INT8_GROUP)];
    - uint8 4-bit values q in 0..15 with fp16 `scales` [out_features, in_features / INT8_GROUP,
      2] holding each group's step d and offset m (W = d * q + m);
    - q4k: the same with fp32 scales (GGUF's Q4_K);
    - q6k: int8 with fp32 steps [out_features, in_features / Q6K_STEP] (GGUF's Q6_K);
    - kmix: int8 with fp32 `scales` [out_features, in_features / INT8_GROUP, 3], each group's
      step for its first and second `Q6K_STEP` inputs and its offset (W = step * q + offset):
      rows of several GGUF types in one projection.

    `forward(x)` is `x @ W.T + bias`, for all but fp32 with x rounded per group to int16.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, scales: torch.Tensor | None = None
    ):
        library = load_library()
        assert library is not None, "blocked_kernels_available() first"
        self.out_features, self.in_features = weight.shape
        key = (weight.dtype, None, None) if scales is None else (weight.dtype, scales.dtype, scales.dim())
        kind = _KINDS.get(key)
        assert kind is not None, f"no blocked kernel for {weight.dtype} weights with these scales"
        self.kind = kind
        num_groups = -(-self.in_features // INT8_GROUP)
        wanted = {
            "fp32": None,
            "int8": (self.out_features, num_groups),
            "q4": (self.out_features, num_groups, 2),
            "q4k": (self.out_features, num_groups, 2),
            "q6k": (self.out_features, self.in_features // Q6K_STEP),
            "kmix": (self.out_features, num_groups, 3),
        }[kind]
        assert wanted is None or (scales is not None and tuple(scales.shape) == wanted), (
            f"{kind} weights need scales of shape {wanted}"
        )
        assert kind in ("fp32", "int8") or self.in_features % INT8_GROUP == 0, (
            f"{kind} weights come in groups of {INT8_GROUP} inputs, got {self.in_features}"
        )
        self._kernel = {
            "fp32": library.ragspeed_gemv_f32,
            "int8": library.ragspeed_gemv_i8,
            "q4": library.ragspeed_gemv_q4,
            "q4k": library.ragspeed_gemv_q4k,
            "q6k": library.ragspeed_gemv_q6k,
            "kmix": library.ragspeed_gemv_kmix,
        }[kind]
        num_blocks = -(-self.out_features // BLOCK)
        if self.kind == "fp32":  # [blocks, k, 16]
            padded = torch.zeros(num_blocks * BLOCK, self.in_features, dtype=weight.dtype)
            padded[: self.out_features] = weight
            self.blocks = padded.view(num_blocks, BLOCK, self.in_features).transpose(1, 2).contiguous()
        else:  # [blocks, pairs, 16, 2]
            pairs = -(-self.in_features // 2)
            padded = torch.zeros(num_blocks * BLOCK, pairs * 2, dtype=weight.dtype)
            padded[: self.out_features, : self.in_features] = weight
            self.blocks = padded.view(num_blocks, BLOCK, pairs, 2).transpose(1, 2).contiguous()
        if self.kind in ("q4", "q4k"):  # values i and 16 + i of each pair's 32 share byte i
            values = self.blocks.view(num_blocks, -1, 2, BLOCK)
            self.blocks = (values[:, :, 0] | (values[:, :, 1] << 4)).contiguous()
        # int8: [num_blocks, num_groups, 16]; 4-bit [num_blocks, num_groups, 2, 16]; q6k
        # [num_blocks, in_features / Q6K_STEP, 16]; kmix [num_blocks, num_groups, 3, 16]
        self.scales = None
        if scales is not None:
            padded_scales = torch.zeros(num_blocks * BLOCK, *scales.shape[1:], dtype=scales.dtype)
            padded_scales[: self.out_features] = scales
            columns = padded_scales.view(num_blocks, BLOCK, -1)
            self.scales = columns.permute(0, 2, 1).reshape(num_blocks, *scales.shape[1:], BLOCK).contiguous()
        self.bias = None if bias is None else _pad_to_blocks(bias, num_blocks)

    def unblocked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight [out_features, in_features] as given, and its scales (all but fp32) or
        None: what another layout of the same weight is built from."""
        blocks = self.blocks
        if self.kind in ("q4", "q4k"):  # back to [blocks, pairs, 16, 2], one value a byte
            values = torch.stack([blocks & 0x0F, blocks >> 4], dim=2)
            blocks = values.view(blocks.shape[0], -1, BLOCK, 2)
        columns = blocks.transpose(1, 2).reshape(-1, blocks[0].numel() // BLOCK)
        weight = columns[: self.out_features, : self.in_features].contiguous()
        if self.scales is None:
            return weight, None
        scales = self.scales.movedim(-1, 1).reshape(-1, *self.scales.shape[1:-1])
        return weight, scales[: self.out_features]

    @property
    def num_bytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in (self.scales, self.bias) if t is not None)
        return self.blocks.numel() * self.blocks.element_size() + extra

    def forward(self, x: torch.Tensor, num_threads: int) -> torch.Tensor:
        """x fp32 [num_rows, in_features] -> fp32 [num_rows, out_features]."""
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        pointers: list[int | None] = [self.blocks.data_ptr()]
        if self.scales is not None:
            pointers.append(self.scales.data_ptr())
        pointers += [None if self.bias is None else self.bias.data_ptr(), x.data_ptr(), y.data_ptr()]
        self._kernel(*pointers, x.shape[0], self.out_features, self.in_features, num_threads)
        return y


def gather_weights(weights: list[BlockedWeight]) -> None:
    """Move the weights' blocks, scales and biases back to back onto huge pages, in the order
    given (the order a decode step reads them): the step streams one run of memory on few pages
    (engine.native.compute.huge_pages). The weights keep their values; every holder of one sees the move."""
    parts = [
        (w, name) for w in weights for name in ("blocks", "scales", "bias") if getattr(w, name) is not None
    ]
    for (weight, name), copy in zip(parts, gather_on_huge_pages([getattr(w, n) for w, n in parts])):
        setattr(weight, name, copy)
