"""A weight packed once for oneDNN's prefill products, in fp32 or bf16, and what bf16 needs.

Prefill products (many rows) are bound by arithmetic. oneDNN multiplies bf16 on AMX-BF16 tiles
or AVX512-BF16 dot products at several times fp32's rate; on other CPUs bf16 is emulated and
about 30x slower than fp32 (engine.native.compute.cpu_features). `PackedLinear` keeps the weight in its
`compute_dtype`, packed in oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
as torch.compile's CPU backend emits); a product casts the activations to that dtype on the way
in and the result back on the way out, and adds the bias in the activations' dtype: with bf16
weights the residual stream, norms, KV cache and logits stay fp32, only the GEMM rounds.

oneDNN refuses to pack bf16 on CPUs without AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; there the
weight stays unpacked and `F.linear` multiplies it (slowly, but the same rounding), so a branch
chosen by injected CPU features still runs on any machine.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragspeed.engine.native.compute.cpu_features import CpuFeatures


def onednn_packs(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def bf16_missing(features: CpuFeatures) -> str | None:
    """Why this CPU does not multiply bf16 at speed, or None where it does."""
    if features.has_bf16:
        return None
    return "no AMX-BF16 or AVX512-BF16 (amx_bf16 / avx512_bf16): bf16 products run ~30x slower than fp32"


class PackedLinear:
    """W [out_features, in_features] (any float dtype) kept in `compute_dtype`; `forward(x)` is
    `x @ W.T + b` in x's dtype, the product itself in `compute_dtype`."""

    PACKING_BATCH_HINT = 256

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype):
        self.compute_dtype = compute_dtype
        w = weight.to(compute_dtype).contiguous()
        self.bias = None if bias is None else bias.contiguous()  # the activations' dtype
        self.packed = self.weight = None
        if onednn_packs(compute_dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, self.PACKING_BATCH_HINT)
        else:
            self.weight = w
        self.element_size = w.element_size()
        self.num_bytes = w.numel() * w.element_size() + (
            0 if bias is None else bias.numel() * bias.element_size()
        )

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")
        assert self.weight is not None  # kept where not packed
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features], in x's dtype."""
        if x.dtype == self.compute_dtype:
            return self._product(x, self.bias)
        y = self._product(x.to(self.compute_dtype), None).to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)
