"""Prefill products on a GGUF file's 4-bit blocks with int8 activations (gemm_int8.c's
`ragspeed_quantize_q8` and `ragspeed_gemm_u4q8`).

A prefill chunk's products are bound by arithmetic. Their fp32 path multiplies a dense fp32 copy
of the dequantized weight (4 bytes a weight, at the fp32 rate); this one multiplies the file's own
4-bit values (Q4_0, Q4_1: w = d q + m, q in 0..15), one a byte, by the input rows rounded to int8
per group of 32 as llama.cpp's Q8_1 rounds them (`quantize_rows`: a step s = max |x| / 127 a group,
q = rint(x / s), and the group's s * sum q), with integer multiply-adds: AVX-512 VNNI `vpdpbusd`,
AVX2 `vpmaddubsw` + `vpmaddwd`, or plain C, whichever the kernels were compiled for
(`isa_of`). Each group's integer sum is exact; then `y += s d (sum xq q) + m (s sum xq)` in fp32.

Terms: *weight values* q (uint8 0..15), *steps and offsets* d and m (per output column and group
of 32 inputs; Q4_0's m = -8 d); *quantized rows* `QuantizedRows` (xq, xs, xsum).

Layout (`Int8BlocksGemm`): values `[ceil(n / 16), k / 4, 16, 4]` uint8 (a block of 16 output
columns, in quads of 4 inputs: the 4 bytes `vpdpbusd` sums into one lane), steps and offsets
`[ceil(n / 16), k / 32, 2, 16]` fp32. 1.25 bytes a weight, against the fp32 copy's 4.

`activation_bits=16` is the same product with the rows rounded to int16 per group of 32 (the
decode kernels' rounding, steps of max |x| / 32767: 256x finer), multiplied with AVX-512 VNNI
`vpdpwssd` or AVX2 `vpmaddwd` (half the int8 rate, about twice fp32's); its values come in pairs
of inputs, `[ceil(n / 16), k / 2, 16, 2]` (what `vpdpwssd` sums into one lane).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ragspeed.engine.native.compute.cpu_kernels.blocked import BLOCK, INT8_GROUP
from ragspeed.engine.native.compute.cpu_kernels.build import load_library

QUAD = 4  # inputs a lane of vpdpbusd sums
PAIR = 2  # inputs a lane of vpdpwssd sums
ISA_NAMES = {2: "avx512-vnni", 1: "avx2", 0: "plain C"}  # ragspeed_u4q8_isa()


def isa_of(library: ctypes.CDLL) -> str:
    """Which branch of the int8 products `library` was compiled with."""
    return ISA_NAMES[library.ragspeed_u4q8_isa()]


@dataclass(frozen=True)
class QuantizedRows:
    """Input rows [m, k] rounded to int8 per group of INT8_GROUP (llama.cpp's Q8_1)."""

    xq: torch.Tensor  # int8 [m, k]
    xs: torch.Tensor  # fp32 [m, k / INT8_GROUP]: each group's step, max |x| / 127
    xsum: torch.Tensor  # fp32 [m, k / INT8_GROUP]: the step times the group's sum of xq


def quantize_rows(x: torch.Tensor, num_threads: int, library: ctypes.CDLL | None = None) -> QuantizedRows:
    """x fp32 [m, k], k a multiple of INT8_GROUP -> its `QuantizedRows` (gemm_int8.c)."""
    library = library or load_library()
    assert library is not None, "blocked_kernels_available() first"
    x = x.contiguous()
    m, k = x.shape
    assert x.dtype == torch.float32 and k % INT8_GROUP == 0, (x.dtype, k)
    xq = torch.empty(m, k, dtype=torch.int8)
    xs = torch.empty(m, k // INT8_GROUP, dtype=torch.float32)
    xsum = torch.empty_like(xs)
    library.ragspeed_quantize_q8(
        x.data_ptr(), m, k, xq.data_ptr(), xs.data_ptr(), xsum.data_ptr(), num_threads
    )
    return QuantizedRows(xq, xs, xsum)


class Int8BlocksGemm:
    """A 4-bit weight (values uint8 [n, k] in 0..15, steps and offsets [n, k / 32, 2]: what
    `GgufBlocks.kernel_weight()` gives for Q4_0 and Q4_1) and an optional bias, in the layout
    above; `forward(x)` is `x @ (d q + m).T + bias` with x rounded to int8 per group of 32."""

    def __init__(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        library: ctypes.CDLL | None = None,
        activation_bits: int = 8,
    ):
        loaded = library or load_library()
        assert loaded is not None, "blocked_kernels_available() first"
        self.library: ctypes.CDLL = loaded
        n, k = values.shape
        assert values.dtype == torch.uint8 and k % INT8_GROUP == 0, (values.dtype, k)
        assert tuple(scales.shape) == (n, k // INT8_GROUP, 2), tuple(scales.shape)
        self.out_features, self.in_features = n, k
        num_blocks = -(-n // BLOCK)
        padded = torch.zeros(num_blocks * BLOCK, k, dtype=torch.uint8)
        padded[:n] = values
        assert activation_bits in (8, 16), activation_bits
        self.activation_bits = activation_bits
        lane = QUAD if activation_bits == 8 else PAIR
        # [blocks, 16, k / lane, lane] -> [blocks, k / lane, 16, lane]
        self.values = padded.view(num_blocks, BLOCK, k // lane, lane).transpose(1, 2).contiguous()
        self._product = (
            self.library.ragspeed_gemm_u4f32 if activation_bits == 8 else self.library.ragspeed_gemm_u4i16
        )
        padded_scales = torch.zeros(num_blocks * BLOCK, k // INT8_GROUP, 2)
        padded_scales[:n] = scales.float()
        # [blocks, 16, groups, 2] -> [blocks, groups, 2, 16]
        self.scales = padded_scales.view(num_blocks, BLOCK, -1, 2).permute(0, 2, 3, 1).contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.num_bytes = self.values.numel() + self.scales.numel() * 4
        self.element_size = 1  # bytes a weight value (the steps and offsets add 0.25 more)

    @property
    def isa(self) -> str:
        return isa_of(self.library)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [num_rows, in_features] -> fp32 [num_rows, out_features], on torch's threads
        (the linear layer's count: engine.native.compute.threads.linear_threads): the rows rounded inside the
        product, as `quantize_rows` rounds them (int8), so `forward_quantized` gives the same
        bits; or to int16 as the decode kernels round them (activation_bits 16)."""
        x = x.contiguous()
        assert x.dtype == torch.float32 and x.shape[1] == self.in_features, (x.dtype, x.shape)
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        self._product(
            self.values.data_ptr(),
            self.scales.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            x.data_ptr(),
            y.data_ptr(),
            x.shape[0],
            self.out_features,
            self.in_features,
            torch.get_num_threads(),
        )
        return y

    def forward_quantized(self, rows: QuantizedRows, num_threads: int) -> torch.Tensor:
        """The int8 product of rows quantized already (`quantize_rows`)."""
        assert self.activation_bits == 8, "int8 rows"
        m = rows.xq.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        self.library.ragspeed_gemm_u4q8(
            self.values.data_ptr(),
            self.scales.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            rows.xq.data_ptr(),
            rows.xs.data_ptr(),
            rows.xsum.data_ptr(),
            y.data_ptr(),
            m,
            self.out_features,
            self.in_features,
            num_threads,
        )
        return y


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [n, k] as Q4_1 would store it (values uint8 [n, k], fp16 steps and offsets
    [n, k / 32, 2]): the probe's stand-in for a file's blocks (the rate does not depend on them)."""
    n, k = weight.shape
    groups = weight.float().view(n, k // INT8_GROUP, INT8_GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    d = ((high - low) / 15).half().float()
    m = low.half().float()
    q = torch.where(d > 0, ((groups - m) / d.clamp_min(1e-30)).round(), torch.zeros_like(groups))
    values = q.clamp(0, 15).to(torch.uint8).view(n, k)
    return values, torch.cat([d, m], dim=-1).half()
