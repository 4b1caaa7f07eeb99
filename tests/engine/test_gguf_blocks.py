"""A GGUF file's own blocks (engine.native.compute.quant.gguf_blocks): decoded by the kernels as stored, equal to
the fp32 product of `gguf.quants.dequantize` (but for the activations' int16 rounding), for random
blocks of each type and for the default model's own tensors; and an engine that serves them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from ragspeed.engine.native.compute.cpu_kernels import BlockedWeight, load_library
from ragspeed.engine.native.compute.cpu_kernels.decoder import FusedDecoder
from ragspeed.engine.native.compute.quant import QuantizationUnavailableError
from ragspeed.engine.native.compute.quant.gguf_blocks import (
    KERNEL_TYPES,
    GgufBlocks,
    MixedBlocks,
    cat_rows,
    kernel_dequantize,
    map_rows,
)
from ragspeed.engine.native.core.sampling import SamplingParams
from ragspeed.engine.native.core.window_logits import decode_window_logits, window_logits
from ragspeed.engine.native.loading.gguf import converted_copy, source_of
from ragspeed.engine.native.loading.loader import load_model
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME, ZOO
from ragspeed.engine.native.models.linear import DenseLinear, GgufLinear
from ragspeed.engine.native.models.memory import resident_weight_bytes
from ragspeed.engine.protocol import GenerationRequest
from tests.engine.conftest import int16_rows, make_engine
from tests.engine.tiny_gguf import random_k_quant_bytes, write_tiny_gguf
from tests.engine.tiny_models import build_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    load_library() is None, reason="ragspeed's CPU kernels could not be built here"
)

QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # what gguf.quants.quantize writes
K_QUANTS = ("Q4_K", "Q6_K")  # random valid blocks: gguf cannot write them
# fp16 scale fields that give weights of about 0.1, as a trained model's
K_QUANT_SCALES = {"Q4_K": (1e-4, 5e-4), "Q6_K": (2e-5, 1e-4)}
assert set(KERNEL_TYPES) == {*QUANTIZED_TYPES, *K_QUANTS}


def _blocks(qtype: str, rows: int, cols: int, seed: int) -> GgufBlocks:
    weights = np.random.default_rng(seed).normal(0.0, 0.1, size=(rows, cols)).astype(np.float32)
    data = quantize(weights, GGMLQuantizationType[qtype])
    return GgufBlocks(qtype, torch.from_numpy(data))


def _assert_product_of_dequantized(blocks: GgufBlocks, gen: torch.Generator) -> None:
    reference = torch.from_numpy(dequantize(blocks.data.numpy(), GGMLQuantizationType[blocks.qtype]))
    assert torch.equal(blocks.dequantize(), reference)
    values, scales = blocks.kernel_weight()
    blocked = BlockedWeight(values, None, scales)
    # What the prefill copy and the embedding lookup are built from: the same floats.
    assert torch.equal(kernel_dequantize(*blocked.unblocked()), reference)
    rows = torch.tensor([blocks.shape[0] - 1, 0, blocks.shape[0] // 2, 0])
    assert torch.equal(blocks.lookup(rows), reference[rows])
    for num_rows in (1, 5):
        x = torch.randn(num_rows, blocks.shape[1], generator=gen)
        expected = (int16_rows(x).double() @ reference.double().T).float()
        torch.testing.assert_close(blocked.forward(x, 2), expected, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(blocked.forward(x, 2), x @ reference.T, rtol=0, atol=2e-3)


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
@pytest.mark.parametrize("rows, cols", [(16, 32), (37, 96), (100, 576)])
def test_random_blocks_multiply_as_their_dequantization(qtype, rows, cols):
    blocks = _blocks(qtype, rows, cols, seed=rows + cols)
    assert blocks.shape == (rows, cols)
    _assert_product_of_dequantized(blocks, torch.Generator().manual_seed(rows))


@pytest.mark.parametrize("qtype", K_QUANTS)
@pytest.mark.parametrize("rows, cols", [(16, 256), (37, 512), (100, 1536)])
def test_k_quant_blocks_multiply_as_their_dequantization(qtype, rows, cols):
    data = random_k_quant_bytes(qtype, rows, cols, rows + cols, K_QUANT_SCALES[qtype])
    blocks = GgufBlocks(qtype, torch.from_numpy(data))
    assert blocks.shape == (rows, cols)
    _assert_product_of_dequantized(blocks, torch.Generator().manual_seed(rows))


def test_the_default_models_own_tensors(default_gguf):
    """SmolLM2's Q4_1 projections and its Q8_0 embedding (the tied LM head), 256 rows each."""
    reader = GGUFReader(str(default_gguf))
    wanted = {"blk.0.attn_q.weight", "blk.3.ffn_down.weight", "blk.29.ffn_up.weight", "token_embd.weight"}
    seen = set()
    for tensor in reader.tensors:
        if tensor.name in wanted:
            rows = torch.from_numpy(np.array(tensor.data[:256], dtype=np.uint8))
            _assert_product_of_dequantized(
                GgufBlocks(tensor.tensor_type.name, rows), torch.Generator().manual_seed(1)
            )
            seen.add(tensor.tensor_type.name)
    assert seen == {"Q4_1", "Q8_0"}


def test_rows_move_and_join_without_touching_a_block():
    a, b = _blocks("Q4_1", 8, 64, 1), _blocks("Q4_1", 4, 64, 2)
    joined = cat_rows([a, b])
    assert isinstance(joined, GgufBlocks)
    assert torch.equal(joined.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    flipped = map_rows(a, lambda rows: rows.flip(0))
    assert torch.equal(flipped.dequantize(), a.dequantize().flip(0))
    c = _blocks("Q8_0", 4, 64, 3)
    mixed = cat_rows([a, c])  # two types: blocks of both, stacked
    assert isinstance(mixed, MixedBlocks) and mixed.qtype == "Q4_1+Q8_0" and mixed.shape == (12, 64)
    assert mixed.num_bytes == a.num_bytes + c.num_bytes
    assert torch.equal(mixed.dequantize(), torch.cat([a.dequantize(), c.dequantize()]))
    dense_weight = torch.zeros(4, 64)  # a dense part: one dense fp32 weight
    assert torch.equal(cat_rows([a, dense_weight]), torch.cat([a.dequantize(), dense_weight]))


def _k_blocks(qtype: str, rows: int, cols: int, seed: int) -> GgufBlocks:
    return GgufBlocks(
        qtype, torch.from_numpy(random_k_quant_bytes(qtype, rows, cols, seed, K_QUANT_SCALES[qtype]))
    )


def test_k_quant_rows_join_as_blocks_of_their_types():
    """Q4_K rows join as blocks (a fused gate-up). Q4_K beside Q6_K (Q4_K_M's QKV, whose V is
    Q6_K) and Q8_0 load as the mixed kind, whose weight is the parts' exact dequantization and
    whose product is the dense weight's."""
    q, k = _k_blocks("Q4_K", 32, 512, 1), _k_blocks("Q4_K", 16, 512, 2)
    joined = cat_rows([q, k])
    assert isinstance(joined, GgufBlocks) and joined.shape == (48, 512)
    assert torch.equal(joined.dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    for parts, qtype in (
        ([q, k, _k_blocks("Q6_K", 16, 512, 3)], "Q4_K+Q6_K"),
        ([q, _blocks("Q8_0", 5, 512, 4)], "Q4_K+Q8_0"),
    ):
        mixed = cat_rows(parts)
        assert isinstance(mixed, MixedBlocks) and mixed.qtype == qtype
        reference = torch.cat([part.dequantize() for part in parts])
        linear = GgufLinear(512, mixed.shape[0], bias=False)
        linear.load(mixed)
        assert linear.qtype == qtype and linear.blocked.kind == "kmix"
        # int8 values, an fp32 step per 16 and an fp32 offset per 32: 1.375 bytes a weight (of
        # the rows padded to whole blocks of 16)
        assert linear.num_weight_bytes == -(-mixed.shape[0] // 16) * 16 * 512 * 11 // 8
        assert torch.equal(kernel_dequantize(*linear.blocked.unblocked()), reference)
        gen = torch.Generator().manual_seed(len(parts))
        for num_rows in (1, 5):
            x = torch.randn(num_rows, 512, generator=gen)
            expected = (int16_rows(x).double() @ reference.double().T).float()
            torch.testing.assert_close(linear.forward(x), expected, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(linear.forward(x), x @ reference.T, rtol=0, atol=2e-3)


def test_bad_blocks_are_named():
    with pytest.raises(ValueError, match="no kernel for GGUF type Q5_0"):
        GgufBlocks("Q5_0", torch.zeros(2, 22, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole blocks of 20 bytes"):
        GgufBlocks("Q4_1", torch.zeros(2, 30, dtype=torch.uint8))
    with pytest.raises(ValueError, match="whole blocks of 210 bytes"):
        GgufBlocks("Q6_K", torch.zeros(2, 144, dtype=torch.uint8))


@pytest.fixture(scope="module")
def default_gguf():
    try:
        return ZOO[DEFAULT_MODEL_NAME].source_file()
    except Exception as error:  # the wheel is not installed
        pytest.skip(str(error))


def _rms(t: torch.Tensor) -> float:
    return t.double().square().mean().sqrt().item()


def _assert_error_is_the_int16_rounding(blocks_logits, reference, ids, monkeypatch) -> None:
    """The blocks' logits differ from the fp32 model's (`reference`, the file's dequantized
    weights) by the kernels' one rounding, each product's inputs to int16 per group of 32
    (steps of max |x| / 32767): no more than the same rounding applied to the fp32 model's own
    products (`int16_rows`, in torch) gives.

    That rounding is noise, not a bound to write down in advance: on the tiny model its largest
    effect on 24,576 logits is about 9x its RMS, 1.95e-3 on one build and 2.04e-3 on another
    for the same Q4_0 weights. The order of the fp32 sums (AVX-512's 16-lane against AVX2's
    8-lane horizontal sums in attention, 1e-7 apart) decides which rare values cross a rounding
    boundary, and the change cascades through the later roundings: the AVX2 and AVX-512 builds
    draw different samples of one noise (5e-4 apart, their RMS 2.29e-4 and 2.31e-4), as
    does the emulation in torch (whose max was 2.02e-3). So the test compares statistics of
    the noise: its RMS, stable to a few percent from draw to draw (within 10%), and its
    largest value, a tail statistic (within 1.5x: draws measured 0.92-1.09x the emulation's).
    """
    original, rounded = DenseLinear.forward, []
    monkeypatch.setattr(
        DenseLinear, "forward", lambda self, x: rounded.append(self) or original(self, int16_rows(x))
    )
    emulated = window_logits(reference, ids)
    monkeypatch.setattr(DenseLinear, "forward", original)
    # every product rounded: 4 a layer (QKV, output, gate-up, down) and the LM head
    assert len(rounded) == 4 * len(reference.model.layers) + 1
    exact = window_logits(reference, ids)
    noise, error = emulated - exact, blocks_logits - exact
    assert _rms(error) <= 1.1 * _rms(noise), (_rms(error), _rms(noise))
    assert error.abs().max() <= 1.5 * noise.abs().max(), (error.abs().max(), noise.abs().max())
    assert torch.equal(blocks_logits.argmax(-1), exact.argmax(-1))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_an_engine_decodes_the_files_blocks(tiny_checkpoints, tmp_path, monkeypatch, qtype):
    """`auto` picks the blocks for a GGUF model; its decode steps agree with the fp32 model of
    the file's dequantized weights, but for the activations' int16 rounding."""
    path = write_tiny_gguf(tiny_checkpoints["llama"], tmp_path / f"tiny-{qtype}.gguf", qtype)
    folder = converted_copy(path, tmp_path / "converted")
    assert source_of(folder) == path.resolve()
    engine = make_engine(folder, quantization="auto")
    assert engine.loaded.quantization == "gguf"
    assert engine.weights["decode"].startswith(f"{qtype} blocks x")
    model = engine.loaded.model
    # The file's blocks are held once: the lookup reads them, the LM head keeps no dense copy.
    assert isinstance(model.embed_tokens, GgufBlocks) and model.lm_head.prefill is None
    reference = load_model(folder)
    assert resident_weight_bytes(model) < resident_weight_bytes(reference.model) / 2
    ids = list(range(5, 69))
    blocks_logits = decode_window_logits(engine.loaded, ids)
    _assert_error_is_the_int16_rounding(blocks_logits, reference, ids, monkeypatch)


def test_gguf_weights_need_a_gguf_model(tiny_checkpoints):
    with pytest.raises(QuantizationUnavailableError, match="was not converted from one"):
        load_model(tiny_checkpoints["llama"], quantization="gguf")
    # auto on a checkpoint of floats: int8, which the engine's weights gate keeps or drops
    assert load_model(tiny_checkpoints["llama"], quantization="auto").quantization == "int8"


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """In-features of 256, a whole K-quant block."""
    return build_tiny_checkpoint(
        "llama", tmp_path_factory.mktemp("wide") / "hf", seed=5, hidden_size=256, intermediate_size=256
    )


@pytest.mark.parametrize(
    "qtype, types, decode",
    [
        ("Q4_K", {}, "Q4_K blocks x9"),  # 2 layers of 4 and the LM head
        ("Q6_K", {}, "Q6_K blocks x9"),
        # Q4_K_M's attention: V in Q6_K, so each fused QKV holds rows of both (the mixed kind)
        ("Q4_K", {"v_proj.weight": "Q6_K"}, "Q4_K blocks x7, Q4_K+Q6_K blocks x2"),
    ],
)
def test_an_engine_decodes_k_quant_blocks(wide_llama, tmp_path, monkeypatch, qtype, types, decode):
    """A model of Q4_K or Q6_K matrices (and embeddings), or of Q4_K with V in Q6_K, decodes on
    their blocks, every decode step in one call of the kernels (engine.native.compute.cpu_kernels.decoder),
    and agrees with the fp32 model of the file's dequantized weights: greedy tokens and each
    position's logits."""
    path = write_tiny_gguf(
        wide_llama,
        tmp_path / f"{qtype}.gguf",
        qtype,
        k_quant_seed=7,
        k_quant_scale_range=K_QUANT_SCALES,
        types=types,
    )
    folder = converted_copy(path, tmp_path / "converted")
    engine = make_engine(folder, quantization="auto")
    assert engine.loaded.quantization == "gguf"
    assert engine.weights["decode"] == decode
    model = engine.loaded.model
    kinds = {layer.self_attn.qkv_proj.blocked.kind for layer in model.layers}
    assert kinds == ({"kmix"} if types else {qtype.lower().replace("_", "")})
    assert isinstance(model.embed_tokens, GgufBlocks) and model.embed_tokens.qtype == qtype
    reference = load_model(folder)
    # A decode step reads 0.75 (Q4_K), 1.25 (Q6_K) or 1.375 (mixed) bytes a weight, not 4.
    assert model.num_weight_bytes_per_token < reference.model.num_weight_bytes_per_token / 3
    ids = list(range(5, 69))
    blocks_logits = decode_window_logits(engine.loaded, ids)
    reference_logits = window_logits(reference, ids)
    assert torch.equal(blocks_logits.argmax(-1), reference_logits.argmax(-1))
    torch.testing.assert_close(blocks_logits, reference_logits, rtol=0, atol=2e-3)

    request = GenerationRequest(
        "r", tuple(ids[:12]), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    )
    fused_steps = []
    run = FusedDecoder._run
    monkeypatch.setattr(FusedDecoder, "_run", lambda self, *a: fused_steps.append(1) or run(self, *a))
    tokens = engine.generate([request])["r"]["token_ids"]
    assert len(fused_steps) >= 15  # every decode step in one call
    assert tokens == make_engine(folder).generate([request])["r"]["token_ids"]
