"""Prefill products with int8 activations on the file's 4-bit blocks (engine.native.compute.cpu_kernels.int8_prefill),
each branch of gemm_int8.c built and run here: the build for this CPU, the AVX2 one (what an
AVX2-only CPU compiles; an AVX-512 CPU runs its code) and the plain C one.

References in numpy / float64 from the same quantized rows:
- the rounding of the rows is compared bit for bit (fp32 arithmetic, as gemm_int8.c's);
- the integer sums are compared exactly: with steps of 1, offsets and row sums of 0, each output
  is a sum of int32 group sums below 2^24 in magnitude, which fp32 holds exactly;
- the scaled product is within the bound of its fp32 arithmetic: each output adds 2G terms
  (G groups: `m * xsum` and `acc * (d * xs)`) by fused multiply-adds, each term and partial sum
  rounded at most twice more than the exact value (the product `d * xs`, the fma), so
  |y - exact| <= gamma(2G + 2) * sum of |terms|, gamma(n) = n u / (1 - n u), u = 2^-24 (Higham,
  recursive summation), one more for the row sum's own rounding and the bias.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from ragspeed.engine.native.compute.cpu_features import read_cpu_features
from ragspeed.engine.native.compute.cpu_kernels import load_library
from ragspeed.engine.native.compute.cpu_kernels.int8_prefill import (
    Int8BlocksGemm,
    QuantizedRows,
    isa_of,
    quantize_q4_1,
    quantize_rows,
)
from ragspeed.engine.native.compute.quant.gguf_blocks import GgufBlocks
from tests.engine.conftest import KERNEL_ISAS, int16_rows, kernel_library

pytestmark = pytest.mark.skipif(
    load_library() is None, reason="ragspeed's CPU kernels could not be built here"
)

U = 2.0**-24


def test_each_build_runs_its_branch():
    flags = read_cpu_features().flags
    native = "avx512-vnni" if "avx512_vnni" in flags else "avx2" if "avx2" in flags else "plain C"
    assert isa_of(kernel_library("native")) == native
    if "avx2" in flags:
        assert isa_of(kernel_library("avx2")) == "avx2"
    assert isa_of(kernel_library("plain")) == "plain C"


def _numpy_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """the kernels' rounding in numpy fp32: step max |x| / 127 a group of 32, q = rint(x * 127 / max)."""
    m, k = x.shape
    groups = x.reshape(m, k // 32, 32)
    amax = np.abs(groups).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(groups * inverse).astype(np.int32)
    step = (amax / np.float32(127)).astype(np.float32)[:, :, 0]
    xsum = (q.sum(axis=2).astype(np.float32) * step).astype(np.float32)
    return q.reshape(m, k).astype(np.int8), step, xsum


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_rows_round_as_numpy_does(isa):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 192, generator=gen) * torch.rand(37, 1, generator=gen) * 10
    x[0, :32] = 0.0  # a group of zeros: step 0, values 0
    x[1, 32:64] = torch.arange(32) - 15.5  # evenly spaced values, the largest at both ends
    rows = quantize_rows(x, 2, kernel_library(isa))
    xq, xs, xsum = _numpy_rows(x.numpy())
    assert np.array_equal(rows.xq.numpy(), xq)
    assert np.array_equal(rows.xs.numpy(), xs)
    assert np.array_equal(rows.xsum.numpy(), xsum)
    assert rows.xq.abs().max() == 127 and (rows.xq[0, :32] == 0).all() and rows.xs[0, 0] == 0


def _random_q4(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = torch.rand(n, k // 32, 1, generator=gen) * 0.02
    m = -torch.rand(n, k // 32, 1, generator=gen) * 0.15
    return values, torch.cat([d, m], dim=-1).half()


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("m, n, k", [(1, 16, 32), (5, 37, 96), (37, 64, 576), (300, 40, 64)])
def test_integer_sums_are_exact(isa, m, n, k):
    """Steps 1, offsets 0, row steps 1 and row sums 0: y is the integer product itself."""
    gen = torch.Generator().manual_seed(m + n + k)
    values, _ = _random_q4(n, k, gen)
    scales = torch.stack([torch.ones(n, k // 32), torch.zeros(n, k // 32)], dim=-1)
    gemm = Int8BlocksGemm(values, scales, library=kernel_library(isa))
    xq = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    rows = QuantizedRows(xq, torch.ones(m, k // 32), torch.zeros(m, k // 32))
    exact = xq.numpy().astype(np.int64) @ values.numpy().astype(np.int64).T
    assert np.abs(exact).max() < 2**24
    assert np.array_equal(gemm.forward_quantized(rows, 2).numpy(), exact.astype(np.float32))


def _assert_within_fp32_bound(y: torch.Tensor, rows: QuantizedRows, values, scales, bias) -> None:
    """y against the float64 product of the same quantized rows, within gamma(2G + 3) of the
    sum of the magnitudes of its terms (module docstring)."""
    n, k = values.shape
    groups = k // 32
    xq = rows.xq.double().view(-1, groups, 32)
    q = values.double().view(n, groups, 32)
    acc = torch.einsum("rgi,cgi->rcg", xq, q)  # exact: integers below 2^53
    d, m = scales.double().unbind(-1)  # [n, groups]
    scaled = acc * d.unsqueeze(0) * rows.xs.double().unsqueeze(1)  # [rows, n, groups]
    offset = m.unsqueeze(0) * rows.xsum.double().unsqueeze(1)
    exact = (scaled + offset).sum(-1) + (0 if bias is None else bias.double())
    magnitude = (scaled.abs() + offset.abs()).sum(-1) + (0 if bias is None else bias.double().abs())
    steps = 2 * groups + 3
    bound = steps * U / (1 - steps * U) * magnitude
    excess = (y.double() - exact).abs() - bound
    assert excess.max() <= 0, f"{excess.max():.3g} beyond the fp32 bound"


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("m, n, k", [(1, 16, 32), (7, 37, 96), (37, 64, 576), (300, 40, 64)])
def test_products_are_the_quantized_rows_times_the_weight(isa, m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    values, scales = _random_q4(n, k, gen)
    bias = torch.randn(n, generator=gen) if m % 2 else None
    gemm = Int8BlocksGemm(values, scales, bias, library=kernel_library(isa))
    x = torch.randn(m, k, generator=gen)
    rows = quantize_rows(x, 2, gemm.library)
    y = gemm.forward_quantized(rows, 2)
    _assert_within_fp32_bound(y, rows, values, scales, bias)
    torch.testing.assert_close(gemm.forward(x), y, rtol=0, atol=0)  # forward: the same steps


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_a_files_blocks_multiply_with_int8_rows(qtype):
    """A file's Q4_0 / Q4_1 blocks as GgufBlocks hands them to the kernels: the product is the
    quantized rows times the file's dequantized weight; and within the int8 rounding of x
    (at most half a step, max |x| / 254, per input) of x times it."""
    gen = torch.Generator().manual_seed(7)
    weight = np.random.default_rng(1).normal(0.0, 0.1, size=(48, 576)).astype(np.float32)
    blocks = GgufBlocks(qtype, torch.from_numpy(quantize(weight, GGMLQuantizationType[qtype])))
    values, scales = blocks.kernel_weight()
    gemm = Int8BlocksGemm(values, scales)
    x = torch.randn(20, 576, generator=gen)
    rows = quantize_rows(x, 2)
    y = gemm.forward_quantized(rows, 2)
    _assert_within_fp32_bound(y, rows, values, scales, None)
    dense = blocks.dequantize().double()
    half_steps = (rows.xs.double() / 2).repeat_interleave(32, dim=1)  # [rows, k]
    rounding_bound = half_steps @ dense.abs().T
    assert ((y.double() - x.double() @ dense.T).abs() <= rounding_bound + 1e-4).all()


def test_the_probes_stand_in_is_q4_1():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 64, generator=gen) * 0.1
    values, scales = quantize_q4_1(weight)
    assert values.max() <= 15 and scales.shape == (32, 2, 2)
    d, m = scales.float().unbind(-1)
    dequantized = values.view(32, 2, 32).float() * d.unsqueeze(-1) + m.unsqueeze(-1)
    assert (dequantized.view(32, 64) - weight).abs().max() <= d.max() * 0.51 + 1e-3


@pytest.mark.parametrize("isa", KERNEL_ISAS)
@pytest.mark.parametrize("m, n, k", [(1, 16, 32), (7, 37, 96), (37, 64, 576), (300, 40, 64)])
def test_int16_activations_are_the_decode_kernels_rounding(isa, m, n, k):
    """activation_bits 16: the rows rounded as the decode kernels round them (conftest's
    int16_rows, fp32 arithmetic as the decode kernels'), times the weight, within the fp32 bound; and
    the integer sums exact (steps 1, offsets 0, rows of integers below 32,767: their own steps
    are 1 only where a group's largest is 32,767, so the rows here hold it in every group)."""
    gen = torch.Generator().manual_seed(m * n + k + 1)
    values, scales = _random_q4(n, k, gen)
    bias = torch.randn(n, generator=gen) if m % 2 else None
    gemm = Int8BlocksGemm(values, scales, bias, library=kernel_library(isa), activation_bits=16)
    x = torch.randn(m, k, generator=gen)
    rounded = int16_rows(x)  # [m, k]: the int16 values times their steps, fp32
    groups = rounded.view(m, k // 32, 32)
    steps = x.view(m, k // 32, 32).abs().amax(-1) / 32767
    xq = torch.round(groups / steps.unsqueeze(-1)).view(m, k).to(torch.int16)
    rows = QuantizedRows(xq, steps, xq.view(m, k // 32, 32).sum(-1).float() * steps)
    _assert_within_fp32_bound(gemm.forward(x), rows, values, scales, bias)

    ones = torch.stack([torch.ones(n, k // 32), torch.zeros(n, k // 32)], dim=-1)
    integers = torch.randint(-500, 501, (m, k), generator=gen)
    integers.view(m, k // 32, 32)[:, :, 0] = 32767  # each group's step: exactly 1
    exact = integers.numpy().astype(np.int64) @ values.numpy().astype(np.int64).T
    assert np.abs(exact).max() < 2**24  # every partial sum exact in fp32
    unit = Int8BlocksGemm(values, ones, library=kernel_library(isa), activation_bits=16)
    assert np.array_equal(unit.forward(integers.float()).numpy(), exact.astype(np.float32))
