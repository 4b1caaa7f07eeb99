"""fbgemm's dynamic int8 linear for x86 CPUs with VNNI: the `fbgemm-u8` prefill path.

`torch.ops.quantized.linear_dynamic` quantizes its input to uint8 on the fly (one scale and zero
point per call, from the min/max of the whole `[num_tokens, in_features]` input), multiplies it
by the prepacked per-channel int8 weight with int32 accumulation, and rescales to fp32 with the
weight's row scales. `reduce_range=False`: the full 8-bit range.

Invariants and why:
- Only CPUs with VNNI run it (engine.native.compute.quant.prefill): VNNI's `vpdpbusd` sums u8 x s8 products
  in int32. fbgemm's AVX2 kernel sums pairs of them in 16 bits first (`vpmaddubsw`), and
  full-range activations times int8 weights exceed 32,767 and saturate.
- A product of several rows first divides each row by its largest magnitude and multiplies each
  output row back. With one activation scale per call, a token with large activations would
  otherwise coarsen the rounding of every other token of the chunk; divided, each row spans the
  range. This is exact in real arithmetic (the product is linear; the bias is added after). A
  token's result still depends slightly on the other rows (they share the zero point): outputs
  are deterministic for a given schedule, not bitwise batch-invariant.
- The activations are rounded to 8 bits, which some models do not survive: a model loads on
  exact activations and moves to this path only once the quality gate passes it on that model
  (engine.native.core.quality_gate).
"""

from __future__ import annotations

import warnings

import torch

from ragspeed.engine.native.compute.quant.per_channel import Int8Weight

# Quantized CPU engines whose linear_prepack / linear_dynamic run fbgemm kernels.
FBGEMM_ENGINES = ("x86", "fbgemm")


def fbgemm_available() -> bool:
    return any(e in torch.backends.quantized.supported_engines for e in FBGEMM_ENGINES)


class FbgemmInt8Kernel:
    """Packs one int8 weight (and its fp32 bias) for `linear_dynamic`; runs it."""

    device_type = "cpu"
    name = "fbgemm dynamic int8"

    @staticmethod
    def available() -> bool:
        return fbgemm_available()

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None):
        out_features = weight.qweight.shape[0]
        if torch.backends.quantized.engine not in FBGEMM_ENGINES:
            # The process-wide quantized engine picks the packing; keep it, choose ours.
            torch.backends.quantized.engine = next(
                e for e in FBGEMM_ENGINES if e in torch.backends.quantized.supported_engines
            )
        with warnings.catch_warnings():
            # torch >= 2.10 flags quantized tensor creation as deprecated; the ops still run.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(
                weight.qweight.cpu(),
                weight.scales.cpu().double(),
                torch.zeros(out_features, dtype=torch.long),
                0,
            )
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = None if bias is None else bias.float().cpu().contiguous()
        self.num_weight_bytes = weight.num_bytes + (0 if bias is None else bias.numel() * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x fp32 [num_tokens, in_features] -> fp32 [num_tokens, out_features]."""
        if x.shape[0] == 1:
            y = torch.ops.quantized.linear_dynamic(x, self.packed, False)
        else:  # rows normalised to max |x| = 1, then scaled back (see the module docstring)
            row_max = x.abs().amax(dim=1, keepdim=True).clamp_min_(torch.finfo(x.dtype).tiny)
            y = torch.ops.quantized.linear_dynamic(x / row_max, self.packed, False).mul_(row_max)
        return y if self.bias is None else y.add_(self.bias)
