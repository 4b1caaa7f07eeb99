"""The model zoo: name resolution, bench models built small, the CLI. Never builds bench-0.5b."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from ragspeed.engine import model_zoo
from ragspeed.engine.cli import models_group
from ragspeed.engine.model_zoo import (
    ASSETS_DIR,
    BENCH_MODELS,
    ZOO,
    ZOO_NAMES,
    build_bench_model,
    list_models,
    resolve_model,
)

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_zoo_names():
    assert ZOO_NAMES == ("ragspeed-demo", "ragspeed-demo-draft", "bench-135m", "bench-0.5b")
    assert BENCH_MODELS["bench-135m"].vocab_size == 49152
    assert BENCH_MODELS["bench-0.5b"].num_key_value_heads == 2


def test_resolve_demo_local_path_and_hub_id(tmp_path):
    assert resolve_model("ragspeed-demo") == str(ASSETS_DIR / "ragspeed-demo")
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    with pytest.raises(ValueError, match="model"):
        resolve_model("")


@pytest.mark.parametrize(
    "name, architecture, has_qkv_bias",
    [("bench-135m", "LlamaForCausalLM", False), ("bench-0.5b", "Qwen2ForCausalLM", True)],
)
def test_build_tiny_bench_model_loads_offline(tmp_path, name, architecture, has_qkv_bias):
    out_dir = build_bench_model(name, tmp_path / name, overrides=TINY)
    assert out_dir == tmp_path / name
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "ragspeed_bench.json", "tokenizer.json", "tokenizer_config.json",
    ]
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == [architecture]
    assert config["vocab_size"] == BENCH_MODELS[name].vocab_size
    assert config["tie_word_embeddings"] is True
    assert not list(tmp_path.glob(".*"))  # no staging folder left behind

    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    demo_tokenizer = AutoTokenizer.from_pretrained(resolve_model("ragspeed-demo"))
    # transformers 5 forces Qwen2Tokenizer on a qwen2 config: same vocabulary and merges, Qwen's
    # pre-tokenizer (digits split one by one), and "<|endoftext|>" added as id 4096 (a zero row).
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    assert len(tokenizer) == 4096 + is_qwen2
    text = "Röntgen won the prize in 1901."
    assert (tokenizer(text).input_ids == demo_tokenizer(text).input_ids) != is_qwen2
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 0)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert (model.model.layers[0].self_attn.q_proj.bias is not None) == has_qkv_bias
    embeddings = model.get_input_embeddings().weight
    assert torch.count_nonzero(embeddings[4096:]) == 0
    assert 0.018 < embeddings[:4096].std().item() < 0.022

    prompt = tokenizer("The first Nobel Prize", return_tensors="pt").input_ids
    logits = model(prompt).logits
    assert torch.isfinite(logits).all()
    output = model.generate(prompt, max_new_tokens=8, do_sample=False)
    new_ids = output[0, prompt.shape[1]:].tolist()
    assert len(new_ids) == 8 and max(new_ids) < 4096  # greedy never picks an id the tokenizer lacks


def test_build_is_seeded(tmp_path):
    first = build_bench_model("bench-135m", tmp_path / "a", overrides=TINY)
    second = build_bench_model("bench-135m", tmp_path / "b", overrides=TINY)
    other_seed = build_bench_model("bench-135m", tmp_path / "c", overrides={**TINY, "seed": 1})
    weights = [(d / "model.safetensors").read_bytes() for d in (first, second, other_seed)]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]


def test_bad_names_and_overrides(tmp_path):
    with pytest.raises(ValueError, match="name: unknown bench model 'bench-9b'"):
        build_bench_model("bench-9b", tmp_path)
    with pytest.raises(ValueError, match=r"overrides: unknown fields \['hidden'\]"):
        build_bench_model("bench-135m", tmp_path, overrides={"hidden": 4})


def test_resolve_builds_bench_once_into_cache(tmp_path, monkeypatch):
    tiny = dataclasses.replace(BENCH_MODELS["bench-135m"], name="bench-tiny", **TINY)
    monkeypatch.setitem(ZOO, "bench-tiny", tiny)
    monkeypatch.setenv("RAGSPEED_CACHE_DIR", str(tmp_path / "cache"))
    path = resolve_model("bench-tiny")
    assert path == str(tmp_path / "cache" / "bench-tiny")
    stamp = os.stat(Path(path) / "model.safetensors").st_mtime_ns
    assert resolve_model("bench-tiny") == path
    assert os.stat(Path(path) / "model.safetensors").st_mtime_ns == stamp  # not rebuilt
    rows = {row["name"]: row for row in list_models(tmp_path / "cache")}
    assert rows["bench-tiny"]["available"] is True
    assert rows["bench-135m"]["available"] is False
    assert rows["ragspeed-demo"]["available"] is True


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("RAGSPEED_CACHE_DIR", raising=False)
    assert model_zoo.default_cache_dir() == Path.home() / ".cache" / "ragspeed" / "models"
    monkeypatch.setenv("RAGSPEED_CACHE_DIR", str(tmp_path))
    assert model_zoo.default_cache_dir() == tmp_path


def test_cli_list_and_bad_build(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGSPEED_CACHE_DIR", str(tmp_path))
    runner = CliRunner()
    result = runner.invoke(models_group, ["list", "--json"])
    assert result.exit_code == 0, result.output
    assert [row["name"] for row in json.loads(result.output)] == list(ZOO_NAMES)
    result = runner.invoke(models_group, ["build", "ragspeed-demo"])
    assert result.exit_code == 2
    assert "not a bench model" in result.output
