"""The int8 kind's prefill paths on CPU: how a product of many rows multiplies the int8 weight.

Decode steps read every weight once per token, so the int8 kind serves them from ragspeed's
blocked kernel (1.0625 bytes a weight, activations in fp32: engine.native.compute.cpu_kernels). Prefill chunks
are bound by arithmetic instead, and there the choice is between precision and speed:

- `fbgemm-u8`: fbgemm's dynamic quantization, activations rounded to uint8 per row
  (engine.native.compute.quant.fbgemm_int8), int8 by uint8 products. Needs VNNI: without it fbgemm's AVX2
  kernel saturates 16-bit pair sums (engine.native.compute.cpu_features). Its weights are per-channel int8
  requantized from the group-wise ones, so prefill and decode round the weights differently.
- `bf16-dequantized`: the group-wise int8 weight dequantized once, at load, to bf16 and packed
  for oneDNN (engine.native.compute.packed); activations rounded to bf16 for the product. Needs AMX-BF16 or
  AVX512-BF16.
- `fp32-dequantized`: the same, in fp32: activations stay fp32, so prefill computes exactly
  what decode computes (the same int8 values and scales), at fp32's speed. Runs on every CPU.

A `PrefillPath` (engine.native.compute.quant.prefill_path) is one row of such a table (the dense kind has its
own, engine.native.models.linear):
what it does to the activations (`precision`: which `--dtype` admits it, engine.native.core.precision), why
a CPU cannot run it, and how it packs a float weight (`prepare`, then `build`).
`prefill_candidates(features, probe)` keeps those this CPU runs, fastest first by the rates the
probe measures on this machine (engine.native.compute.quant.probe); the last, the most precise, is what a model
loads on. A faster path rounds the activations, which only a quality gate on the model itself
can clear (engine.native.core.quality_gate measures the candidates fastest first and moves the model to the
first that passes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ragspeed.engine.native.compute.cpu_features import CpuFeatures
from ragspeed.engine.native.compute.packed import PackedLinear, bf16_missing
from ragspeed.engine.native.compute.quant.fbgemm_int8 import FbgemmInt8Kernel, fbgemm_available
from ragspeed.engine.native.compute.quant.groupwise import GroupInt8Weight, quantize_groupwise
from ragspeed.engine.native.compute.quant.per_channel import quantize_per_channel
from ragspeed.engine.native.compute.quant.prefill_path import PrefillKernel, PrefillPath, runs_anywhere
from ragspeed.engine.native.compute.quant.probe import PrefillProbe


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


# Every path a CPU may run; the last runs everywhere and rounds nothing.
PREFILL_PATHS: tuple[PrefillPath, ...] = (
    PrefillPath(
        "fbgemm-u8", "int8", "rounded to 8 bits per row", _needs_vnni, _FbgemmPrefill, quantize_groupwise
    ),
    PrefillPath(
        "bf16-dequantized",
        "bf16",
        "rounded to bf16",
        bf16_missing,
        _dequantized(torch.bfloat16),
        quantize_groupwise,
    ),
    PrefillPath(
        "fp32-dequantized",
        "fp32",
        "kept in fp32",
        runs_anywhere,
        _dequantized(torch.float32),
        quantize_groupwise,
    ),
)


def prefill_path(name: str) -> PrefillPath:
    for path in PREFILL_PATHS:
        if path.name == name:
            return path
    known = ", ".join(repr(p.name) for p in PREFILL_PATHS)
    raise ValueError(f"unknown int8 prefill path {name!r}; known: {known}")


def runnable_paths(
    paths: tuple[PrefillPath, ...],
    features: CpuFeatures,
    probe: PrefillProbe,
    required: str | None = None,
) -> list[PrefillPath]:
    """Those of `paths` (the last one runs everywhere) this CPU runs, fastest first by the rates
    `probe` measures (ties keep the table's order); the last of `paths` stays last, and a path
    measured no faster than it is dropped unless its precision is `required` (a `--dtype` asked
    for it). Nothing is measured where only the last runs."""
    *faster, exact = paths
    runnable = [p for p in faster if p.missing(features) is None]
    if not runnable:
        return [exact]
    kept = [p.name for p in runnable if p.precision == required]
    return probe.fastest_first(runnable, exact, features, kept)


def prefill_candidates(features: CpuFeatures, probe: PrefillProbe) -> list[PrefillPath]:
    """The int8 paths this CPU runs, fastest first (never empty)."""
    return runnable_paths(PREFILL_PATHS, features, probe)


def describe_choice(features: CpuFeatures) -> str:
    """The start-up line: the CPU, the prefill path a model loads on, the faster paths this CPU
    runs once a quality gate passes them (in the table's order: the probe orders them when the
    model's engine starts), and why the others do not run here."""
    *faster, chosen = PREFILL_PATHS
    candidates = [p for p in faster if p.missing(features) is None] + [chosen]
    line = (
        f"int8 on {features.describe()}: prefill {chosen.name} (activations "
        f"{chosen.activations}), decode ragspeed's blocked int8 kernel"
    )
    gated = [p.name for p in candidates[:-1]]
    if gated:
        line += f"; {', '.join(gated)} runs here once the quality gate passes it"
    missing = [f"{p.name}: {p.missing(features)}" for p in PREFILL_PATHS if p not in candidates]
    return line + (f"; not {'; '.join(missing)}" if missing else "")
