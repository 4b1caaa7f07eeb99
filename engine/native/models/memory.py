"""Resident weight bytes of a loaded `DecoderLM`: what the engine holds, quantized or not.

Counted: the embedding table (a GGUF file's blocks where the lookup reads them), every linear
kind's weights (`num_resident_bytes`: int8 rows plus scales for a quantized kind, once per
layout the kind keeps), the norms' weights. A tied LM head counts twice: it keeps its own copy
(fp32 packed, int8, or the file's blocks in the kernels' layout) beside the embedding table.
"""

from __future__ import annotations

import torch
from torch import nn

from ragspeed.engine.native.compute.quant.gguf_blocks import GgufBlocks
from ragspeed.engine.native.models.decoder import DecoderLM


def _norm_bytes(model: nn.Module) -> int:
    total = 0
    for module in model.modules():
        for attr in ("weight", "qk_norm_weight"):
            tensor = getattr(module, attr, None)
            if tensor is not None and not hasattr(module, "num_weight_bytes"):
                total += tensor.numel() * tensor.element_size()
    return total


def _embedding_bytes(model: DecoderLM) -> int:
    embed = model.embed_tokens
    assert embed is not None, "the weights are not loaded"
    if isinstance(embed, GgufBlocks):
        return embed.num_bytes
    return embed.numel() * embed.element_size()


def resident_weight_bytes(model: DecoderLM) -> int:
    linear_bytes = sum(getattr(m, "num_resident_bytes", 0) for m in model.modules())
    return _embedding_bytes(model) + linear_bytes + _norm_bytes(model)


def unquantized_weight_bytes(model: DecoderLM) -> int:
    """The same model's resident bytes with the embedding and every linear in the model's
    compute dtype."""
    assert model.embed_tokens is not None, "the weights are not loaded"
    vocab_size, hidden_size = model.embed_tokens.shape
    linear_params = sum(getattr(m, "num_params", 0) for m in model.modules())
    element_size = torch.empty((), dtype=model.dtype).element_size()
    return (vocab_size * hidden_size + linear_params) * element_size + _norm_bytes(model)
