"""Per-output-channel symmetric int8 weights: one fp32 scale per output row, zero point 0.

`W[o, i] ~= q[o, i] * scale[o]` with `q` in [-127, 127] and `scale[o] = max_i |W[o, i]| / 127`.
Symmetric (no zero point) keeps the product `x @ q.T * scale` free of correction terms; one
scale per row keeps a row with small weights from losing its precision to a row with large ones.
-128 is never used, so negating a row never overflows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127


@dataclass(frozen=True)
class Int8Weight:
    qweight: torch.Tensor  # int8 [out_features, in_features]
    scales: torch.Tensor  # fp32 [out_features]

    @property
    def num_bytes(self) -> int:
        return (
            self.qweight.numel() * self.qweight.element_size()
            + self.scales.numel() * self.scales.element_size()
        )

    def dequantize(self) -> torch.Tensor:
        """fp32 [out_features, in_features]: what the int8 weight stands for."""
        return self.qweight.float() * self.scales[:, None]


def quantize_per_channel(weight: torch.Tensor) -> Int8Weight:
    """weight [out_features, in_features], any float dtype -> int8 rows and their fp32 scales."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor, got {weight.dim()}-D {weight.dtype}")
    w = weight.float()
    # An all-zero row would give scale 0 (and 0/0 below): any positive scale represents it.
    scales = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    qweight = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(qweight.contiguous(), scales.contiguous())
