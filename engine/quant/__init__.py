"""Quantized weights for the native engine: int8 linear kinds and what this hardware runs.

`QUANT_KINDS` is merged into `engine.models.linear.LINEAR_KINDS`; this package imports nothing
from `engine.models`, so the model code depends on it and not the other way round.
"""

from ragspeed.engine.quant.memory import resident_weight_bytes, unquantized_weight_bytes
from ragspeed.engine.quant.per_channel import Int8Weight, quantize_per_channel
from ragspeed.engine.quant.registry import (
    QUANT_KINDS,
    Int8Linear,
    QuantizationUnavailableError,
    available_quantizations,
    check_quantization,
)

__all__ = [
    "QUANT_KINDS",
    "Int8Linear",
    "Int8Weight",
    "QuantizationUnavailableError",
    "available_quantizations",
    "check_quantization",
    "quantize_per_channel",
    "resident_weight_bytes",
    "unquantized_weight_bytes",
]
