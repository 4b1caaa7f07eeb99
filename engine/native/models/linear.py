"""The one place where the engine builds linear layers.

Every projection of the model (fused QKV, output, fused gate-up, down, LM head) is built by
`build_linear`, so a quantized kind (int8, engine.native.compute.quant) only has to register one class
here.

A linear kind is built empty from primitives and then given its float weights once by `load`,
which is where it packs them (oneDNN's layout for the dense kind on CPU, int8 for the
quantized one) and records the thread count its products run on (engine.native.compute.threads).

On CPU both kinds also keep the weight in the column blocks of ragspeed's own kernels
(engine.native.compute.cpu_kernels) for products of a few rows, the decode steps: bandwidth-bound, they read
the blocks at close to the machine's read bandwidth, about 1.5x faster than the packed kernels.

The packed copy that serves prefill products is one of `DENSE_PREFILL_PATHS` (fp32, or bf16 on
a CPU with AMX-BF16 or AVX512-BF16: engine.native.compute.packed); a model loads on fp32 and
engine.native.core.precision moves it (`use_prefill`) once the quality gate passes a faster path. A GGUF
model's 4-bit weights have one more, `INT8_BLOCKS` (`GGUF_PREFILL_PATHS`): the file's values
times int8 activations, no dense copy (engine.native.compute.cpu_kernels.int8_prefill).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ragspeed.engine.native.compute.cpu_features import CpuFeatures
from ragspeed.engine.native.compute.cpu_kernels import (
    BlockedWeight,
    blocked_kernels_available,
    load_library,
    takes_blocked,
)
from ragspeed.engine.native.compute.cpu_kernels.int8_prefill import Int8BlocksGemm, quantize_q4_1
from ragspeed.engine.native.compute.linear_kind import LinearKind
from ragspeed.engine.native.compute.packed import PackedLinear, bf16_missing
from ragspeed.engine.native.compute.quant import QUANT_KINDS
from ragspeed.engine.native.compute.quant.gguf_blocks import GgufBlocks, MixedBlocks, dense, kernel_dequantize
from ragspeed.engine.native.compute.quant.prefill_path import PrefillPath, runs_anywhere
from ragspeed.engine.native.compute.threads import linear_threads


def onednn_available(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


def _packed(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor | None], PackedLinear]:
    return lambda weight, bias: PackedLinear(weight, bias, dtype)


# The dense kind's prefill paths (engine.native.compute.quant.prefill.PrefillPath); the last runs everywhere.
DENSE_PREFILL_PATHS: tuple[PrefillPath, ...] = (
    PrefillPath("bf16", "bf16", "rounded to bf16", bf16_missing, _packed(torch.bfloat16)),
    PrefillPath("fp32", "fp32", "kept in fp32", runs_anywhere, _packed(torch.float32)),
)


def _int8_blocks_missing(features: CpuFeatures) -> str | None:
    return None if load_library() is not None else "ragspeed's CPU kernels could not be built"


# The blocks' types the integer prefill products take; a layer of another type (Q8_0, the
# K-quants, mixed rows) keeps the fp32 copy under INT8_BLOCKS and INT16_BLOCKS.
INT8_BLOCK_TYPES = ("Q4_0", "Q4_1")

# A GGUF model's prefill on its 4-bit blocks (engine.native.compute.cpu_kernels.int8_prefill): integer
# multiply-adds (AVX-512 VNNI, AVX2, plain C) of the file's values, no dense copy. `build` takes
# (values, steps and offsets), as GgufBlocks.kernel_weight() gives them; the probe's weight is
# rounded to Q4_1 first. Activations rounded to int8 per block of 32 (llama.cpp's Q8_1: the
# integer units' full rate, 2x-4x fp32's), or to int16 as the decode kernels round them (half
# that rate, a rounding 256x finer). Both are "int8" precision paths for `--dtype`.
INT8_BLOCKS = PrefillPath(
    "int8-blocks",
    "int8",
    "rounded to int8 per block of 32",
    _int8_blocks_missing,
    lambda weight, bias: Int8BlocksGemm(weight[0], weight[1], bias),
    quantize_q4_1,
)
INT16_BLOCKS = PrefillPath(
    "int16-blocks",
    "int8",
    "rounded to int16 per block of 32",
    _int8_blocks_missing,
    lambda weight, bias: Int8BlocksGemm(weight[0], weight[1], bias, activation_bits=16),
    quantize_q4_1,
)
BLOCKS_PATHS = (INT8_BLOCKS, INT16_BLOCKS)
GGUF_PREFILL_PATHS: tuple[PrefillPath, ...] = (*BLOCKS_PATHS, *DENSE_PREFILL_PATHS)


class DenseLinear(LinearKind):
    """`y = x @ W.T + b` with the weight kept in the compute dtype.

    On CPU the weight is prepacked once, at load, into oneDNN's blocked layout
    (`torch.ops.mkldnn._reorder_linear_weight`, the same ops torch.compile's CPU backend
    emits) and multiplied by `torch.ops.mkldnn._linear_pointwise`. MKL's `mm` repacks the
    weight on every call when a product has a few rows, which makes decode batches and
    speculative verification (1 + k rows) cost several times a one-row product; the packed
    weight does not, from 1 row to 256 (the packing's batch-size hint), and its one-row product
    reads with every thread, which MKL's does not.

    Products of up to `MAX_BLOCKED_ROWS` rows, and every product of a decode-type step
    (engine.native.compute.cpu_kernels.decode_step), use the column-blocked copy of the weight instead: 1 row 11-18 ms vs 21-27 ms over the same matrices, 8 rows
    even. That copy doubles the resident fp32 weights; decoding reads only it. The packed copy
    is the prefill path's (`use_prefill`): fp32, or bf16 where engine.native.core.precision chose it.
    Without a blocked copy the packed one serves every product, and W is kept to rebuild it.

    Elsewhere (GPUs, builds without oneDNN) `W.T` is kept contiguous (`[in, out]`) for `mm`.
    """

    MAX_BLOCKED_ROWS = 8

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias)
        # oneDNN layout of W, CPU (engine.native.compute.packed); a GGUF layer's INT8_BLOCKS product
        self.prefill: PackedLinear | Int8BlocksGemm | None = None
        self.path: PrefillPath | None = None  # the prefill path `prefill` was built for
        self.weight_t: torch.Tensor | None = None  # [in_features, out_features], elsewhere
        self.blocked: BlockedWeight | None = None  # fp32 CPU weights, ragspeed's kernels
        self.source: torch.Tensor | None = None  # W, kept where no blocked copy rebuilds it
        self.bias: torch.Tensor | None = None  # [out_features]
        self.element_size = 0

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.check_weights(weight, bias)
        self.element_size = weight.element_size()
        self.bias = None if bias is None else bias.contiguous()
        if weight.dtype == torch.float32 and blocked_kernels_available(weight.device):
            self.blocked = BlockedWeight(weight, self.bias)
        if onednn_available(weight.device):
            self.source = None if self.blocked is not None else weight
            self.use_prefill(
                DENSE_PREFILL_PATHS[-1] if weight.dtype == torch.float32 else _same_dtype(weight)
            )
        else:
            self.weight_t = weight.t().contiguous()

    def use_prefill(self, path: PrefillPath) -> None:
        """Rebuild the packed copy that prefill products read for `path` (CPU)."""
        weight = self.source if self.blocked is None else self.blocked.unblocked()[0]
        assert weight is not None, "load() on CPU first"
        self.path = path
        self.prefill = _packed_by(path, weight, self.bias)

    def blocked_weight(self) -> BlockedWeight | None:
        return self.blocked

    @property
    def num_weight_bytes(self) -> int:
        """Bytes read per forward of a few rows: what a token costs in memory bandwidth."""
        if self.blocked is None and self.prefill is not None:
            return self.num_params * self.prefill.element_size
        return self.num_params * self.element_size

    @property
    def num_resident_bytes(self) -> int:
        """Bytes held: the weight once per layout kept."""
        held = [self.blocked is not None, self.source is not None, self.weight_t is not None]
        total = self.num_params * self.element_size * sum(held)
        return total + (0 if self.prefill is None else self.num_params * self.prefill.element_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, in_features] -> [num_tokens, out_features]."""
        if self.blocked is not None and takes_blocked(x.shape[0], self.MAX_BLOCKED_ROWS):
            return self.blocked.forward(x, self.num_threads)
        if self.prefill is not None:
            return linear_threads(self.num_threads, self.prefill.forward, x)
        assert self.weight_t is not None, "load() first"
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


def _packed_by(path: PrefillPath, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
    """The packed copy a dense path builds (every dense path packs for oneDNN)."""
    packed = path.build(weight, bias)
    assert isinstance(packed, PackedLinear), f"{path.name} is no dense prefill path"
    return packed


def _same_dtype(weight: torch.Tensor) -> PrefillPath:
    """A CPU weight loaded in a dtype other than fp32 (not through the loader, which computes
    in fp32 on CPU): packed as it is."""
    name = str(weight.dtype).removeprefix("torch.")
    return PrefillPath(name, name, f"in {name}", runs_anywhere, _packed(weight.dtype))


class GgufLinear(DenseLinear):
    """A GGUF weight decoded on the file's own blocks (engine.native.compute.quant.gguf_blocks): a few rows
    read the Q4_0 / Q4_1 / Q8_0 blocks through ragspeed's kernels, 0.56 to 1.06 bytes a
    weight, and the Q4_K / Q6_K blocks unpacked to the K-quant kernels' integers and fp32
    steps, 0.75 and 1.25; a fused projection of rows of several of these types reads them
    converted to the mixed kernel's int8 values with fp32 steps and offsets, 1.375. Prefill
    products read the dense copy of their path, built from the blocks' exact dequantization. A
    weight of any other type arrives dense and is a `DenseLinear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias)
        # the file's block type ("Q4_K+Q6_K" for mixed rows), when it decodes on its blocks
        self.qtype: str | None = None

    def load(self, weight: torch.Tensor | GgufBlocks | MixedBlocks, bias: torch.Tensor | None = None) -> None:
        if isinstance(weight, torch.Tensor) or not blocked_kernels_available(torch.device("cpu")):
            super().load(dense(weight), bias)
            return
        self.check_weights(weight, bias)
        self.qtype = weight.qtype
        self.element_size = 4
        self.bias = None if bias is None else bias.contiguous()
        values, scales = weight.kernel_weight()
        self.blocked = BlockedWeight(values, self.bias, scales)
        self.use_prefill(DENSE_PREFILL_PATHS[-1])

    def use_prefill(self, path: PrefillPath) -> None:
        if self.qtype is None:
            super().use_prefill(path if path not in BLOCKS_PATHS else DENSE_PREFILL_PATHS[-1])
            self.path = path
            return
        self.path = path
        values, scales = self.blocks.unblocked()
        assert scales is not None, "blocks carry their steps"
        if path in BLOCKS_PATHS and self.qtype in INT8_BLOCK_TYPES:
            product = path.build((values, scales), self.bias)
            assert isinstance(product, Int8BlocksGemm)
            self.prefill = product
            return
        dense_path = DENSE_PREFILL_PATHS[-1] if path in BLOCKS_PATHS else path
        self.prefill = _packed_by(dense_path, kernel_dequantize(values, scales), self.bias)

    @property
    def blocks(self) -> BlockedWeight:
        """The file's blocks, as the kernels read them (a weight that decodes on its blocks)."""
        assert self.qtype is not None and self.blocked is not None, "no blocks loaded"
        return self.blocked

    @property
    def num_weight_bytes(self) -> int:
        return super().num_weight_bytes if self.qtype is None else self.blocks.num_bytes

    @property
    def num_resident_bytes(self) -> int:
        if self.qtype is None:
            return super().num_resident_bytes
        if isinstance(self.prefill, Int8BlocksGemm):
            return self.blocks.num_bytes + self.prefill.num_bytes
        prefill = 0 if self.prefill is None else self.num_params * self.prefill.element_size
        return self.blocks.num_bytes + prefill


class GgufHead(GgufLinear):
    """A GGUF LM head: its products are the sampled rows, a few a sequence, so the blocks
    serve them all and no dense copy is built."""

    def use_prefill(self, path: PrefillPath) -> None:
        if self.qtype is None:
            super().use_prefill(path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qtype is None:
            return super().forward(x)
        return self.blocks.forward(x, self.num_threads)


def decode_weights(model: nn.Module) -> str:
    """What a decode step's products read, by count: e.g. "Q4_1 blocks x210, Q8_0 blocks x1"."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if not isinstance(module, LinearKind):
            continue
        qtype = getattr(module, "qtype", None)
        blocked = module.blocked_weight()
        if qtype is not None:
            name = f"{qtype} blocks"
        elif blocked is not None:
            name = f"blocked {blocked.kind}"
        else:
            name = "packed"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} x{count}" for name, count in sorted(counts.items(), key=lambda c: -c[1]))


# quantization name (EngineConfig.quantization) -> linear kind.
LINEAR_KINDS: dict[str | None, Callable[[int, int, bool], LinearKind]] = {
    None: DenseLinear,
    "gguf": GgufLinear,
    **QUANT_KINDS,  # 'int8' (engine.native.compute.quant)
}


# The LM head's kinds where they differ (it multiplies only the sampled rows).
HEAD_KINDS = {**LINEAR_KINDS, "gguf": GgufHead}


def build_linear(
    in_features: int,
    out_features: int,
    *,
    bias: bool = False,
    quantization: str | None = None,
    head: bool = False,
) -> LinearKind:
    kind = (HEAD_KINDS if head else LINEAR_KINDS).get(quantization)
    if kind is None:
        known = ", ".join(repr(k) for k in LINEAR_KINDS)
        raise ValueError(f"unknown quantization {quantization!r}; known: {known}")
    return kind(in_features, out_features, bias)
