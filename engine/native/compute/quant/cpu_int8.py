"""int8 linear on CPUs: ragspeed's blocked kernel for a few rows, a prefill path for many.

The weight is quantized group-wise (engine.native.compute.quant.groupwise) once, at load. A product of up to
`MAX_BLOCKED_ROWS` rows, and every product of a decode-type step (engine.native.compute.cpu_kernels.
decode_step: speculation stays lossless), goes to the blocked copy: bound by reading the weight,
it reads 1.0625 bytes a weight (fp16 group scales) where fp32 reads 4, and multiplies them by
the activations rounded to int16 per group (engine.native.compute.cpu_kernels.blocked; `bench quant` reports
that path's quality as the decode kernels'). Longer products go to the prefill path chosen
for this CPU and model (engine.native.compute.quant.prefill); both layouts stay resident. Where the blocked
kernels are not built, the prefill path serves every product.

`use_prefill(path)` rebuilds the prefill layout from the blocked copy (or the kept int8 weight
where there is no blocked copy): how the quality gate moves a model (engine.native.core.quality_gate).
"""

from __future__ import annotations

import torch

from ragspeed.engine.native.compute.cpu_kernels import BlockedWeight, blocked_kernels_available, takes_blocked
from ragspeed.engine.native.compute.cpu_kernels.blocked import INT8_GROUP
from ragspeed.engine.native.compute.quant.groupwise import GroupInt8Weight
from ragspeed.engine.native.compute.quant.prefill_path import PrefillPath


class CpuInt8Kernel:
    """One int8 weight for both CPU layouts; a product takes the one its row count favours."""

    device_type = "cpu"
    MAX_BLOCKED_ROWS = 3

    @staticmethod
    def available() -> bool:
        return True  # the fp32-dequantized prefill path needs nothing from the CPU or the build

    def __init__(
        self,
        weight: GroupInt8Weight,
        bias: torch.Tensor | None,
        num_threads: int,
        path: PrefillPath,
    ):
        self.bias = bias
        self.num_threads = num_threads
        self.blocked = None
        self.weight: GroupInt8Weight | None = weight  # kept only without a blocked copy
        if blocked_kernels_available(weight.qweight.device):
            self.blocked = BlockedWeight(weight.qweight, bias, weight.scales)
            self.weight = None
        self.use_prefill(path)

    def use_prefill(self, path: PrefillPath) -> None:
        weight = self.weight
        if weight is None:
            assert self.blocked is not None  # the weight is dropped only for a blocked copy
            qweight, scales = self.blocked.unblocked()
            assert scales is not None  # an int8 blocked copy has its group scales
            weight = GroupInt8Weight(qweight, scales, INT8_GROUP)
        self.path = path
        self.prefill = path.build(weight, self.bias)
        self.name = f"int8 prefill {path.name}"
        if self.blocked is not None:  # decoding reads the blocked copy
            self.name += " + blocked int8 for decode"
            self.num_weight_bytes = self.blocked.num_bytes
            self.num_resident_bytes = self.prefill.num_bytes + self.blocked.num_bytes
        else:
            self.num_weight_bytes = self.prefill.num_bytes
            self.num_resident_bytes = self.prefill.num_bytes + weight.num_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [num_tokens, in_features] -> fp32 [num_tokens, out_features]."""
        if self.blocked is not None and takes_blocked(x.shape[0], self.MAX_BLOCKED_ROWS):
            return self.blocked.forward(x, self.num_threads)
        return self.prefill.forward(x)
