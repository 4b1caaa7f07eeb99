"""The one place where the engine builds linear layers.

Every projection of the model (fused QKV, output, fused gate-up, down, LM head) is built by
`build_linear`, so a quantized kind (per-output-channel int8 through
`torch.ops.quantized.linear_dynamic`, a later task) only has to register one class here.

A linear kind is built empty from primitives and then given its float weights once by `load`,
which is where a quantized kind would pack them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.quant import QUANT_KINDS


class DenseLinear(nn.Module):
    """`y = x @ W.T + b` with the weight kept in the compute dtype, stored transposed.

    `W.T` is stored contiguous (`[in_features, out_features]`): at batch 1 the product then
    streams the weight row after row, which MKL runs at about twice the bandwidth of the
    `[out, in]` layout here (12 vs 6 GB/s on a 113 MB LM head); decode time per token is
    bound by exactly that read.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.weight_t: torch.Tensor | None = None  # [in_features, out_features]
        self.bias: torch.Tensor | None = None  # [out_features]

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} does not fit a linear "
                f"{self.in_features} -> {self.out_features}"
            )
        if self.has_bias != (bias is not None):
            raise ValueError(f"linear expects bias={self.has_bias}, got {bias is not None}")
        self.weight_t = weight.t().contiguous()
        self.bias = None if bias is None else bias.contiguous()

    @property
    def num_weight_bytes(self) -> int:
        """Bytes read per forward: what a token costs in memory bandwidth."""
        assert self.weight_t is not None
        return self.weight_t.numel() * self.weight_t.element_size()

    @property
    def num_params(self) -> int:
        return self.in_features * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features]."""
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


# quantization name (EngineConfig.quantization) -> linear kind.
LINEAR_KINDS: dict[str | None, Callable[[int, int, bool], nn.Module]] = {
    None: DenseLinear,
    **QUANT_KINDS,  # 'int8' (engine.quant)
}


def build_linear(
    in_features: int, out_features: int, *, bias: bool = False, quantization: str | None = None
) -> nn.Module:
    kind = LINEAR_KINDS.get(quantization)
    if kind is None:
        known = ", ".join(repr(k) for k in LINEAR_KINDS)
        raise ValueError(f"unknown quantization {quantization!r}; known: {known}")
    return kind(in_features, out_features, bias)
