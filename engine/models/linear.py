"""The one place where the engine builds linear layers.

Every projection of the model (fused QKV, output, fused gate-up, down, LM head) is built by
`build_linear`, so a quantized kind (int8, engine.quant) only has to register one class
here.

A linear kind is built empty from primitives and then given its float weights once by `load`,
which is where it packs them (oneDNN's layout for the dense kind on CPU, int8 for the
quantized one) and records the thread count its products run on (engine.threads).

On CPU both kinds also keep the weight in the column blocks of ragspeed's own kernels
(engine.cpu_kernels) for products of a few rows, the decode steps: bandwidth-bound, they read
the blocks at close to the machine's read bandwidth, about 1.5x faster than the packed kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ragspeed.engine.cpu_kernels import BlockedWeight, blocked_kernels_available, takes_blocked
from ragspeed.engine.linear_kind import LinearKind
from ragspeed.engine.quant import QUANT_KINDS
from ragspeed.engine.threads import linear_threads


def onednn_available(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


class DenseLinear(LinearKind):
    """`y = x @ W.T + b` with the weight kept in the compute dtype.

    On CPU the weight is prepacked once, at load, into oneDNN's blocked layout
    (`torch.ops.mkldnn._reorder_linear_weight`, the same ops torch.compile's CPU backend
    emits) and multiplied by `torch.ops.mkldnn._linear_pointwise`. MKL's `mm` repacks the
    weight on every call when a product has a few rows, which makes decode batches and
    speculative verification (1 + k rows) cost several times a one-row product; the packed
    weight does not. Measured on the 2-core development CPU over bench-135m's 121 matrices
    (fp32, 538 MB, two threads), per product of all of them: 1 row 31.4 -> 22.5 ms, 5 rows
    78.4 -> 18.6 ms, 16 rows 97.5 -> 31.2 ms, 256 rows 391 -> 275 ms. The packing's batch-size
    hint (256) fits all of these; the one-row product also reads with both cores, which MKL's
    does not.

    Products of up to `MAX_BLOCKED_ROWS` rows, and every product of a decode-type step
    (engine.cpu_kernels.decode_step), use the column-blocked copy of the weight instead: 1 row 11-18 ms vs 21-27 ms over the same matrices, 8 rows
    even. That copy doubles the resident fp32 weights; decoding reads only it.

    Elsewhere (GPUs, builds without oneDNN) `W.T` is kept contiguous (`[in, out]`) for `mm`.
    """

    PACKING_BATCH_HINT = 256
    MAX_BLOCKED_ROWS = 8

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias)
        self.packed: torch.Tensor | None = None  # oneDNN layout of W [out, in], CPU
        self.weight_t: torch.Tensor | None = None  # [in_features, out_features], elsewhere
        self.blocked: BlockedWeight | None = None  # fp32 CPU weights, ragspeed's kernels
        self.bias: torch.Tensor | None = None  # [out_features]
        self.element_size = 0

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.check_weights(weight, bias)
        self.element_size = weight.element_size()
        self.bias = None if bias is None else bias.contiguous()
        if onednn_available(weight.device):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                weight.contiguous(), self.PACKING_BATCH_HINT
            )
        else:
            self.weight_t = weight.t().contiguous()
        if weight.dtype == torch.float32 and blocked_kernels_available(weight.device):
            self.blocked = BlockedWeight(weight, self.bias)

    def blocked_weight(self) -> BlockedWeight | None:
        return self.blocked

    @property
    def num_weight_bytes(self) -> int:
        """Bytes read per forward: what a token costs in memory bandwidth."""
        return self.num_params * self.element_size

    @property
    def num_resident_bytes(self) -> int:
        """Bytes held: the weight once per layout kept."""
        copies = 1 + (self.blocked is not None)
        return self.num_params * self.element_size * copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features]."""
        if self.blocked is not None and takes_blocked(x.shape[0], self.MAX_BLOCKED_ROWS):
            return self.blocked.forward(x, self.num_threads)
        if self.packed is not None:
            return linear_threads(
                self.num_threads,
                torch.ops.mkldnn._linear_pointwise,
                x.contiguous(),
                self.packed,
                self.bias,
                "none",
                [],
                "",
            )
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
