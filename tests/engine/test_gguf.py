"""GGUF conversion on tiny files written in the session (tests/engine/tiny_gguf.py): weights
against the source and against transformers' own GGUF loading, greedy output of the native engine
against transformers, the tokenizer and config from the metadata, bad files, and the cache."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from ragspeed import environment
from ragspeed.engine.native.loading import gguf as gguf_module
from ragspeed.engine.native.loading.gguf import MANIFEST_NAME, GgufError, converted_copy, gguf_cache_dir
from ragspeed.engine.native.loading.model_zoo import resolve_model
from ragspeed.engine.protocol import GenerationRequest, SamplingParams
from tests.engine.conftest import hf_greedy, make_engine
from tests.engine.tiny_gguf import CHAT_TEMPLATE, write_tiny_gguf
from tests.engine.tiny_models import TOKENIZER_TEXT, build_tiny_checkpoint

# The types gguf.quants.quantize writes, so the weights come from a real checkpoint.
WRITABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# Largest |converted - source| of the tiny llama's quantized matrices (init std 0.2, |w| < 1.1).
MAX_ERROR = {"Q8_0": 0.005, "Q4_0": 0.08, "Q4_1": 0.06}
STORED_DTYPE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
PROMPT = [5, 17, 42, 99, 7, 230, 11, 64]


def transformers_gguf_state(gguf_path: Path) -> dict[str, torch.Tensor]:
    """transformers' own reading of the file (its names, dequantization and Q/K un-permutation)."""
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.state_dict()


@pytest.fixture(scope="module", params=WRITABLE_TYPES)
def llama_copy(request, tiny_checkpoints, tmp_path_factory):
    """(type, source folder, GGUF file, converted folder) for the tiny llama in one type."""
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    source = tiny_checkpoints["llama"]
    path = write_tiny_gguf(source, root / f"tiny-{request.param}.gguf", request.param)
    return request.param, source, path, converted_copy(path, root / "converted")


def test_weights_match_the_source_and_transformers_gguf_loading(llama_copy):
    qtype, source, path, converted = llama_copy
    original = load_file(str(source / "model.safetensors"))
    weights = load_file(str(converted / "model.safetensors"))
    assert sorted(weights) == sorted(original)  # untied llama: lm_head.weight included
    reference = transformers_gguf_state(path)
    for name, weight in weights.items():
        assert torch.equal(weight.float(), reference[name]), name
        if weight.ndim == 1:  # norms stay F32
            assert weight.dtype == torch.float32 and torch.equal(weight, original[name]), name
        elif qtype in STORED_DTYPE:
            assert weight.dtype == STORED_DTYPE[qtype], name
            assert torch.equal(weight, original[name].to(weight.dtype)), name
        else:
            assert weight.dtype == torch.float32, name
    if qtype not in STORED_DTYPE:  # quantized: lossy, within the type's step
        error = max((w - original[n]).abs().max().item() for n, w in weights.items() if w.ndim == 2)
        assert 0 < error <= MAX_ERROR[qtype]


def test_native_greedy_from_the_gguf_equals_transformers_on_the_copy(llama_copy, monkeypatch, tmp_path):
    _, _, path, converted = llama_copy
    monkeypatch.setenv("RAGSPEED_CACHE_DIR", str(tmp_path))
    environment.configure()
    engine = make_engine(path)  # --model file.gguf: converted again, into this test's cache
    assert engine.loaded.path == gguf_cache_dir(path, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    expected = hf_greedy(model, PROMPT, 12)
    request = GenerationRequest(
        "r", tuple(PROMPT), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert engine.generate([request])["r"]["token_ids"] == expected


def test_config_tokenizer_and_chat_template_from_the_metadata(llama_copy, tiny_checkpoints):
    _, source, _, converted = llama_copy
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {
        k: config[k]
        for k in (
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
        )
    } == {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 384,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert (converted / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    original = AutoTokenizer.from_pretrained(str(source))
    for text in TOKENIZER_TEXT + ["<s>two specials</s>"]:
        assert tokenizer(text).input_ids == original(text).input_ids, text
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.model_max_length) == ("<s>", "</s>", 512)
    assert (
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        == "<s>user: hi</s>"
    )


def test_qwen2_tied_with_biases(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints["qwen2"]
    path = write_tiny_gguf(source, tmp_path / "qwen2.gguf", "Q8_0", architecture="qwen2")
    converted = converted_copy(path, tmp_path / "converted")
    config = json.loads((converted / "config.json").read_text())
    assert (config["architectures"], config["tie_word_embeddings"]) == (["Qwen2ForCausalLM"], True)
    weights = load_file(str(converted / "model.safetensors"))
    assert "lm_head.weight" not in weights and "model.layers.1.self_attn.k_proj.bias" in weights
    reference = transformers_gguf_state(path)
    assert all(torch.equal(w, reference[n]) for n, w in weights.items())
    model = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    request = GenerationRequest(
        "r", tuple(PROMPT), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert make_engine(converted).generate([request])["r"]["token_ids"] == hf_greedy(model, PROMPT, 12)


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> Path:
    """In-features of 256, a whole K-quant block."""
    return build_tiny_checkpoint(
        "llama", tmp_path_factory.mktemp("wide") / "hf", seed=5, hidden_size=256, intermediate_size=256
    )


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_dequantize_as_gguf_and_transformers(wide_llama, tmp_path, qtype):
    """gguf cannot write K-quants: the matrices are random valid blocks; the copy holds exactly
    what gguf.quants.dequantize makes of them, in transformers' Q/K row order."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = write_tiny_gguf(wide_llama, tmp_path / f"{qtype}.gguf", qtype, k_quant_seed=11)
    weights = load_file(str(converted_copy(path, tmp_path / "converted") / "model.safetensors"))
    reference = transformers_gguf_state(path)
    assert all(torch.equal(w, reference[n]) for n, w in weights.items())
    reader = GGUFReader(path)
    v_proj = next(t for t in reader.tensors if t.name == "blk.1.attn_v.weight")
    assert v_proj.tensor_type.name == qtype
    assert torch.equal(
        weights["model.layers.1.self_attn.v_proj.weight"],
        torch.from_numpy(dequantize(v_proj.data, v_proj.tensor_type)),
    )
    assert all(torch.isfinite(w).all() for w in weights.values())


# -- bad input -------------------------------------------------------------------------------


def test_another_architecture_is_named(tiny_checkpoints, tmp_path):
    path = write_tiny_gguf(tiny_checkpoints["llama"], tmp_path / "gemma.gguf", architecture="gemma")
    with pytest.raises(GgufError) as error:
        resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert str(error.value) == f"{path}: GGUF architecture 'gemma' is not supported; supported: llama, qwen2"
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_a_type_without_dequantizer_is_named(wide_llama, tmp_path):
    path = write_tiny_gguf(wide_llama, tmp_path / "q8k.gguf", "Q8_K", k_quant_seed=3)
    with pytest.raises(GgufError) as error:
        converted_copy(path, tmp_path / "converted")
    # The first tensor of that type in the file (safetensors order: lm_head first).
    assert (
        str(error.value)
        == f"{path}: tensor output.weight has quantization type Q8_K, which the gguf package cannot dequantize"
    )


def test_a_truncated_file_is_named(tiny_checkpoints, tmp_path):
    path = write_tiny_gguf(tiny_checkpoints["llama"], tmp_path / "tiny.gguf")
    data = path.read_bytes()
    for keep in (len(data) - 1000, 2000):  # inside the tensor data; inside the metadata
        path.write_bytes(data[:keep])
        with pytest.raises(GgufError, match=rf"^{re.escape(str(path))} is truncated"):
            converted_copy(path, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


def test_a_file_without_tokenizer_is_named(tiny_checkpoints, tmp_path):
    path = write_tiny_gguf(tiny_checkpoints["llama"], tmp_path / "bare.gguf", with_tokenizer=False)
    with pytest.raises(GgufError) as error:
        converted_copy(path, tmp_path / "converted")
    assert (
        str(error.value)
        == f"{path}: no tokenizer in the metadata (missing tokenizer.ggml.model, tokenizer.ggml.tokens)"
    )


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello")
    with pytest.raises(
        GgufError, match=r"notes.gguf is not a GGUF file \(it starts with b'hell', not b'GGUF'\)"
    ):
        resolve_model(str(path), cache_dir=tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="is a file, not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"), cache_dir=tmp_path)


# -- the cache -------------------------------------------------------------------------------


@pytest.fixture
def tiny_gguf(tiny_checkpoints, tmp_path) -> Path:
    (tmp_path / "src").mkdir()
    return write_tiny_gguf(tiny_checkpoints["llama"], tmp_path / "src" / "tiny.gguf", "Q8_0")


def _stamp(folder: Path) -> int:
    return os.stat(folder / "model.safetensors").st_mtime_ns


def test_converted_once_then_reused(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    folder = Path(resolve_model(str(tiny_gguf), cache_dir=cache))
    assert folder == gguf_cache_dir(tiny_gguf, cache) and folder.parent == cache / "gguf"
    assert folder.name.startswith("tiny-")
    assert sorted(p.name for p in folder.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        MANIFEST_NAME,
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["source"]["path"] == str(tiny_gguf.resolve())
    assert manifest["source"]["size"] == tiny_gguf.stat().st_size
    assert manifest["tensor_types"] == {"F32": 5, "Q8_0": 16}
    stamp = _stamp(folder)
    assert resolve_model(str(tiny_gguf), cache_dir=cache) == str(folder)
    assert _stamp(folder) == stamp  # not rebuilt
    os.utime(tiny_gguf, ns=(1, 1))  # new mtime, same bytes (a reinstalled wheel)
    assert converted_copy(tiny_gguf, folder) == folder and _stamp(folder) == stamp
    assert json.loads((folder / MANIFEST_NAME).read_text())["source"]["mtime_ns"] == 1
    assert not list(cache.rglob(".*"))  # no staging folder or manifest draft left


def test_the_same_bytes_at_another_path_are_recorded_there(tiny_gguf, tmp_path):
    """One cached copy for a zoo name, checked against the wheel of whichever environment runs:
    when the old environment is deleted, the blocks are read from the new one's file."""
    folder = converted_copy(tiny_gguf, tmp_path / "copy")
    stamp = _stamp(folder)
    moved = tmp_path / "other-env" / "tiny.gguf"
    moved.parent.mkdir()
    shutil.copy2(tiny_gguf, moved)
    tiny_gguf.unlink()
    assert converted_copy(moved, folder) == folder and _stamp(folder) == stamp  # not rebuilt
    assert gguf_module.source_of(folder) == moved.resolve()


def test_a_changed_source_is_reconverted(tiny_checkpoints, tiny_gguf, tmp_path):
    folder = converted_copy(tiny_gguf, tmp_path / "copy")
    first = load_file(str(folder / "model.safetensors"))["model.norm.weight"]
    # Same shapes, types and header, other weights: only the bytes tell.
    other = build_tiny_checkpoint("llama", tmp_path / "other", seed=9)
    write_tiny_gguf(other, tiny_gguf, "Q8_0")
    os.utime(tiny_gguf, ns=(2, 2))  # a new mtime, whatever the clock's resolution
    assert gguf_module.copy_problem(tiny_gguf, folder) == "source bytes changed"
    converted_copy(tiny_gguf, folder)
    second = load_file(str(folder / "model.safetensors"))["model.norm.weight"]
    assert torch.equal(second, load_file(str(other / "model.safetensors"))["model.norm.weight"])
    assert not torch.equal(first, second)
    write_tiny_gguf(other, tiny_gguf, "F16")
    os.utime(tiny_gguf, ns=(3, 3))
    assert gguf_module.copy_problem(tiny_gguf, folder).startswith("source size")
    converted_copy(tiny_gguf, folder)
    assert (
        load_file(str(folder / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"].dtype
        == torch.float16
    )
    assert not list(tmp_path.glob(".*"))


@pytest.mark.parametrize(
    "damage, problem",
    [
        ("truncate model.safetensors", "model.safetensors has 1,000 bytes, written with"),
        ("delete tokenizer.json", "tokenizer.json is missing"),
        ("garble manifest", "unreadable manifest"),
        ("delete manifest", "no converted copy"),
        ("old converter", "converter version 0, now 1"),
    ],
)
def test_a_damaged_copy_is_rebuilt(tiny_gguf, tmp_path, damage, problem):
    folder = converted_copy(tiny_gguf, tmp_path / "copy")
    expected = (folder / "model.safetensors").read_bytes()
    manifest = folder / MANIFEST_NAME
    if damage == "truncate model.safetensors":
        with (folder / "model.safetensors").open("r+b") as f:
            f.truncate(1000)
    elif damage == "delete tokenizer.json":
        (folder / "tokenizer.json").unlink()
    elif damage == "garble manifest":
        manifest.write_text("{not json")
    elif damage == "delete manifest":
        manifest.unlink()
    else:
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "converter_version": 0}))
    assert gguf_module.copy_problem(tiny_gguf, folder).startswith(problem)
    assert converted_copy(tiny_gguf, folder) == folder
    assert gguf_module.copy_problem(tiny_gguf, folder) is None
    assert (folder / "model.safetensors").read_bytes() == expected
    assert (folder / "tokenizer.json").is_file()


def test_a_failed_conversion_leaves_the_old_copy_and_no_staging(tiny_gguf, tmp_path):
    folder = converted_copy(tiny_gguf, tmp_path / "copy")
    (folder / "tokenizer.json").unlink()  # damaged, so a rebuild is attempted ...
    tiny_gguf.write_bytes(tiny_gguf.read_bytes()[:3000])  # ... from a source now truncated
    with pytest.raises(GgufError, match="truncated"):
        converted_copy(tiny_gguf, folder)
    assert (folder / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "src"]


def test_unpermute_inverts_llama_cpp_interleaving():
    from tests.engine.tiny_gguf import interleave_rotary_rows

    rows = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of head_dim 8
    interleaved = interleave_rotary_rows(rows, 2)
    assert interleaved[:8, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]  # rows 0,4,1,5,2,6,3,7
    back = gguf_module.unpermute_rotary_rows(torch.from_numpy(interleaved), 2)
    assert torch.equal(back, torch.from_numpy(rows))
