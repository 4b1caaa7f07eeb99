"""One prefill path: a way a product of many rows multiplies a weight, as the tables of paths
(engine.native.compute.quant.prefill, engine.native.models.linear) list them, the probe times them
(engine.native.compute.quant.probe) and the quality gate clears them (engine.native.core.quality_gate). Below all of those:
it imports nothing of the engine but the CPU's features."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ragspeed.engine.native.compute.cpu_features import CpuFeatures


class PrefillKernel(Protocol):
    num_bytes: int  # held

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...


def runs_anywhere(features: CpuFeatures) -> str | None:
    return None


def as_float(weight: torch.Tensor) -> torch.Tensor:
    """A dense path's `prepare`: it builds from the float weight itself."""
    return weight


@dataclass(frozen=True)
class PrefillPath:
    name: str
    precision: str  # "fp32", "bf16" or "int8": what the product does to the activations
    activations: str  # the same, in words
    missing: Callable[[CpuFeatures], str | None]  # why this CPU cannot run it, or None
    build: Callable[..., PrefillKernel]  # (prepare(weight), bias) -> kernel
    # what `build` takes, from a float weight [out_features, in_features] (the probe's)
    prepare: Callable[[torch.Tensor], Any] = as_float
