"""int8 linear on CPUs: fbgemm for prefill-sized products, ragspeed's kernel for a few rows.

fbgemm's dynamic quantization (engine.quant.fbgemm_int8) multiplies int8 by int8 with VNNI
instructions: the fastest for many rows. A decode step's product of one or two rows is bound
by reading the weights, and kernels.c's weight-only kernel (int8 weights widened to fp32, fp32
activations) reads them faster: over bench-135m's 121 matrices on the development CPU, 1 row
4.6 vs 6.5-7.2 ms, 2 rows 5.2 vs 7.4, 4 rows even (it widens each weight once per pass of up to six
rows). So products of up to `MAX_BLOCKED_ROWS` rows take the blocked copy, which holds the
same int8 values and scales, and so does every product of a decode-type step
(engine.cpu_kernels.decode_step: speculation stays lossless). A batch of 16 decodes costs
about twice fbgemm's time in its products that way. Both layouts stay resident.
"""

from __future__ import annotations

import torch

from ragspeed.engine.cpu_kernels import BlockedWeight, blocked_kernels_available, takes_blocked
from ragspeed.engine.quant.fbgemm_int8 import FbgemmInt8Kernel, fbgemm_available
from ragspeed.engine.quant.per_channel import Int8Weight


class CpuInt8Kernel:
    """One int8 weight for both CPU kernels; a product takes the one its row count favours."""

    device_type = "cpu"
    MAX_BLOCKED_ROWS = 3

    @staticmethod
    def available() -> bool:
        return fbgemm_available()

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None, num_threads: int):
        self.fbgemm = FbgemmInt8Kernel(weight, bias)
        self.blocked = None
        if blocked_kernels_available(weight.qweight.device):
            self.blocked = BlockedWeight(weight.qweight, bias, weight.scales)
        self.num_threads = num_threads
        self.name = self.fbgemm.name
        self.num_weight_bytes = self.num_resident_bytes = self.fbgemm.num_weight_bytes
        if self.blocked is not None:  # decoding reads the blocked copy
            self.name += " + blocked int8 for decode"
            self.num_weight_bytes = self.blocked.num_bytes
            self.num_resident_bytes += self.blocked.num_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [num_tokens, in_features] -> fp32 [num_tokens, out_features]."""
        if self.blocked is not None and takes_blocked(x.shape[0], self.MAX_BLOCKED_ROWS):
            return self.blocked.forward(x, self.num_threads)
        return self.fbgemm.forward(x)
