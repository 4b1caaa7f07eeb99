"""Group-wise symmetric int8 weights: one fp16 scale per `group_size` consecutive inputs of each
output row, zero point 0.

`W[o, i] ~= q[o, i] * scale[o, i // group_size]`, `q` in [-127, 127], `scale[o, g] = max |W[o,
g-th group]| / 127`. One scale per row (engine.native.compute.quant.per_channel) lets the row's largest
weights set the step of all its others; checkpoints that were themselves quantized in blocks
(GGUF's Q8_0, Q4_0, Q4_1: 32 weights a block, each with its own scale) have rows whose blocks
differ in range, and a row scale rounds their small blocks coarsely. A group of 32 matches those
blocks: Q8_0 blocks (fp16 scales too) are reproduced exactly, Q4_x blocks to within a 254th of
their range. The scales cost 2 bytes per 32 weights (1.0625 bytes a weight in all): a decode step
reads 6% fewer bytes than with fp32 scales. A scale is rounded up to the next fp16 value and the
weights are rounded against it, so `q * scale` is exactly what the int8 weight stands for and no
group's largest weight is clipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragspeed.engine.native.compute.cpu_kernels.blocked import INT8_GROUP
from ragspeed.engine.native.compute.quant.per_channel import INT8_MAX


@dataclass(frozen=True)
class GroupInt8Weight:
    qweight: torch.Tensor  # int8 [out_features, in_features]
    scales: torch.Tensor  # fp16 [out_features, ceil(in_features / group_size)]
    group_size: int

    @property
    def num_bytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def dequantize(self) -> torch.Tensor:
        """fp32 [out_features, in_features]: what the int8 weight stands for."""
        in_features = self.qweight.shape[1]
        scales = self.scales.repeat_interleave(self.group_size, dim=1)[:, :in_features]
        return self.qweight.float() * scales.float()


def quantize_groupwise(weight: torch.Tensor, group_size: int = INT8_GROUP) -> GroupInt8Weight:
    """weight [out_features, in_features], any float dtype -> int8 and its group scales (the last
    group of a row may be shorter)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor, got {weight.dim()}-D {weight.dtype}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    out_features, in_features = weight.shape
    num_groups = -(-in_features // group_size)
    w = torch.zeros(out_features, num_groups * group_size, dtype=torch.float32)
    w[:, :in_features] = weight.float().cpu()
    groups = w.view(out_features, num_groups, group_size)
    wanted = groups.abs().amax(dim=2) / INT8_MAX
    scales = wanted.to(torch.float16)
    low = scales.float() < wanted
    scales[low] = torch.nextafter(scales[low], torch.tensor(torch.inf, dtype=torch.float16))
    # An all-zero group would give scale 0 (and 0/0 below): any positive scale represents it.
    scales = scales.clamp_min(torch.finfo(torch.float16).smallest_normal)
    q = torch.round(groups / scales.float()[:, :, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    qweight = q.view(out_features, -1)[:, :in_features].contiguous()
    return GroupInt8Weight(qweight.to(weight.device), scales.to(weight.device), group_size)
