"""Quantized linear kinds, by `EngineConfig.quantization` name, and what this hardware runs.

A *kind* is what `engine.native.models.linear.build_linear` builds for a quantization name: an empty
module of primitives (`in_features, out_features, bias`) that gets its float weights once, by
`load`, and quantizes and packs them there. A *kernel* is one device's implementation of a kind;
the kind picks it by the weight's device type when it loads. On CPU the kernel's prefill path
is chosen by the CPU's capabilities (engine.native.compute.cpu_features, engine.native.compute.quant.prefill);
`check_quantization`, which the loader calls once before reading weights, logs that choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from ragspeed.engine.native.compute import cpu_features
from ragspeed.engine.native.compute.linear_kind import LinearKind
from ragspeed.engine.native.compute.quant.cpu_int8 import CpuInt8Kernel
from ragspeed.engine.native.compute.quant.groupwise import quantize_groupwise
from ragspeed.engine.native.compute.quant.per_channel import quantize_per_channel
from ragspeed.engine.native.compute.quant.prefill import PREFILL_PATHS, describe_choice
from ragspeed.engine.native.compute.quant.weight_only_int8 import WeightOnlyInt8Kernel
from ragspeed.engine.native.compute.threads import linear_threads

logger = logging.getLogger(__name__)


class QuantizationUnavailableError(ValueError):
    """An unknown quantization name, or one this hardware cannot run."""


class Int8Kernel(Protocol):
    name: str
    num_weight_bytes: int  # read by a product
    num_resident_bytes: int  # held

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...


def _cpu_kernel(weight, bias, dtype) -> Int8Kernel:
    # The exact-activation path until a quality gate passes a faster one (engine.native.core.quality_gate).
    path = PREFILL_PATHS[-1]
    return CpuInt8Kernel(quantize_groupwise(weight), bias, torch.get_num_threads(), path)


def _cuda_kernel(weight, bias, dtype) -> Int8Kernel:
    return WeightOnlyInt8Kernel(quantize_per_channel(weight), bias, dtype)


# device type -> (is it runnable here, build a kernel from (fp weight, bias, activation dtype))
INT8_KERNELS: dict[str, tuple[Callable[[], bool], Callable[..., Int8Kernel]]] = {
    "cpu": (CpuInt8Kernel.available, _cpu_kernel),
    "cuda": (WeightOnlyInt8Kernel.available, _cuda_kernel),
}


class Int8Linear(LinearKind):
    """Per-output-channel symmetric int8 weights; `y = x @ W.T + b` through a device kernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias)
        self.kernel: Int8Kernel | None = None

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.check_weights(weight, bias)
        available, build = INT8_KERNELS.get(weight.device.type, (lambda: False, None))
        if not available():
            check_quantization("int8", weight.device)  # raises, listing what runs there
        assert build is not None  # a device with no int8 kernel raised above
        self.kernel = build(weight, bias, weight.dtype)

    def blocked_weight(self):
        return getattr(self.kernel, "blocked", None)

    @property
    def num_weight_bytes(self) -> int:
        """Bytes read per forward: int8 weights, fp32 scales and the bias."""
        assert self.kernel is not None, "load() first"
        return self.kernel.num_weight_bytes

    @property
    def num_resident_bytes(self) -> int:
        assert self.kernel is not None, "load() first"
        return self.kernel.num_resident_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features]."""
        assert self.kernel is not None, "load() first"
        if x.device.type != "cpu":
            return self.kernel.forward(x)
        return linear_threads(self.num_threads, self.kernel.forward, x)

    def extra_repr(self) -> str:
        kernel = "unloaded" if self.kernel is None else self.kernel.name
        return f"{self.in_features} -> {self.out_features}, bias={self.has_bias}, {kernel}"


# quantization name -> linear kind; merged into engine.native.models.linear.LINEAR_KINDS.
QUANT_KINDS: dict[str | None, Callable[[int, int, bool], LinearKind]] = {"int8": Int8Linear}

# quantization name -> device type -> is it runnable here.
_RUNNABLE: dict[str, dict[str, Callable[[], bool]]] = {
    "int8": {device: available for device, (available, _) in INT8_KERNELS.items()},
    # a GGUF file's own blocks (engine.native.compute.quant.gguf_blocks); dense products where no kernel runs
    "gguf": {"cpu": lambda: True},
}


def available_quantizations(device: str | torch.device = "cpu") -> list[str | None]:
    """Quantization names this process can run on `device` (None: unquantized)."""
    device_type = torch.device(device).type
    runnable = [
        name for name, devices in _RUNNABLE.items() if device_type in devices and devices[device_type]()
    ]
    return [None, *runnable]


def check_quantization(name: str | None, device: str | torch.device = "cpu") -> None:
    """Raise QuantizationUnavailableError, listing what runs here, unless `name` runs on
    `device`."""
    available = available_quantizations(device)
    if name in available:
        if name == "int8" and torch.device(device).type == "cpu":
            logger.info(describe_choice(cpu_features.read_cpu_features()))
        return
    listed = ", ".join("none" if n is None else repr(n) for n in available)
    device_type = torch.device(device).type
    if name not in _RUNNABLE:
        raise QuantizationUnavailableError(
            f"unknown quantization {name!r}; available on {device_type}: {listed}"
        )
    raise QuantizationUnavailableError(
        f"quantization {name!r} cannot run on {device_type} here; available on {device_type}: {listed}"
    )
