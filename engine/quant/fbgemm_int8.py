"""int8 linear on x86 CPUs: fbgemm's dynamic quantization, weights prepacked once at load.

`torch.ops.quantized.linear_dynamic` quantizes the activations per tensor (min/max of the whole
`[num_tokens, in_features]` input) to uint8 on the fly, multiplies by the prepacked int8 weight
with int32 accumulation, and rescales to fp32 with the per-row weight scales and the bias.
At batch 1 it reads a quarter of fp32's bytes and runs about 9x faster than fp32 on AMD EPYC
Zen 3 (AVX2).

`reduce_range=False`: the full 8-bit activation range. fbgemm's AVX2 kernel may saturate its
16-bit pair sums in rare worst cases; the quality gates (perplexity, top-1 agreement) measure
what that costs, and `reduce_range=True` ran 4x slower here.

Per-tensor activation scales would let one token with large activations coarsen the
quantization of every other token of a prefill chunk or batch (on the demo model, top-1
agreement with fp32 fell to 96.7% over 128-token windows). So a product of several rows first
divides each row by its largest magnitude and multiplies each output row back: exact in real
arithmetic (the product is linear; the bias is added after), and every row then spans the
quantization range (agreement 97.6-98.3%, perplexity within 0.05%). A token's result still
depends slightly on the other rows: greedy outputs are deterministic for a given schedule, not
bitwise batch-invariant.

Some models lose more. A copy-trained demo model keeps 93.8% top-1 agreement here (logit RMS
error 0.10, the bundled model's 0.034), 97.8% with activations to ~16 bits. Its rows are only
somewhat spikier (median max |x| / RMS per product 4-22, the bundled model's 3-12): it is the
model that amplifies the rounding. Tried on it (the gate's WikiText windows; a 512-token window
scored at every position on the development CPU: fp32 58 ms, this path 40 ms): SmoothQuant
scales (alpha 0.5-0.8, calibrated on other text) 95.8-95.9%; the columns where some |x| exceeds
6x its row's RMS multiplied in fp32 (LLM.int8-style, ~40 columns a product) 97.1%; bf16
activations through oneDNN (int8 values are exact in bf16) 97.3%, 44 ms; a second pass over each
row's rounding residual (~16-bit activations) 97.8%, but 68 ms, and 2.9 s against fp32's 2.7 s
on bench-0.5b; that pass only for the rows whose max |x| / RMS exceeds 8-12, 96.7-95.1%. None is
both as precise as unquantized activations and faster than fp32, so this path stays as it is.
"""

from __future__ import annotations

import warnings

import torch

from ragspeed.engine.quant.per_channel import Int8Weight

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
