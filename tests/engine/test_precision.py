"""Prefill precision by the CPU's capability (engine.native.core.precision): the policy on an AMX Xeon and
on this AVX2 AMD (both injected), the bf16 branch forced on any machine (emulated bf16 here:
tiny model, few tokens), the start-up gate's fallback and the bad-input errors."""

from __future__ import annotations

import logging

import pytest
import torch

from ragspeed.engine.native.compute.cpu_features import CpuFeatures
from ragspeed.engine.native.compute.quant.probe import Measurement, PrefillProbe, ProbeGemm
from ragspeed.engine.native.core.precision import (
    calibration_windows,
    choose_prefill,
    gate_weights,
    plan_prefill,
)
from ragspeed.engine.native.core.quality import QualityReport
from ragspeed.engine.native.core.quality_gate import QualityGate, use_prefill_path
from ragspeed.engine.native.loading.dtypes import DTYPES, DtypeUnavailableError, dtype_choice, model_dtype
from ragspeed.engine.native.loading.loader import load_model
from ragspeed.engine.native.models.linear import DENSE_PREFILL_PATHS, DenseLinear
from ragspeed.engine.protocol import GenerationRequest, SamplingParams
from tests.engine.conftest import AMX, AVX2, AVX512_BF16, make_engine

# The prefill paths' product times, injected (engine.native.compute.quant.probe; its own tests order by others)
SECONDS = {
    "bf16": 1.0,
    "fp32": 4.0,
    "bf16-dequantized": 1.0,
    "fbgemm-u8": 2.0,
    "fp32-dequantized": 4.0,
    "int8-blocks": 0.5,
    "int16-blocks": 0.8,
}
PROBE = PrefillProbe(
    ProbeGemm(64, 1), lambda paths, gemm: Measurement({p.name: SECONDS[p.name] for p in paths}, 1.0)
)


def _names(plan) -> list[str]:
    return [p.name for p in plan.candidates]


@pytest.mark.parametrize(
    "dtype, quantization, features, names",
    [
        ("auto", None, AVX2, ["fp32"]),
        ("auto", None, AMX, ["bf16", "fp32"]),
        ("auto", None, AVX512_BF16, ["bf16", "fp32"]),
        ("float32", None, AMX, ["fp32"]),
        ("float16", None, AMX, ["fp32"]),
        ("bfloat16", None, AMX, ["bf16", "fp32"]),
        ("auto", "int8", AVX2, ["fp32-dequantized"]),
        ("auto", "int8", AMX, ["bf16-dequantized", "fbgemm-u8", "fp32-dequantized"]),
        ("auto", "int8", AVX512_BF16, ["bf16-dequantized", "fbgemm-u8", "fp32-dequantized"]),
        ("float32", "int8", AMX, ["fbgemm-u8", "fp32-dequantized"]),
        ("bfloat16", "int8", AMX, ["bf16-dequantized", "fp32-dequantized"]),
        # a GGUF model's blocks: the integer paths run on every CPU (AVX2 and AVX-512 code alike)
        ("auto", "gguf", AVX2, ["int8-blocks", "int16-blocks", "fp32"]),
        ("auto", "gguf", AMX, ["int8-blocks", "int16-blocks", "bf16", "fp32"]),
        ("float32", "gguf", AVX512_BF16, ["int8-blocks", "int16-blocks", "fp32"]),
        ("bfloat16", "gguf", AMX, ["bf16", "fp32"]),
    ],
)
def test_policy_by_cpu(dtype, quantization, features, names):
    assert _names(plan_prefill(dtype, quantization, "cpu", features, PROBE)) == names


@pytest.mark.parametrize(
    "dtype, features, offered",
    [("auto", AVX2, True), ("float32", AMX, False), ("float16", AVX2, False), ("bfloat16", AMX, False)],
)
def test_the_attentions_integer_products_are_gated_under_auto_alone(dtype, features, offered):
    plan = plan_prefill(dtype, None, "cpu", features, PROBE)
    assert plan.int16_attention == offered and "int16-attention" not in plan.unavailable


def test_the_attentions_integer_products_need_avx2_and_the_kernel():
    plan = plan_prefill("auto", None, "cpu", CpuFeatures("old", frozenset(), "DEFAULT"), PROBE)
    assert not plan.int16_attention and plan.unavailable["int16-attention"] == "needs AVX2"
    plan = plan_prefill("auto", None, "cpu", AVX2, PROBE, attention_kernel=False)  # head_dim 12, say
    assert not plan.int16_attention
    assert plan.unavailable["int16-attention"] == "the prefill attention kernel does not run this model"


def test_policy_off_cpu_and_the_transformers_dtype():
    assert plan_prefill("auto", None, "cuda", AVX2, PROBE) is None
    assert model_dtype("auto", "cpu", AVX2) == torch.float32
    assert model_dtype("auto", "cpu", AMX) == torch.bfloat16
    assert model_dtype("bfloat16", "cpu", AVX2) == torch.bfloat16  # the baseline, asked for
    assert model_dtype("float16", "cuda", AVX2) == torch.float16
    assert list(DTYPES) == ["auto", "float32", "bfloat16", "float16"]


def test_bad_dtypes_are_refused_with_what_runs():
    with pytest.raises(DtypeUnavailableError) as error:
        plan_prefill("bfloat16", None, "cpu", AVX2, PROBE)
    assert str(error.value) == (
        "bfloat16 prefill needs AMX-BF16 or AVX512-BF16 (amx_bf16 / avx512_bf16); this CPU (AMD EPYC) "
        "has avx2: use --dtype auto or float32"
    )
    with pytest.raises(DtypeUnavailableError, match=r"^bfloat16 prefill needs .* has avx2: use"):
        plan_prefill("bfloat16", "int8", "cpu", AVX2, PROBE)
    with pytest.raises(
        DtypeUnavailableError, match=r"^unknown dtype 'fp8'; choices: auto, float32, bfloat16, float16$"
    ):
        dtype_choice("fp8")
    with pytest.raises(DtypeUnavailableError, match="^unknown dtype 'fp8'"):
        plan_prefill("fp8", None, "cuda", AVX2, PROBE)


def test_engine_start_up_refuses_bfloat16_without_bf16(tiny_checkpoints):
    from ragspeed.engine.config import EngineConfig
    from ragspeed.engine.native.core.factory import build_llm_engine

    config = EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="bfloat16", max_model_len=64)
    with pytest.raises(DtypeUnavailableError, match=r"this CPU \(AMD EPYC\) has avx2: use --dtype auto"):
        build_llm_engine(config, features=AVX2)


def test_settings_list_the_dtypes():
    from ragspeed.gateway.settings import ConfigError, load_settings

    assert load_settings().engine.dtype == "auto"
    with pytest.raises(
        ConfigError, match="dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'"
    ):
        load_settings(dtype="fp8")


def _dense_dtypes(engine) -> set[torch.dtype]:
    return {m.prefill.compute_dtype for m in engine.loaded.model.modules() if isinstance(m, DenseLinear)}


def test_auto_on_avx2_is_fp32_and_nothing_in_bf16(tiny_checkpoints, caplog):
    with caplog.at_level(logging.INFO, logger="ragspeed.engine.native.core.precision"):
        engine = make_engine(tiny_checkpoints["llama"], dtype="auto", features=AVX2)
    assert engine.prefill_path == "fp32"
    assert _dense_dtypes(engine) == {torch.float32}
    # the one path to gate: the attention's integer products, which pass on the tiny model
    assert list(engine.prefill_choice.reports) == ["int16-attention"] and engine.runner.int16_attention
    assert caplog.messages == [
        "prefill fp32 (activations kept in fp32, attention int16 scores and sums), decode blocked fp32, "
        "dtype auto on AMD EPYC (torch AVX2): "
        "avx2; no avx512f, avx512_vnni, avx_vnni, avx512_bf16, amx_bf16, amx_int8; not here: bf16: no "
        "AMX-BF16 or AVX512-BF16 (amx_bf16 / avx512_bf16): bf16 products run ~30x slower than fp32"
    ]


def _failing(path, int16_attention: bool) -> QualityReport:
    passing = path.name == "fp32" and not int16_attention
    return QualityReport(4, 508, 50.0, 50.0 if passing else 51.0, 0.0 if passing else 0.02, 1.0, 0.1)


def test_gate_falls_back_to_fp32_and_logs_why(tiny_checkpoints, caplog):
    from ragspeed.engine.native.loading.loader import load_model

    loaded = load_model(tiny_checkpoints["llama"], dtype="auto", max_model_len=64)
    plan = plan_prefill("auto", loaded.quantization, "cpu", AMX, PROBE)
    with caplog.at_level(logging.INFO):
        choice = choose_prefill(loaded, plan, lambda: pytest.fail("measure is injected"), measure=_failing)
    missed = "perplexity +2.00% > +0.1%"
    assert choice.path.name == "fp32" and choice.rejected == {"bf16": missed, "int16-attention": missed}
    assert not choice.int16_attention and choice.name == "fp32"
    assert {m.path.name for m in loaded.model.modules() if isinstance(m, DenseLinear)} == {"fp32"}
    assert caplog.messages == [
        f"prefill path bf16 fails the quality gate ({missed}): falling back to fp32",
        f"int16-attention fails the quality gate ({missed}): attention in fp32",
        "prefill fp32 (activations kept in fp32, attention fp32), decode blocked fp32, dtype auto on Intel "
        "Xeon (torch AVX512): avx2, avx512f, avx512_vnni, avx512_bf16, amx_bf16, amx_int8; no avx_vnni; "
        f"failed the quality gate: bf16 ({missed}); int16-attention ({missed})",
    ]


def test_calibration_windows_of_the_shipped_text(tiny_checkpoints):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoints["llama"]))
    windows = calibration_windows(tokenizer)
    assert [len(w) for w in windows] == [128, 128, 128, 128]
    with pytest.raises(ValueError, match=r"the calibration text gives \d+ tokens, fewer than 1000 x 128"):
        calibration_windows(tokenizer, num_windows=1000)


@pytest.mark.parametrize("features, gated", [(AVX2, None), (AMX, 4 * 39)])
def test_a_short_context_gates_on_windows_that_fit_it(tiny_checkpoints, features, gated):
    """With --max-model-len under the calibration window, the start-up gate measures on windows
    cut to the rotation table (a CPU with VNNI gates fbgemm; one without gates nothing)."""
    engine = make_engine(
        tiny_checkpoints["llama"],
        features=features,
        prefill_probe=PROBE,
        quantization="int8",
        max_model_len=40,
        num_kv_cache_tokens=40,
    )
    report = engine.prefill_choice.reports.get("fbgemm-u8")
    assert (report.num_predictions if report else None) == gated


def test_forced_bf16_branch_computes_on_this_cpu(tiny_checkpoints):
    """AMX injected: the engine's start-up gate measures bf16 against fp32 on the calibration
    windows (emulated bf16 here: slow but the same rounding); then, on the bf16 path, prefill
    rounds only the GEMMs and decode stays fp32."""
    engine = make_engine(tiny_checkpoints["llama"], dtype="bfloat16", features=AMX, prefill_probe=PROBE)
    choice = engine.prefill_choice
    report = choice.reports["bf16"]
    assert report.num_predictions == 4 * 127
    assert engine.prefill_path == ("fp32" if choice.rejected else "bf16")
    use_prefill_path(engine.loaded.model, DENSE_PREFILL_PATHS[0])
    assert _dense_dtypes(engine) == {torch.bfloat16}
    assert (
        engine.kv_pool.kv.dtype == torch.float32 and engine.loaded.model.embed_tokens.dtype == torch.float32
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [tuple(range(3, 40)), tuple(range(50, 70)), tuple(range(7, 107, 3))]
    out = engine.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    from transformers import AutoModelForCausalLM

    from tests.engine.conftest import hf_greedy

    bf16_model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.bfloat16).eval()
    reference = [hf_greedy(bf16_model, list(p), 6) for p in prompts]
    got = [out[f"r{i}"]["token_ids"] for i in range(len(prompts))]
    # Greedy outputs are not equal on this tiny random model (its logits are nearly flat:
    # perplexity ~1,300 over a 512-token vocabulary), where transformers rounds every op to
    # bf16 and the native engine only the prefill GEMMs; each first token (the prefill's) is.
    assert [g[0] for g in got] == [r[0] for r in reference]
    # Prefill logits against transformers' bf16 ones, by the gate's measures.
    from ragspeed.engine.native.core.quality import compare_logits
    from ragspeed.engine.native.core.window_logits import window_logits

    windows = calibration_windows(engine.tokenizer)

    def hf_logits(ids):
        with torch.inference_mode():
            return bf16_model(torch.tensor([ids])).logits[0].float()

    versus = compare_logits(hf_logits, lambda ids: window_logits(engine.loaded, ids), windows)
    print(f"native bf16 prefill vs transformers bf16 prefill: {versus}")
    agree = sum(a == b for g, r in zip(got, reference) for a, b in zip(g, r))
    print(f"greedy tokens equal: {agree}/{6 * len(prompts)}; native bf16 vs fp32: {report}")
    assert versus.ppl_increase < 0.01 and versus.top1_agreement > 0.9


@pytest.mark.parametrize("min_top1, served", [(0.5, "int8"), (1.01, None)])
def test_auto_int8_weights_serve_only_where_the_gate_passes(tiny_checkpoints, caplog, min_top1, served):
    """`--quantization auto` on a checkpoint of floats loads int8; `gate_weights` keeps it where
    its answers pass the gate against fp32 and serves the fp32 reference where they do not,
    naming the figures."""
    path = tiny_checkpoints["llama"]
    loaded = load_model(path, quantization="auto")
    assert loaded.quantization == "int8"
    windows = [list(range(5, 69)), list(range(100, 164))]
    with caplog.at_level(logging.INFO):
        chosen = gate_weights(
            loaded, lambda: load_model(path), lambda: windows, QualityGate(min_top1_agreement=min_top1)
        )
    assert chosen.quantization == served
    assert (
        "int8 weights pass the quality gate" if served else "int8 weights fail the quality gate"
    ) in caplog.text
    assert "top-1 agreement" in caplog.text


def test_an_engine_on_auto_runs_the_weights_gate(tiny_checkpoints, caplog):
    with caplog.at_level(logging.INFO):
        engine = make_engine(tiny_checkpoints["llama"], quantization="auto")
    assert "int8 weights pass the quality gate" in caplog.text or "int8 weights fail" in caplog.text
    assert engine.weights["quantization"] in ("int8", "none")


def _gate_by_top1(top1: dict[str, float]):
    """A measure: each path's top-1 agreement by its name (+int16-attention with those), else 1."""

    def measure(path, int16_attention: bool) -> QualityReport:
        name = path.name + ("+int16-attention" if int16_attention else "")
        return QualityReport(4, 508, 50.0, 50.0, 0.0, top1.get(name, 1.0), 0.1)

    return measure


def test_gguf_blocks_prefill_on_the_first_integer_path_the_gate_passes(tmp_path, tiny_checkpoints, caplog):
    """int8 activations fail the gate (SmolLM2-135M: top-1 96.85%), int16 pass: the model's Q4_1
    layers move to the int16 product (engine.native.compute.cpu_kernels.int8_prefill), its Q8_0 head keeps no
    dense copy; a prefill of many rows then computes each row exactly as the decode kernels do
    (the same int16 rounding, exact integer sums, the same fp32 steps in the same order)."""
    from ragspeed.engine.native.compute.cpu_kernels.int8_prefill import Int8BlocksGemm
    from ragspeed.engine.native.loading.gguf import converted_copy
    from ragspeed.engine.native.models.linear import GgufLinear
    from tests.engine.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tiny_checkpoints["llama"], tmp_path / "tiny-Q4_1.gguf", "Q4_1")
    loaded = load_model(converted_copy(path, tmp_path / "converted"), quantization="gguf")
    plan = plan_prefill("auto", loaded.quantization, "cpu", AVX2, PROBE)
    with caplog.at_level(logging.INFO):
        choice = choose_prefill(
            loaded,
            plan,
            lambda: pytest.fail("measure is injected"),
            measure=_gate_by_top1({"int8-blocks": 0.9685}),
        )
    assert choice.path.name == "int16-blocks"
    missed = "top-1 agreement 96.85% (95% lower bound 94.94% of 508) < 99%"
    assert choice.rejected == {"int8-blocks": missed}
    assert caplog.messages[0] == (
        f"prefill path int8-blocks fails the quality gate ({missed}): falling back to int16-blocks"
    )
    assert caplog.messages[1].startswith(
        "prefill int16-blocks (activations rounded to int16 per block of 32, attention int16 scores and "
        "sums), decode the file's blocks"
    )
    assert choice.int16_attention and choice.name == "int16-blocks+int16-attention"
    layers = [m for m in loaded.model.modules() if isinstance(m, GgufLinear) and m.prefill is not None]
    assert layers and all(
        isinstance(m.prefill, Int8BlocksGemm) and m.prefill.activation_bits == 16 for m in layers
    )
    assert loaded.model.lm_head.prefill is None
    layer = loaded.model.layers[0].mlp.gate_up_proj
    x = torch.randn(40, layer.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(layer.forward(x), layer.blocks.forward(x, layer.num_threads))
    use_prefill_path(loaded.model, plan.candidates[0])  # int8 (its products: test_int8_prefill)
    assert layer.prefill.activation_bits == 8
    use_prefill_path(loaded.model, plan.exact)
    assert {type(m.prefill).__name__ for m in layers} == {"PackedLinear"}
