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
    """`y = x @ W.T + b` with the weight kept in the compute dtype, split by output columns.

    Layout `[num_partitions, in_features, out_features / num_partitions]` (W.T cut into column
    slices, the last padded with zero columns): one `bmm` multiplies the slices side by side,
    one per CPU thread, and each slice streams its rows contiguously. A batch-1 decode step is
    bound by reading these weights, and MKL runs a one-row `mm` on a single thread; the slices
    put every core's bandwidth to work. Measured on the 2-core development CPU over bench-135m's
    121 matrices (fp32, 538 MB): 1 token 32.2 -> 21.5 ms, 5 tokens 77.4 -> 41.9 ms, 16 tokens
    94.3 -> 60.2 ms, 256 tokens 391 -> 336 ms. The `[in, out]` orientation itself streams about
    twice as fast as `[out, in]` at batch 1 (12 vs 6 GB/s on a 113 MB LM head).
    `num_partitions` is the torch thread count at load (1 on GPUs: one `mm`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        self.weight: torch.Tensor | None = None  # [num_partitions, in_features, padded_out / P]
        self.bias: torch.Tensor | None = None  # [out_features]

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} does not fit a linear "
                f"{self.in_features} -> {self.out_features}"
            )
        if self.has_bias != (bias is not None):
            raise ValueError(f"linear expects bias={self.has_bias}, got {bias is not None}")
        parts = torch.get_num_threads() if weight.device.type == "cpu" else 1
        parts = max(1, min(parts, self.out_features))
        width = -(-self.out_features // parts)  # columns per slice
        padded = weight.new_zeros(parts * width, self.in_features)
        padded[: self.out_features] = weight
        # [P * width, in] -> [P, width, in] -> [P, in, width]
        self.weight = padded.view(parts, width, self.in_features).transpose(1, 2).contiguous()
        self.bias = None if bias is None else bias.contiguous()

    @property
    def num_partitions(self) -> int:
        assert self.weight is not None
        return self.weight.shape[0]

    @property
    def num_weight_bytes(self) -> int:
        """Bytes read per forward: what a token costs in memory bandwidth (padding excluded)."""
        assert self.weight is not None
        return self.num_params * self.weight.element_size()

    @property
    def num_params(self) -> int:
        return self.in_features * self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features]."""
        parts, _, width = self.weight.shape
        if parts == 1:
            y = torch.mm(x, self.weight[0])
        else:
            # [P, num_tokens, width] -> [num_tokens, P * width]: slice p holds columns p*width..
            y = torch.bmm(x.expand(parts, *x.shape), self.weight)
            y = y.transpose(0, 1).reshape(x.shape[0], parts * width)
        if parts * width != self.out_features:
            y = y[:, : self.out_features]
        return y if self.bias is None else y.add_(self.bias)


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
