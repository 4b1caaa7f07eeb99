"""The int8 kind's CPU paths (engine.native.compute.quant.prefill, engine.native.core.quality_gate) chosen by the CPU's
capabilities (engine.native.compute.cpu_features): both branches forced on any machine, each path's accuracy,
the quality gate's fallback and the logged choice."""

from __future__ import annotations

import logging

import pytest
import torch

from ragspeed.engine.native.compute import cpu_features
from ragspeed.engine.native.compute.cpu_features import (
    CpuFeatures,
    narrowed,
    parse_cpuinfo,
    read_cpu_features,
)
from ragspeed.engine.native.compute.cpu_kernels import blocked_kernels_available
from ragspeed.engine.native.compute.quant import Int8Linear, check_quantization
from ragspeed.engine.native.compute.quant.groupwise import quantize_groupwise
from ragspeed.engine.native.compute.quant.prefill import (
    PREFILL_PATHS,
    describe_choice,
    prefill_candidates,
    prefill_path,
)
from ragspeed.engine.native.compute.quant.probe import Measurement, PrefillProbe, ProbeGemm
from ragspeed.engine.native.core.quality import QualityReport
from ragspeed.engine.native.core.quality_gate import QualityGate, gate_prefill, use_prefill_path
from ragspeed.engine.native.models.linear import DenseLinear
from tests.engine.conftest import int16_rows

AVX2 = CpuFeatures("AMD EPYC", frozenset({"avx2"}), "AVX2")
VNNI = CpuFeatures("Intel Xeon", frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}), "AVX512")
AMX = CpuFeatures(
    "Intel Xeon", frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}), "AVX512"
)
# The int8 paths' product times, injected (engine.native.compute.quant.probe; its own tests order by others)
SECONDS = {"fbgemm-u8": 1.0, "bf16-dequantized": 2.0, "fp32-dequantized": 4.0}
PROBE = PrefillProbe(
    ProbeGemm(64, 1), lambda paths, gemm: Measurement({p.name: SECONDS[p.name] for p in paths}, 1.0)
)
HERE = read_cpu_features()  # at import: before the suite's fixture hides the faster paths
needs_vnni = pytest.mark.skipif(
    not HERE.has_vnni, reason=f"fbgemm's u8 path needs VNNI; this CPU: {HERE.describe()}"
)


def test_parse_cpuinfo_and_describe():
    text = (
        "processor\t: 0\nmodel name\t: AMD EPYC 7B13\n"
        "flags\t\t: fpu sse2 avx fma avx2 bmi2\nprocessor\t: 1\nflags\t\t: avx512f\n"
    )
    features = parse_cpuinfo(text, "AVX2")
    assert features == CpuFeatures("AMD EPYC 7B13", frozenset({"avx2"}), "AVX2")
    assert not features.has_vnni and not features.has_bf16
    assert features.describe() == (
        "AMD EPYC 7B13 (torch AVX2): avx2; no avx512f, avx512_vnni, avx_vnni, avx512_bf16, amx_bf16, amx_int8"
    )
    # the family and model numbers name the generation where the model name does not (a VM's)
    numbered = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nflags\t\t: avx2\n"
    assert parse_cpuinfo(numbered, "AVX2").model_name == "AMD EPYC, family 25 model 17"
    assert VNNI.has_vnni and VNNI.has_bf16
    assert parse_cpuinfo("", "DEFAULT").describe() == (
        "unknown CPU (torch DEFAULT): none of the tracked flags; no avx2, avx512f, "
        "avx512_vnni, avx_vnni, avx512_bf16, amx_bf16, amx_int8"
    )
    with pytest.raises(ValueError, match=r"unknown CPU flags \['sse9'\]"):
        CpuFeatures("x", frozenset({"sse9"}), "AVX2")


def test_a_narrower_isa_leaves_only_its_flags():
    assert narrowed(VNNI, "native") == VNNI
    assert narrowed(VNNI, "avx2") == CpuFeatures("Intel Xeon", frozenset({"avx2"}), "AVX2")
    assert narrowed(VNNI, "plain") == CpuFeatures("Intel Xeon", frozenset(), "DEFAULT")
    assert narrowed(AVX2, "plain").torch_capability == "DEFAULT"


def test_read_cpu_features_of_this_machine(tmp_path):
    assert HERE.torch_capability == torch.backends.cpu.get_cpu_capability()
    assert read_cpu_features(tmp_path / "missing").flags == frozenset()


def test_candidates_by_capability():
    assert [p.name for p in prefill_candidates(AVX2, PROBE)] == ["fp32-dequantized"]
    # the runnable ones, in the order of their injected times (tests/engine/test_probe.py)
    assert [p.name for p in prefill_candidates(VNNI, PROBE)] == [
        "fbgemm-u8",
        "bf16-dequantized",
        "fp32-dequantized",
    ]
    assert [p.name for p in prefill_candidates(AMX, PROBE)] == [
        "fbgemm-u8",
        "bf16-dequantized",
        "fp32-dequantized",
    ]
    assert prefill_path("fbgemm-u8") is PREFILL_PATHS[0]
    with pytest.raises(ValueError, match="unknown int8 prefill path 'u4'; known: 'fbgemm-u8', "):
        prefill_path("u4")


def test_quantize_groupwise_literal():
    weight = torch.tensor([[1.0, -0.5, 0.02, 0.005, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]])
    q = quantize_groupwise(weight, group_size=2)
    # Scales in fp16, rounded up (1/127 -> 0.0078812 above fp16's nearest 0.0078735), the
    # weights rounded against them: -0.5 is -63 steps, not -64.
    assert q.qweight.tolist() == [[127, -63, 127, 32, 0], [0, 0, 0, 0, 127]]
    assert q.scales.shape == (2, 3) and q.scales.dtype == torch.float16  # groups of 2, 2 and 1
    assert q.scales[0].tolist() == [0.00788116455078125, 0.0001575946807861328, 6.103515625e-05]
    assert q.num_bytes == 10 + 6 * 2
    err = (q.dequantize() - weight).abs()
    assert float(err.max()) <= 0.00788116455078125 / 2  # half a step of the largest group scale
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        quantize_groupwise(weight, group_size=0)


def _layers(monkeypatch, features: CpuFeatures, bias: bool):
    monkeypatch.setattr(cpu_features, "read_cpu_features", lambda: features)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    dense, int8 = DenseLinear(64, 96, bias), Int8Linear(64, 96, bias)
    dense.load(weight, b)
    int8.load(weight, b)
    return dense, int8


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("bias", [False, True])
def test_avx2_branch_is_exact_activations_and_accurate(monkeypatch, bias):
    """Full-range activations (the case that saturates fbgemm's AVX2 kernel): the forced AVX2
    branch multiplies the dequantized weight in fp32, so prefill equals x @ W_int8.T."""
    dense, int8 = _layers(monkeypatch, AVX2, bias)
    assert int8.kernel.path.name == "fp32-dequantized"
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 64, generator=gen) * 10
    ref, out = dense(x), int8(x)
    assert _relative_error(out, ref) < 0.01
    w_int8 = quantize_groupwise(torch.randn(96, 64, generator=torch.Generator().manual_seed(0)))
    exact = x @ w_int8.dequantize().T + (int8.kernel.bias if bias else 0)
    torch.testing.assert_close(out, exact, rtol=1e-4, atol=1e-3)
    # A decode row goes to the blocked kernel, which rounds the activations to int16.
    decode_exact = int16_rows(x[:1]) @ w_int8.dequantize().T + (int8.kernel.bias if bias else 0)
    torch.testing.assert_close(int8(x[:1]), decode_exact, rtol=1e-4, atol=1e-3)


def test_vnni_branch_offers_fbgemm_after_the_gate(monkeypatch):
    """On any machine: a VNNI CPU loads on the exact path too and offers fbgemm's u8 prefill
    to the quality gate (its accuracy needs a VNNI CPU: test_fbgemm_u8_accuracy_on_vnni);
    decode rows take the blocked kernel on either path."""
    dense, int8 = _layers(monkeypatch, VNNI, bias=True)
    assert int8.kernel.path.name == "fp32-dequantized"
    use_prefill_path(torch.nn.Sequential(int8), prefill_path("fbgemm-u8"))
    assert int8.kernel.path.name == "fbgemm-u8"
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    if blocked_kernels_available(torch.device("cpu")):
        assert _relative_error(int8(x), dense(x)) < 0.01


@needs_vnni
def test_fbgemm_u8_accuracy_on_vnni(monkeypatch):
    dense, int8 = _layers(monkeypatch, HERE, bias=False)
    use_prefill_path(torch.nn.Sequential(int8), prefill_path("fbgemm-u8"))
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    assert _relative_error(int8(x), dense(x)) < 0.02


def test_switching_the_prefill_path_keeps_decode_and_bytes(monkeypatch):
    dense, int8 = _layers(monkeypatch, VNNI, bias=True)
    model = torch.nn.Sequential(int8)
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    before = int8(row)
    assert use_prefill_path(model, prefill_path("fbgemm-u8")) == 1
    assert use_prefill_path(model, prefill_path("fp32-dequantized")) == 1
    assert int8.kernel.path.name == "fp32-dequantized"
    torch.testing.assert_close(int8(row), before, rtol=0, atol=0)  # the same blocked copy
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(5))
    assert _relative_error(int8(x), dense(x)) < 0.01
    if blocked_kernels_available(torch.device("cpu")):
        # fp32 prefill layout + bias, beside the blocked int8 copy (weights, scales, bias)
        assert int8.num_resident_bytes == 96 * 64 * 4 + 96 * 4 + (96 * 64 + 96 * 2 * 2 + 96 * 4)


def _report(ppl_increase: float, top1: float) -> QualityReport:
    return QualityReport(4, 1000, 50.0, 50.0 * (1 + ppl_increase), ppl_increase, top1, 0.1)


def test_the_prefill_gate_asks_the_agreements_lower_bound():
    """On the start-up windows' 508 predictions, 506 agreeing (99.6%) is not enough to say the
    path agrees at 99% (its 95% Wilson lower bound is 98.6%); all 508 are."""
    from ragspeed.engine.native.core.precision import PREFILL_GATE

    def report(agreeing: int) -> QualityReport:
        return QualityReport(4, 508, 50.0, 50.0, 0.0, agreeing / 508, 0.1)

    assert PREFILL_GATE.failures(report(508)) == []
    assert PREFILL_GATE.failures(report(506)) == [
        "top-1 agreement 99.61% (95% lower bound 98.58% of 508) < 99%"
    ]
    assert QualityGate(min_top1_agreement=0.99).failures(report(506)) == []  # the measured share alone


def test_gate_falls_back_and_logs_why(caplog):
    measured = []
    reports = {
        "fbgemm-u8": _report(0.0387, 0.853),
        "bf16-dequantized": _report(0.02, 0.99),
        "fp32-dequantized": _report(0.0002, 0.978),
    }

    def measure(path):
        measured.append(path.name)
        return reports[path.name]

    with caplog.at_level(logging.WARNING, logger="ragspeed.engine.native.core.quality_gate"):
        outcome = gate_prefill(prefill_candidates(VNNI, PROBE), measure)
    assert outcome.path.name == "fp32-dequantized"
    assert measured == ["fbgemm-u8", "bf16-dequantized", "fp32-dequantized"]
    assert outcome.rejected == {
        "fbgemm-u8": "perplexity +3.87% > +1%; top-1 agreement 85.30% < 97%",
        "bf16-dequantized": "perplexity +2.00% > +1%",
    }
    assert caplog.messages == [
        (
            "prefill path fbgemm-u8 fails the quality gate (perplexity +3.87% > +1%; top-1 "
            "agreement 85.30% < 97%): falling back to bf16-dequantized"
        ),
        "prefill path bf16-dequantized fails the quality gate (perplexity +2.00% > +1%): falling back to fp32-dequantized",
    ]


def test_gate_passes_first_path_or_none():
    first = gate_prefill(prefill_candidates(VNNI, PROBE), lambda path: _report(0.005, 0.98))
    assert first.path.name == "fbgemm-u8" and list(first.reports) == ["fbgemm-u8"]
    none = gate_prefill(prefill_candidates(AVX2, PROBE), lambda path: _report(0.0, 0.96))
    assert none.path is None
    assert none.rejected == {"fp32-dequantized": "top-1 agreement 96.00% < 97%"}
    assert QualityGate(max_ppl_increase=0.02).failures(_report(0.015, 0.99)) == []
    with pytest.raises(ValueError, match="at least one candidate"):
        gate_prefill([], lambda path: _report(0.0, 1.0))


@pytest.mark.parametrize(
    "features, line",
    [
        (
            AVX2,
            (
                "int8 on AMD EPYC (torch AVX2): avx2; no avx512f, avx512_vnni, avx_vnni, "
                "avx512_bf16, amx_bf16, amx_int8: prefill fp32-dequantized (activations kept in "
                "fp32), decode ragspeed's blocked int8 kernel; not fbgemm-u8: no VNNI (avx512_vnni "
                "/ avx_vnni): fbgemm's AVX2 kernel saturates; bf16-dequantized: no AMX-BF16 or "
                "AVX512-BF16 (amx_bf16 / avx512_bf16): bf16 products run ~30x slower than fp32"
            ),
        ),
        (
            VNNI,
            (
                "int8 on Intel Xeon (torch AVX512): avx2, avx512f, avx512_vnni, avx512_bf16; no "
                "avx_vnni, amx_bf16, amx_int8: prefill fp32-dequantized (activations kept in fp32), "
                "decode ragspeed's blocked int8 kernel; fbgemm-u8, bf16-dequantized runs here once "
                "the quality gate passes it"
            ),
        ),
    ],
)
def test_start_up_logs_the_choice(monkeypatch, caplog, features, line):
    monkeypatch.setattr(cpu_features, "read_cpu_features", lambda: features)
    with caplog.at_level(logging.INFO, logger="ragspeed.engine.native.compute.quant.registry"):
        check_quantization("int8", "cpu")
        check_quantization(None, "cpu")
    assert caplog.messages == [line]
    assert describe_choice(features) == line


def test_start_up_gate_on_a_tiny_model(caplog, tiny_checkpoints):
    """The start-up gate against the model's own exact-activation path, VNNI forced (int8 on
    dtype float32: bf16 not admitted): a strict gate rejects fbgemm-u8 (its activations are
    rounded) and the model falls back, logged; a lenient one keeps it; without VNNI only the
    attention's int16 products (under auto) are gated."""
    from ragspeed.engine.native.core.precision import choose_prefill, plan_prefill
    from ragspeed.engine.native.loading.loader import load_model

    loaded = load_model(tiny_checkpoints["llama"], quantization="int8", max_model_len=64)
    assert _paths(loaded) == {"fp32-dequantized"}  # loaded on the exact path
    windows = [list(range(3, 35)), list(range(40, 72))]
    plan = plan_prefill("float32", "int8", "cpu", VNNI, PROBE)
    assert [p.name for p in plan.candidates] == ["fbgemm-u8", "fp32-dequantized"]
    with caplog.at_level(logging.WARNING, logger="ragspeed.engine.native.core.quality_gate"):
        strict = choose_prefill(loaded, plan, lambda: windows, gate=QualityGate(0.0, 1.0))
        assert strict.path.name == "fp32-dequantized"  # nothing rounded matches exactly
        assert caplog.messages[0].startswith("prefill path fbgemm-u8 fails the quality gate (")
        assert caplog.messages[0].endswith("): falling back to fp32-dequantized")
        lenient = choose_prefill(loaded, plan, lambda: windows, gate=QualityGate(1e9, 0.0))
    assert lenient.path.name == "fbgemm-u8"
    assert _paths(loaded) == {"fbgemm-u8"}
    exact = choose_prefill(loaded, plan_prefill("auto", "int8", "cpu", AVX2, PROBE), lambda: windows)
    assert exact.path.name == "fp32-dequantized" and list(exact.reports) == ["int16-attention"]
    assert _paths(loaded) == {"fp32-dequantized"}


def test_bf16_dequantized_is_close_to_the_exact_path(monkeypatch):
    """bf16-dequantized (AMX/AVX512-BF16 forced; oneDNN or F.linear in bf16 on this CPU):
    the same int8 weight, activations rounded to bf16."""
    dense, int8 = _layers(monkeypatch, AMX, bias=True)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6))
    exact = int8(x)
    use_prefill_path(torch.nn.Sequential(int8), prefill_path("bf16-dequantized"))
    assert int8.kernel.path.name == "bf16-dequantized"
    out = int8(x)
    assert out.dtype == torch.float32
    assert 0 < _relative_error(out, exact) < 0.01
    if blocked_kernels_available(torch.device("cpu")):
        # the bf16 prefill layout and the fp32 bias, beside the blocked int8 copy (fp16 scales)
        assert int8.num_resident_bytes == 96 * 64 * 2 + 96 * 4 + (96 * 64 + 96 * 2 * 2 + 96 * 4)


def _paths(loaded):
    from ragspeed.engine.native.core.quality_gate import int8_kernels

    kernels = int8_kernels(loaded.model)
    assert kernels  # every projection and the LM head
    return {kernel.path.name for kernel in kernels}
