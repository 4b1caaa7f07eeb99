"""Weight-only int8 linear for CUDA: int8 weights in memory, activations stay in bf16/fp16.

Decoding on a GPU is bound by reading the weights, so halving their bytes (vs bf16) is the
gain; the product itself runs in the activation dtype. Two kernels, chosen once at load:
- `torch._weight_int8pack_mm(x, q, scales)` where this torch build has it for the device
  (a probe on a tiny input decides);
- otherwise gpt-fast's `F.linear(x, q.to(x.dtype)) * scales`, which torch.compile fuses into one
  kernel and eager mode runs as a dequantize-then-matmul (correct, not faster).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragspeed.engine.native.compute.quant.per_channel import Int8Weight


def _int8pack_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        x = torch.ones(1, 32, device=device, dtype=dtype)
        q = torch.ones(8, 32, device=device, dtype=torch.int8)
        scales = torch.ones(8, device=device, dtype=dtype)
        out = torch._weight_int8pack_mm(x, q, scales)
        return bool(torch.all(out == 32).item())
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


class WeightOnlyInt8Kernel:
    device_type = "cuda"
    name = "weight-only int8"

    @staticmethod
    def available() -> bool:
        return torch.cuda.is_available()

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype):
        device = weight.qweight.device
        self.qweight = weight.qweight  # int8 [out_features, in_features]
        self.scales = weight.scales.to(dtype)  # [out_features], in the activation dtype
        self.bias = None if bias is None else bias.to(dtype)
        self.use_int8pack_mm = _int8pack_mm_works(device, dtype)
        self.num_weight_bytes = (
            self.qweight.numel()
            + self.scales.numel() * self.scales.element_size()
            + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())
        )
        self.num_resident_bytes = self.num_weight_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features], in x's dtype."""
        if self.use_int8pack_mm:
            out = torch._weight_int8pack_mm(x, self.qweight, self.scales)
        else:
            out = F.linear(x, self.qweight.to(x.dtype)) * self.scales
        return out if self.bias is None else out + self.bias
