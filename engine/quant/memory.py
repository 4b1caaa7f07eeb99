"""Resident weight bytes of a loaded `DecoderLM`: what the engine holds, quantized or not.

Counted: the embedding table, every linear kind's weights (`num_resident_bytes`: int8 rows plus
scales for a quantized kind, once per layout the kind keeps), the norms' weights. A tied LM
head counts twice: it keeps its own copy (fp32 packed, or int8) beside the embedding table.
"""

from __future__ import annotations

from torch import nn


def _norm_bytes(model: nn.Module) -> int:
    total = 0
    for module in model.modules():
        for attr in ("weight", "qk_norm_weight"):
            tensor = getattr(module, attr, None)
            if tensor is not None and not hasattr(module, "num_weight_bytes"):
                total += tensor.numel() * tensor.element_size()
    return total


def resident_weight_bytes(model: nn.Module) -> int:
    embed = model.embed_tokens
    linear_bytes = sum(m.num_resident_bytes for m in model.modules() if hasattr(m, "num_resident_bytes"))
    return embed.numel() * embed.element_size() + linear_bytes + _norm_bytes(model)


def unquantized_weight_bytes(model: nn.Module) -> int:
    """The same model's resident bytes with every linear in the embedding's dtype."""
    embed = model.embed_tokens
    linear_params = sum(m.num_params for m in model.modules() if hasattr(m, "num_params"))
    return (embed.numel() + linear_params) * embed.element_size() + _norm_bytes(model)
