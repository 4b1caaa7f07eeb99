"""Quantized weights for the native engine: int8 linear kinds and what this hardware runs.

On CPU the int8 kind keeps group-wise int8 weights (groups): decode steps read them through
ragspeed's blocked kernel, prefill chunks through a path chosen by the CPU's capabilities
(prefill, engine.native.compute.cpu_features) and kept only if it passes the quality gate
(engine.native.core.quality_gate). On CUDA it is weight-only int8 with per-channel scales
(per_channel, weight_only_int8).

`QUANT_KINDS` is merged into `engine.native.models.linear.LINEAR_KINDS`; this package is of the
compute layer and imports nothing from `engine.native.models`, so the model code depends on it
and not the other way round. The quality gate that measures a loaded model's int8 paths
(engine.native.core.quality_gate, engine.native.core.quality) stands in the core, beside the
precision stage that runs it after loading.
"""

from ragspeed.engine.native.compute.quant.groupwise import GroupInt8Weight, quantize_groupwise
from ragspeed.engine.native.compute.quant.per_channel import Int8Weight, quantize_per_channel
from ragspeed.engine.native.compute.quant.registry import (
    QUANT_KINDS,
    Int8Linear,
    QuantizationUnavailableError,
    available_quantizations,
    check_quantization,
)

__all__ = [
    "QUANT_KINDS",
    "GroupInt8Weight",
    "quantize_groupwise",
    "Int8Linear",
    "Int8Weight",
    "QuantizationUnavailableError",
    "available_quantizations",
    "check_quantization",
    "quantize_per_channel",
]
