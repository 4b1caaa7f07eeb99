"""The fused decode forward (engine.native.compute.cpu_kernels.decoder) against the layer-by-layer path it
replaces: the same final hidden states and the same K/V written into the pool, for every family,
fp32 and int8, decodes alone and decodes beside a verification chunk."""

from __future__ import annotations

import pytest
import torch

from ragspeed.engine.native.compute.attention_metadata import (
    SMALL_CHUNK_QUERIES,
    SPAN_MIN_QUERIES,
    build_metadata,
    row_spans,
    slots,
)
from ragspeed.engine.native.compute.cpu_kernels import blocked_kernels_available, decode_step
from ragspeed.engine.native.core.kv_cache import KVCachePool
from ragspeed.engine.native.loading.gguf import converted_copy
from ragspeed.engine.native.loading.loader import load_model
from ragspeed.engine.protocol import GenerationRequest, SamplingParams
from tests.engine.conftest import FAMILIES, make_engine
from tests.engine.tiny_gguf import write_tiny_gguf
from tests.engine.tiny_models import build_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    not blocked_kernels_available(torch.device("cpu")), reason="ragspeed's CPU kernels are off"
)

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def odd_llama(tmp_path_factory):
    """Sizes off the kernels' 16-wide vectors: hidden 48, head_dim 12, intermediate 72."""
    return build_tiny_checkpoint(
        "llama",
        tmp_path_factory.mktemp("odd") / "llama",
        seed=5,
        hidden_size=48,
        intermediate_size=72,
    )


def _step(
    loaded,
    chunks: list[tuple[list[int], int]],
    fused: bool,
    kv_dtype=torch.float32,
    logits=False,
    int16_attention=False,
):
    """One decode-type forward over `chunks` ((block table, context length after the step),
    one query for a decode, several for a verification chunk), on a pool filled with seeded
    values; returns the final hidden states (with `logits`, every token's logits) and the pool."""
    arch = loaded.arch
    pool = KVCachePool(arch, 16, BLOCK_SIZE, kv_dtype, "cpu")
    generator = torch.Generator().manual_seed(0)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=generator))
    decodes = [(t, n) for t, n, q in chunks if q == 1]
    verifications = [(t, n, q) for t, n, q in chunks if q > 1]
    positions, slot_mapping = [], []
    for table, context_len, num_queries in [(t, n, 1) for t, n in decodes] + verifications:
        positions += range(context_len - num_queries, context_len)
        slot_mapping += slots(table, context_len - num_queries, context_len, BLOCK_SIZE)
    meta = build_metadata(
        decode_tables=[t for t, _ in decodes],
        decode_context_lens=[n for _, n in decodes],
        prefill_tables=[t for t, _, _ in verifications],
        prefill_context_lens=[n for _, n, _ in verifications],
        prefill_num_queries=[q for _, _, q in verifications],
        slot_mapping=slot_mapping,
        block_size=BLOCK_SIZE,
        device="cpu",
        int16_attention=int16_attention,
    )
    ids = torch.randint(2, arch.vocab_size, (len(positions),), generator=generator)
    loaded.model.fused_decode = fused
    forward = loaded.model.sample_logits if logits else loaded.model
    with torch.inference_mode(), decode_step(True):
        out = forward(ids, loaded.rotary.lookup(torch.tensor(positions)), pool.k_caches, pool.v_caches, meta)
    return out, pool.kv


STEPS = {
    "decodes": [([0, 1], 12, 1), ([2], 5, 1), ([3, 4, 5], 17, 1)],
    "decodes and a verification": [([0, 1], 12, 1), ([3, 4], 14, 5), ([6], 3, 1)],
    # the last chunk's rows attend in the prefill kernel (row_spans), where head_dim allows
    "decodes, a verification and a prefill chunk": [
        ([0, 1], 12, 1),
        ([3, 4], 14, 5),
        ([6], 3, 1),
        ([9, 10, 11, 12], 30, 20),
    ],
}


@pytest.mark.parametrize(
    "quantization, kv_dtype", [(None, torch.float32), ("int8", torch.float32), (None, torch.float16)]
)
@pytest.mark.parametrize("family", [*FAMILIES, "odd llama"])
@pytest.mark.parametrize("step", list(STEPS))
def test_fused_forward_matches_the_layer_by_layer_path(
    tiny_checkpoints, odd_llama, family, quantization, kv_dtype, step
):
    path = odd_llama if family == "odd llama" else tiny_checkpoints[family]
    loaded = load_model(path, max_model_len=256, quantization=quantization)
    assert loaded.model._fused_decoder() is not None
    fused, fused_kv = _step(loaded, STEPS[step], fused=True, kv_dtype=kv_dtype)
    layered, layered_kv = _step(loaded, STEPS[step], fused=False, kv_dtype=kv_dtype)
    # int8: the int16 rounding of the activations can turn a float-order difference (fused and
    # layered attention) into a whole step of a group's range (a 65,534th); fp16: a key or
    # value written by each path can round to neighbouring fp16 steps
    tolerance = 1e-4 if quantization is None and kv_dtype == torch.float32 else 5e-4
    kv_tolerance = tolerance if kv_dtype == torch.float32 else 2**-10
    torch.testing.assert_close(fused, layered, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(fused_kv.float(), layered_kv.float(), rtol=kv_tolerance, atol=tolerance)
    assert not torch.equal(fused_kv, KVCachePool(loaded.arch, 16, BLOCK_SIZE, kv_dtype, "cpu").kv)


def _gguf_model(checkpoint, folder, qtype):
    """The checkpoint as a GGUF file of `qtype` (its embedding too), decoded on its blocks."""
    path = write_tiny_gguf(checkpoint, folder / f"tiny-{qtype}.gguf", qtype)
    return load_model(converted_copy(path, folder / "converted"), max_model_len=256, quantization="gguf")


@pytest.mark.parametrize(
    "family, quantization",
    [(f, q) for f in FAMILIES for q in (None, "int8")] + [("llama", "gguf Q8_0"), ("llama", "gguf Q4_1")],
)
def test_the_lm_head_in_the_fused_call_gives_the_heads_logits(
    tiny_checkpoints, tmp_path, family, quantization
):
    """Every token samples: the embedding lookup (in the kernels for fp32 rows and Q8_0 blocks),
    the forward and the head in one call give the logits of the fused forward's hidden states
    through the model's own head."""
    if quantization and quantization.startswith("gguf"):
        loaded = _gguf_model(tiny_checkpoints[family], tmp_path, quantization.split()[1])
    else:
        loaded = load_model(tiny_checkpoints[family], max_model_len=256, quantization=quantization)
    assert loaded.model._fused_decoder().embeds == (quantization != "gguf Q4_1")
    step = STEPS["decodes and a verification"]
    in_one_call, _ = _step(loaded, step, fused=True, logits=True)
    hidden, _ = _step(loaded, step, fused=True)  # looked up in Python
    with torch.inference_mode(), decode_step(True):
        expected = loaded.model.compute_logits(hidden)
    assert in_one_call.shape == (len(hidden), loaded.arch.num_logits)
    assert torch.equal(in_one_call, expected)
    layered, _ = _step(loaded, step, fused=False, logits=True)  # no fused call: forward, then head
    torch.testing.assert_close(layered, expected, rtol=1e-3, atol=1e-3)


def test_a_row_gets_the_same_bits_in_any_batch(tiny_checkpoints):
    loaded = load_model(tiny_checkpoints["qwen3"], max_model_len=256)
    alone, _ = _step(loaded, [([0, 1], 12, 1)], fused=True)
    batched, _ = _step(loaded, STEPS["decodes and a verification"], fused=True)
    beside_a_chunk, _ = _step(loaded, STEPS["decodes, a verification and a prefill chunk"], fused=True)
    assert loaded.arch.head_dim % 16 == 0  # so the chunk's rows attend in the prefill kernel
    assert torch.equal(alone[0], batched[0])
    assert torch.equal(batched, beside_a_chunk[: len(batched)])  # the decodes' and verification's rows


@pytest.mark.parametrize("family", FAMILIES)
def test_a_chunk_beside_decodes_attends_on_int16_in_the_fused_call_too(tiny_checkpoints, family):
    """With the prefill kernel's products on int16, a prefill chunk's rows in the fused call
    attend on int16 (apart from fp32's, within int16's rounding: the layer-by-layer path runs a
    step of small chunks a row at a time in the decode kernel, fp32), and the decodes' and the
    verification's rows keep a plain decode's bits."""
    loaded = load_model(tiny_checkpoints[family], max_model_len=256)
    step = STEPS["decodes, a verification and a prefill chunk"]
    int16, _ = _step(loaded, step, fused=True, int16_attention=True)
    fp32, _ = _step(loaded, step, fused=True)
    layered, _ = _step(loaded, step, fused=False, int16_attention=True)
    rows = sum(q for _, _, q in step[:-1])  # the decodes and the verification
    assert torch.equal(int16[:rows], fp32[:rows])
    moved = (int16[rows:] - layered[rows:]).abs().max()
    assert 1e-4 < moved < 2e-2, float(moved)  # fp32's own fused-to-layered difference is under 1e-4


def test_only_the_last_plain_chunks_of_enough_queries_attend_in_the_prefill_kernel():
    plain = [None, None, None]
    assert row_spans([5, 20, 30], plain, [4, 0, 0]) == (20, 30)
    assert row_spans([20, 5], [None, None], [0, 4]) == ()  # a verification last
    assert row_spans([20, 30], [None, None], []) == (20, 30)  # no drafts given: none
    assert row_spans([30, 20], [None, (1, 4, 9)], [0, 0]) == ()  # scattered
    assert row_spans([30, SPAN_MIN_QUERIES - 1], [None, None], [0, 0]) == ()
    assert row_spans([SPAN_MIN_QUERIES], [None], [0]) == (SPAN_MIN_QUERIES,)
    meta = build_metadata([[0]], [3], [[1, 2]], [30], [20], list(range(21)), BLOCK_SIZE, "cpu")
    assert meta.row_spans == (20,)
    reference = build_metadata(
        [[0]], [3], [[1, 2]], [30], [20], list(range(21)), BLOCK_SIZE, "cpu", prefill_kernel=False
    )
    assert reference.row_spans == ()  # SDPA's reference: every row a row of the decode kernel
    large = SMALL_CHUNK_QUERIES + 1
    assert (
        build_metadata(
            [], [], [[1, 2, 3, 4, 5, 6, 7, 8, 9]], [large], [large], list(range(large)), BLOCK_SIZE, "cpu"
        ).row_spans
        == ()
    )


def test_prefill_steps_and_unsupported_models_take_the_layer_by_layer_path(tiny_checkpoints):
    from ragspeed.engine.native.compute.cpu_kernels.decoder import FusedDecoder

    loaded = load_model(tiny_checkpoints["llama"], max_model_len=256)
    n = SMALL_CHUNK_QUERIES + 4  # a prefill chunk past a small one
    table = list(range(-(-n // BLOCK_SIZE)))
    meta = build_metadata([], [], [table], [n], [n], list(range(n)), BLOCK_SIZE, "cpu")
    with decode_step(False):
        assert FusedDecoder.rows(meta, n) is None
    with decode_step(True):
        assert FusedDecoder.rows(meta, n) is None  # its queries are not decode-kernel rows
    loaded.model.layers[1].mlp.down_proj.blocked = None  # a projection without a blocked copy
    assert not FusedDecoder.supports(loaded.model) and loaded.model._fused_decoder() is None


def test_a_step_of_decodes_alone_gives_the_logits_and_kv_of_the_general_path(tiny_checkpoints):
    """The model runner's path for steps of decodes alone (straight from the step buffers into
    the fused call) against its general one: the same logits and the same K/V, bit for bit, as
    the batch grows and shrinks (requests of different lengths finish at different steps)."""
    engine = make_engine(tiny_checkpoints["llama"])
    for i, (prompt_len, max_tokens) in enumerate([(5, 12), (19, 4), (9, 8)]):
        prompt = tuple(range(3 + i, 3 + i + prompt_len))
        engine.add_request(GenerationRequest(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens)))
    fused = engine.loaded.model._fused_decoder()
    assert fused is not None and fused.head is not None and fused.embeds  # the path applies
    runner, kv = engine.runner, engine.kv_pool.kv
    num_decode_steps = 0
    while engine.has_unfinished():
        output = engine.scheduler.schedule()
        if not output.prefills:
            kv_before = kv.clone()
            general = runner._execute(output).clone()
            kv_general = kv.clone()
            kv.copy_(kv_before)
            fast = runner.execute(output)
            assert torch.equal(fast, general)
            assert torch.equal(kv, kv_general) and not torch.equal(kv, kv_before)
            num_decode_steps += 1
        engine._run_step(output)
    assert num_decode_steps >= 10


def test_decode_steps_give_the_same_bits_on_one_thread_or_two(tiny_checkpoints):
    """The runner picks each decode step's thread count by timing (engine.native.compute.threads.DecodeThreads),
    so a stream may change count between tokens: its logits and K/V must not."""
    from ragspeed.engine.native.compute.threads import DecodeThreads

    class Forced(DecodeThreads):
        threads = 1

        def pick(self, batch: int, num_threads: int) -> int:
            return self.threads

    engine = make_engine(tiny_checkpoints["llama"], num_threads=2)
    for i, prompt_len in enumerate([5, 19, 9]):
        engine.add_request(
            GenerationRequest(f"r{i}", tuple(range(3 + i, 3 + i + prompt_len)), SamplingParams(max_tokens=6))
        )
    runner, kv = engine.runner, engine.kv_pool.kv
    runner.decode_threads = forced = Forced()
    num_decode_steps = 0
    while engine.has_unfinished():
        output = engine.scheduler.schedule()
        if not output.prefills:
            kv_before = kv.clone()
            forced.threads = 1
            one = runner.execute(output).clone()
            kv_one = kv.clone()
            kv.copy_(kv_before)
            forced.threads = 2
            assert torch.equal(runner.execute(output), one)
            assert torch.equal(kv, kv_one)
            num_decode_steps += 1
        engine._run_step(output)
    assert num_decode_steps >= 4
