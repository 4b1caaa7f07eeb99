"""The int8 kind's prefill paths on CPU: how a product of many rows multiplies the int8 weight.

Decode steps read every weight once per token, so the int8 kind serves them from ragspeed's
blocked kernel (1.0625 bytes a weight, activations in fp32: engine.cpu_kernels). Prefill chunks
are bound by arithmetic instead, and there the choice is between precision and speed:

- `fbgemm-u8`: fbgemm's dynamic quantization, activations rounded to uint8 per row
  (engine.quant.fbgemm_int8), int8 by uint8 products. Needs VNNI: without it fbgemm's AVX2
  kernel saturates 16-bit pair sums (engine.cpu_features). Its weights are per-channel int8
  requantized from the group-wise ones, so prefill and decode round the weights differently.
- `bf16-dequantized`: the group-wise int8 weight dequantized once, at load, to bf16 and packed
  for oneDNN (engine.packed); activations rounded to bf16 for the product. Needs AMX-BF16 or
  AVX512-BF16.
- `fp32-dequantized`: the same, in fp32: activations stay fp32, so prefill computes exactly
  what decode computes (the same int8 values and scales), at fp32's speed. Runs on every CPU.

A `PrefillPath` is one row of such a table (the dense kind has its own, engine.models.linear):
what it does to the activations (`precision`: which `--dtype` admits it, engine.precision), why
a CPU cannot run it, and its GEMM rate over fp32's on a CPU (`speedup`, from the rates measured
on an Intel Xeon with AMX). `prefill_candidates(features)` keeps those this CPU runs, fastest
first; the last, the most precise, is what a model loads on. A faster path rounds the
activations, which only a quality gate on the model itself can clear (engine.quant.gate
measures the candidates fastest first and moves the model to the first that passes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ragspeed.engine.cpu_features import CpuFeatures
from ragspeed.engine.packed import PackedLinear, bf16_missing
from ragspeed.engine.quant.fbgemm_int8 import FbgemmInt8Kernel, fbgemm_available
from ragspeed.engine.quant.groupwise import GroupInt8Weight
from ragspeed.engine.quant.per_channel import quantize_per_channel


class PrefillKernel(Protocol):
    num_bytes: int  # held

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...


def _dequantized(dtype: torch.dtype) -> Callable[[GroupInt8Weight, torch.Tensor | None], PrefillKernel]:
    def build(weight: GroupInt8Weight, bias: torch.Tensor | None) -> PrefillKernel:
        return PackedLinear(weight.dequantize(), None if bias is None else bias.float(), dtype)

    return build


class _FbgemmPrefill:
    def __init__(self, weight: GroupInt8Weight, bias: torch.Tensor | None):
        self.kernel = FbgemmInt8Kernel(quantize_per_channel(weight.dequantize()), bias)
        self.num_bytes = self.kernel.num_weight_bytes
        self.forward = self.kernel.forward


def _needs_vnni(features: CpuFeatures) -> str | None:
    if not fbgemm_available():
        return "this torch build has no fbgemm/x86 quantized engine"
    if not features.has_vnni:
        return "no VNNI (avx512_vnni / avx_vnni): fbgemm's AVX2 kernel saturates"
    return None


def runs_anywhere(features: CpuFeatures) -> str | None:
    return None


# GEMM rates over fp32 on an Intel Xeon with AMX (2 threads, 2,048 rows): bf16 `linear`
# on AMX 1,113 vs fp32 218 GFLOP/s; fbgemm's int8 536 GOP/s. AVX512-BF16 without AMX doubles
# the products per instruction of an fp32 FMA: about 2x.
def bf16_speedup(features: CpuFeatures) -> float:
    return 5.1 if "amx_bf16" in features.flags else 2.0


def _fbgemm_speedup(features: CpuFeatures) -> float:
    return 2.5


def fp32_speedup(features: CpuFeatures) -> float:
    return 1.0


@dataclass(frozen=True)
class PrefillPath:
    name: str
    precision: str  # "fp32", "bf16" or "int8": what the product does to the activations
    activations: str  # the same, in words
    missing: Callable[[CpuFeatures], str | None]  # why this CPU cannot run it, or None
    speedup: Callable[[CpuFeatures], float]  # its GEMM rate over fp32's on a CPU that runs it
    build: Callable[..., PrefillKernel]  # (weight, bias) -> kernel


# Every path a CPU may run; the last runs everywhere and rounds nothing.
PREFILL_PATHS: tuple[PrefillPath, ...] = (
    PrefillPath(
        "fbgemm-u8", "int8", "rounded to 8 bits per row", _needs_vnni, _fbgemm_speedup, _FbgemmPrefill
    ),
    PrefillPath(
        "bf16-dequantized",
        "bf16",
        "rounded to bf16",
        bf16_missing,
        bf16_speedup,
        _dequantized(torch.bfloat16),
    ),
    PrefillPath(
        "fp32-dequantized", "fp32", "kept in fp32", runs_anywhere, fp32_speedup, _dequantized(torch.float32)
    ),
)


def prefill_path(name: str) -> PrefillPath:
    for path in PREFILL_PATHS:
        if path.name == name:
            return path
    known = ", ".join(repr(p.name) for p in PREFILL_PATHS)
    raise ValueError(f"unknown int8 prefill path {name!r}; known: {known}")


def runnable_paths(paths: tuple[PrefillPath, ...], features: CpuFeatures) -> list[PrefillPath]:
    """Those of `paths` (the last one runs everywhere) this CPU runs, fastest first; ties keep
    the table's order, and the last of `paths` stays last."""
    *faster, exact = paths
    runnable = [p for p in faster if p.missing(features) is None]
    return sorted(runnable, key=lambda p: -p.speedup(features)) + [exact]


def prefill_candidates(features: CpuFeatures) -> list[PrefillPath]:
    """The int8 paths this CPU runs, fastest first (never empty)."""
    return runnable_paths(PREFILL_PATHS, features)


def describe_choice(features: CpuFeatures) -> str:
    """The start-up line: the CPU, the prefill path a model loads on, the faster paths this CPU
    runs once a quality gate passes them, and why the others do not run here."""
    candidates = prefill_candidates(features)
    chosen = candidates[-1]
    line = (
        f"int8 on {features.describe()}: prefill {chosen.name} (activations "
        f"{chosen.activations}), decode ragspeed's blocked int8 kernel"
    )
    gated = [p.name for p in candidates[:-1]]
    if gated:
        line += f"; {', '.join(gated)} runs here once the quality gate passes it"
    missing = [f"{p.name}: {p.missing(features)}" for p in PREFILL_PATHS if p not in candidates]
    return line + (f"; not {'; '.join(missing)}" if missing else "")
