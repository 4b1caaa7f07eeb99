"""The int8 kind's prefill paths on CPU: how a product of many rows multiplies the int8 weight.

Decode steps read every weight once per token, so the int8 kind serves them from ragspeed's
blocked kernel (1.0625 bytes a weight, activations in fp32: engine.cpu_kernels). Prefill chunks
are bound by arithmetic instead, and there the choice is between precision and speed:

- `fbgemm-u8`: fbgemm's dynamic quantization, activations rounded to uint8 per row
  (engine.quant.fbgemm_int8), int8 by uint8 products. Needs VNNI: without it fbgemm's AVX2
  kernel saturates 16-bit pair sums (engine.cpu_features). Its weights are per-channel int8
  requantized from the group-wise ones, so prefill and decode round the weights differently.
- `fp32-dequantized`: the group-wise int8 weight dequantized once, at load, to fp32 and packed
  for oneDNN; activations stay fp32, so prefill computes exactly what decode computes (the same
  int8 values and scales), at fp32's speed. Runs on every CPU.

`PREFILL_PATHS` lists them fastest first. `prefill_candidates(features)` keeps those this CPU
runs. A model loads on the last, most precise one: a faster path rounds the activations, which
only a quality gate on the model itself can clear (engine.quant.gate measures the candidates
fastest first and moves the model to the first that passes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ragspeed.engine.cpu_features import CpuFeatures
from ragspeed.engine.quant.fbgemm_int8 import FbgemmInt8Kernel, fbgemm_available
from ragspeed.engine.quant.groupwise import GroupInt8Weight
from ragspeed.engine.quant.per_channel import quantize_per_channel


class PrefillKernel(Protocol):
    num_bytes: int  # held

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...


class DequantizedKernel:
    """The int8 weight's fp32 values, packed once like engine.models.linear's dense kind."""

    PACKING_BATCH_HINT = 256

    def __init__(self, weight: GroupInt8Weight, bias: torch.Tensor | None):
        w = weight.dequantize().contiguous()  # fp32 [out_features, in_features]
        self.bias = None if bias is None else bias.float().contiguous()
        self.packed = self.weight = None
        if torch.backends.mkldnn.is_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, self.PACKING_BATCH_HINT)
        else:
            self.weight = w
        self.num_bytes = w.numel() * 4 + (0 if bias is None else bias.numel() * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [num_tokens, in_features] -> fp32 [num_tokens, out_features]."""
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return torch.nn.functional.linear(x, self.weight, self.bias)


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


def _runs_anywhere(features: CpuFeatures) -> str | None:
    return None


@dataclass(frozen=True)
class PrefillPath:
    name: str
    activations: str  # what a prefill product does to the activations
    missing: Callable[[CpuFeatures], str | None]  # why this CPU cannot run it, or None
    build: Callable[[GroupInt8Weight, torch.Tensor | None], PrefillKernel]


# Fastest first; the last runs everywhere.
PREFILL_PATHS: tuple[PrefillPath, ...] = (
    PrefillPath("fbgemm-u8", "rounded to 8 bits per row", _needs_vnni, _FbgemmPrefill),
    PrefillPath("fp32-dequantized", "kept in fp32", _runs_anywhere, DequantizedKernel),
)


def prefill_path(name: str) -> PrefillPath:
    for path in PREFILL_PATHS:
        if path.name == name:
            return path
    known = ", ".join(repr(p.name) for p in PREFILL_PATHS)
    raise ValueError(f"unknown int8 prefill path {name!r}; known: {known}")


def prefill_candidates(features: CpuFeatures) -> list[PrefillPath]:
    """The paths this CPU runs, fastest first (never empty)."""
    return [path for path in PREFILL_PATHS if path.missing(features) is None]


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
