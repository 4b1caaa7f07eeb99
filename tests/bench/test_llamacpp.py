"""llama.cpp as a contender of bench engine (ragspeed.bench.llamacpp): its figures, the fastest
type, the targets, the GGUF files it runs on and their copies, the skip line. Runs without
llama-cpp-python; the last test runs it on the default model's GGUF where it is installed."""

from __future__ import annotations

import ctypes
import os
import sys
import types
from pathlib import Path

import gguf
import numpy as np
import pytest

from ragspeed.bench import llamacpp
from ragspeed.bench.common import median_gap
from ragspeed.engine.native.compute.cpu_features import CpuFeatures
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME, ZOO
from tests.engine.tiny_gguf import write_tiny_gguf
from tests.engine.tiny_models import build_tiny_checkpoint

ZEN3 = CpuFeatures("AMD EPYC", frozenset({"avx2"}), "AVX2")
XEON = CpuFeatures(
    "Intel Xeon",
    frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"}),
    "AVX512",
)
AVX512_BF16_ONLY = CpuFeatures("Intel Xeon", frozenset({"avx2", "avx512f", "avx512_bf16"}), "AVX512")


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("llamacpp")
    source = build_tiny_checkpoint("llama", root / "hf", seed=1)
    (root / "src").mkdir()
    return write_tiny_gguf(source, root / "src" / "tiny.gguf", "Q4_1")


def test_the_skip_line_names_the_install_command_when_llama_cpp_is_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    assert llamacpp.import_llama_cpp() is None
    reason = llamacpp.build_contenders(DEFAULT_MODEL_NAME, (), threads=2, n_ctx=2049, cpu=ZEN3)
    assert llamacpp.skip_line(reason) == (
        "llama.cpp: skipped (llama-cpp-python is not installed; install it with "
        "pip install 'ragspeed[llamacpp]'  (llama-cpp-python; compiles llama.cpp, about 10 minutes))"
    )


# -- the files it runs on ----------------------------------------------------------------------


def test_the_default_model_runs_on_the_wheels_gguf():
    path = llamacpp.model_gguf(DEFAULT_MODEL_NAME)
    assert path == ZOO[DEFAULT_MODEL_NAME].source_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_a_gguf_path_runs_on_itself_and_folders_or_hub_ids_on_nothing(tiny_q4_1):
    assert llamacpp.model_gguf(str(tiny_q4_1)) == tiny_q4_1.resolve()
    assert llamacpp.model_gguf(str(tiny_q4_1.parent)) is None
    assert llamacpp.model_gguf("Qwen/Qwen2.5-0.5B-Instruct") is None
    assert llamacpp.gguf_files("Qwen/Qwen2.5-0.5B-Instruct", (), ZEN3) == (
        "model 'Qwen/Qwen2.5-0.5B-Instruct' comes from no GGUF file; name one with --llamacpp-gguf PATH"
    )


def test_named_files_replace_the_models_and_must_be_gguf_files(tiny_q4_1, tmp_path):
    assert llamacpp.gguf_files(DEFAULT_MODEL_NAME, (str(tiny_q4_1),), ZEN3, tmp_path) == [tiny_q4_1]
    (tmp_path / "notes.txt").write_text("x")
    for bad in (tmp_path / "absent.gguf", tmp_path / "notes.txt"):
        with pytest.raises(ValueError) as error:
            llamacpp.gguf_files(DEFAULT_MODEL_NAME, (str(bad),), ZEN3, tmp_path)
        assert str(error.value) == f"--llamacpp-gguf {bad}: not a .gguf file"


def test_copies_by_cpu_bf16_only_where_the_cpu_has_it(tiny_q4_1, tmp_path):
    assert llamacpp.copy_types(ZEN3) == ("F16", "Q8_0")
    assert llamacpp.copy_types(AVX512_BF16_ONLY) == ("F16", "Q8_0", "BF16")
    files = llamacpp.gguf_files(str(tiny_q4_1), (), ZEN3, tmp_path)
    assert [llamacpp.gguf_type(f) for f in files] == ["Q4_1", "F16", "Q8_0"]
    files = llamacpp.gguf_files(str(tiny_q4_1), (), XEON, tmp_path)
    assert [llamacpp.gguf_type(f) for f in files] == ["Q4_1", "F16", "Q8_0", "BF16"]
    assert {f.parent for f in files[1:]} == {tmp_path / "llamacpp"}


@pytest.mark.parametrize("type_name, file_type, max_error", [("F16", 1, 2e-3), ("Q8_0", 7, 0.01)])
def test_a_copy_holds_the_sources_values_in_its_type(tiny_q4_1, tmp_path, type_name, file_type, max_error):
    copy = llamacpp.requantized_copy(tiny_q4_1, type_name, tmp_path)
    source, out = gguf.GGUFReader(tiny_q4_1), gguf.GGUFReader(copy)
    fields = {n: f.contents() for n, f in source.fields.items() if not n.startswith("GGUF.")}
    copied = {n: f.contents() for n, f in out.fields.items() if not n.startswith("GGUF.")}
    assert copied.pop("general.file_type") == file_type
    assert copied == fields  # the tiny source has no file_type of its own
    assert [t.name for t in out.tensors] == [t.name for t in source.tensors]
    for a, b in zip(source.tensors, out.tensors):
        expected = gguf.quants.dequantize(a.data, a.tensor_type)
        if len(a.shape) == 1:
            assert b.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(b.data, a.data)
            continue
        assert b.tensor_type.name == type_name and list(b.shape) == list(a.shape)
        assert np.abs(gguf.quants.dequantize(b.data, b.tensor_type) - expected).max() <= max_error


def test_a_gguf_without_an_architecture_is_refused_by_name(tmp_path):
    source = tmp_path / "no_arch.gguf"
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE)
    writer.add_tensor("weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="no_arch.gguf has no general.architecture field"):
        llamacpp.write_requantized(source, tmp_path / "out.gguf", "F16")


def test_a_copy_is_written_once_and_again_for_a_changed_source(tiny_q4_1, tmp_path):
    first = llamacpp.requantized_copy(tiny_q4_1, "F16", tmp_path)
    stamp = first.stat().st_mtime_ns
    assert llamacpp.requantized_copy(tiny_q4_1, "F16", tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging file left
    st = tiny_q4_1.stat()
    os.utime(tiny_q4_1, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        second = llamacpp.requantized_copy(tiny_q4_1, "F16", tmp_path)
    finally:
        os.utime(tiny_q4_1, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert second != first and second.name.endswith(".F16.gguf") and second.is_file()


def test_labels_are_types_and_a_repeated_type_is_numbered():
    kinds = {Path("a"): "Q4_1", Path("b"): "F16", Path("c"): "Q4_1", Path("d"): "Q4_1"}
    labels = llamacpp.type_labels(list(kinds), type_of=kinds.__getitem__)
    assert labels == {"q4_1": Path("a"), "f16": Path("b"), "q4_1_2": Path("c"), "q4_1_3": Path("d")}


# -- settings --------------------------------------------------------------------------------


def test_settings_turn_extra_buffer_types_off_only_where_the_cpu_has_amx():
    assert llamacpp.llama_settings(2, 2049, ZEN3) == llamacpp.LlamaCppSettings(
        threads=2, n_ctx=2049, n_batch=512, n_ubatch=512, flash_attn=True, use_extra_bufts=True
    )
    assert llamacpp.llama_settings(2, 2049, AVX512_BF16_ONLY).use_extra_bufts is True
    assert llamacpp.llama_settings(2, 2049, XEON).use_extra_bufts is False
    assert llamacpp.llama_settings(2, 2049, XEON).describe() == (
        "2 threads (batch too), n_ctx 2049, n_batch 512, n_ubatch 512, flash attention on, "
        "extra buffer types off"
    )


class _ModelParams(ctypes.Structure):
    _fields_ = [("n_gpu_layers", ctypes.c_int32), ("use_extra_bufts", ctypes.c_bool)]


def _fake_llama_cpp(params_type) -> types.SimpleNamespace:
    def defaults():
        return (
            params_type(n_gpu_layers=0, use_extra_bufts=True)
            if params_type is _ModelParams
            else params_type()
        )

    return types.SimpleNamespace(llama_cpp=types.SimpleNamespace(llama_model_default_params=defaults))


def test_extra_buffer_types_are_off_while_the_model_is_built_and_restored_after():
    module = _fake_llama_cpp(_ModelParams)
    original = module.llama_cpp.llama_model_default_params
    with llamacpp._model_params(module, use_extra_bufts=False):
        assert module.llama_cpp.llama_model_default_params().use_extra_bufts is False
    assert module.llama_cpp.llama_model_default_params is original
    with llamacpp._model_params(module, use_extra_bufts=True):
        assert module.llama_cpp.llama_model_default_params is original


def test_a_llama_cpp_without_the_field_is_left_alone():
    class Older(ctypes.Structure):
        _fields_ = [("n_gpu_layers", ctypes.c_int32)]

    module = _fake_llama_cpp(Older)
    original = module.llama_cpp.llama_model_default_params
    with llamacpp._model_params(module, use_extra_bufts=False):
        assert module.llama_cpp.llama_model_default_params is original


# -- figures ---------------------------------------------------------------------------------


def test_tpot_is_the_median_gap_between_tokens():
    assert median_gap([0.5, 0.7, 0.8, 1.0]) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="needs 2 or more tokens, got 1"):
        median_gap([0.5])


PER_TYPE = {
    "llamacpp_q4_1_tokens_per_s": 20.0,
    "llamacpp_q4_1_tpot_ms": 30.0,
    "llamacpp_q4_1_ttft_2048_ms": 17_000.0,
    "llamacpp_q4_1_tpot_2048_ms": 45.0,
    "llamacpp_f16_tokens_per_s": 18.0,
    "llamacpp_f16_tpot_ms": 38.0,
    "llamacpp_f16_ttft_2048_ms": 8_000.0,
    "llamacpp_f16_tpot_2048_ms": 50.0,
    "llamacpp_q8_0_tokens_per_s": 22.0,
    "llamacpp_q8_0_tpot_ms": 29.0,
    "llamacpp_q8_0_ttft_2048_ms": 9_000.0,
    "llamacpp_q8_0_tpot_2048_ms": 40.0,
}


def test_the_fastest_type_per_figure():
    assert llamacpp.fastest(PER_TYPE, ["q4_1", "f16", "q8_0"], 2048) == {
        "llamacpp_tokens_per_s": 22.0,
        "llamacpp_tokens_per_s_type": "q8_0",
        "llamacpp_tpot_ms": 29.0,
        "llamacpp_tpot_ms_type": "q8_0",
        "llamacpp_ttft_2048_ms": 8_000.0,
        "llamacpp_ttft_2048_ms_type": "f16",
        "llamacpp_tpot_2048_ms": 40.0,
        "llamacpp_tpot_2048_ms_type": "q8_0",
    }
    with pytest.raises(ValueError, match="no llama.cpp types measured"):
        llamacpp.fastest(PER_TYPE, [], 2048)


NATIVE = {"native_tokens_per_s": 110.0, "tpot_ms": 14.5, "ttft_2048_ms": 1_000.0, "tpot_2048_ms": 20.0}


class _Measured:
    version = "0.3.36"
    settings = llamacpp.LlamaCppSettings(threads=2, n_ctx=2049)

    def __init__(self, path: str):
        self.path = Path(path)


def test_the_summary_gives_the_fastest_types_and_the_ratios_to_native():
    contenders = {label: _Measured(f"/m/{label}.gguf") for label in ("q4_1", "f16", "q8_0")}
    results = {**NATIVE, **PER_TYPE}
    summary = llamacpp.summary(results, contenders, 4, 2048)
    assert summary["llamacpp_version"] == "0.3.36"
    assert summary["llamacpp_requests"] == 4
    assert summary["llamacpp_f16_file"] == "/m/f16.gguf"
    assert summary["llamacpp_ttft_2048_ms_type"] == "f16"
    assert summary["llamacpp_throughput_ratio"] == pytest.approx(5.0)  # 110 / 22
    assert summary["llamacpp_tpot_ratio"] == pytest.approx(0.5)  # 14.5 / 29
    assert summary["llamacpp_ttft_speedup"] == pytest.approx(8.0)  # 8,000 / 1,000
    assert summary["llamacpp_tpot_2048_ratio"] == pytest.approx(0.5)  # 20 / 40


def test_the_printed_block_sets_each_type_beside_native_and_the_target():
    contenders = {label: _Measured(f"/m/{label}.gguf") for label in ("q4_1", "f16", "q8_0")}
    results = {**NATIVE, **PER_TYPE, "tpot_ms": 20.3}
    results.update(llamacpp.summary(results, contenders, 4, 2048))
    lines: list[str] = []
    llamacpp.print_comparison(results, list(contenders), 2048, echo=lines.append)
    assert lines == [
        "llama.cpp 0.3.36 (2 threads (batch too), n_ctx 2049, n_batch 512, n_ubatch 512, flash attention "
        "on, extra buffer types on), per type:",
        "figure                      q4_1       f16      q8_0    native   ratio   target  met",
        "throughput (tok/s)          20.0      18.0      22.0     110.0   5.00x    >= 3x  yes (best q8_0)",
        "TPOT batch 1 (ms)           30.0      38.0      29.0      20.3   0.70x  <= 0.4x  no (best q8_0)",
        "TTFT 2048 (ms)          17,000.0   8,000.0   9,000.0   1,000.0   8.00x        -  - (best f16)",
        "TPOT after 2048 (ms)        45.0      50.0      40.0      20.0   0.50x  <= 0.4x  no (best q8_0)",
        "ratio: native/llama.cpp's fastest type for throughput and TPOT; llama.cpp/native for TTFT",
    ]


# -- the real thing --------------------------------------------------------------------------


@pytest.mark.skipif(llamacpp.import_llama_cpp() is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_runs_on_the_default_models_gguf():
    module = llamacpp.import_llama_cpp()
    path = llamacpp.model_gguf(DEFAULT_MODEL_NAME)
    settings = llamacpp.LlamaCppSettings(threads=2, n_ctx=64)
    contender = llamacpp.LlamaCppContender(module, path, settings)
    prompt = tuple(range(100, 116))
    arrivals = contender._generate(prompt, 4)
    assert len(arrivals) == 4 and arrivals == sorted(arrivals) and arrivals[0] > 0
    tokens = []
    contender.llm.reset()
    for token in contender.llm.generate(list(prompt), temp=0.0, reset=True):
        tokens.append(token)
        if len(tokens) == 4:
            break
    contender.llm.reset()
    again = []
    for token in contender.llm.generate(list(prompt), temp=0.0, reset=True):
        again.append(token)
        if len(again) == 4:
            break
    assert tokens == again  # greedy: the same prompt gives the same tokens
    assert contender.ttft(prompt) > 0 and contender.tpot(prompt, 3) > 0
    assert contender.throughput([prompt, prompt[:8]], 2) > 0
