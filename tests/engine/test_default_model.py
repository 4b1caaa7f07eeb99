"""The real default model through the native engine: its config and tokenizer from the GGUF
metadata, and greedy output equal to transformers' on the same converted copy."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME, ZOO
from ragspeed.engine.protocol import GenerationRequest, SamplingParams
from tests.engine.conftest import hf_greedy, make_engine
from tests.real_model import NOBEL_DOCUMENT, NOBEL_MESSAGES, default_model_cache


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    return default_model_cache(tmp_path_factory) / DEFAULT_MODEL_NAME


def nobel_prompt(tokenizer) -> list[int]:
    messages = [
        NOBEL_MESSAGES[0],
        {"role": "user", "content": f"{NOBEL_DOCUMENT}\n\n{NOBEL_MESSAGES[1]['content']}"},
    ]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


def test_config_and_tokenizer_from_the_metadata(default_model):
    config = json.loads((default_model / "config.json").read_text())
    assert {
        k: config[k]
        for k in (
            "architectures",
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
            "rope_parameters",
        )
    } == {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    }
    manifest = json.loads((default_model / "ragspeed_gguf.json").read_text())
    assert manifest["tensor_types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    assert manifest["source"]["path"] == str(ZOO[DEFAULT_MODEL_NAME].source_file().resolve())
    tokenizer = AutoTokenizer.from_pretrained(str(default_model))
    assert len(tokenizer) == 49152
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.eos_token_id) == (
        "<|im_start|>",
        "<|im_end|>",
        2,
    )
    assert tokenizer("<|im_start|>user\nHi<|im_end|>").input_ids == [1, 4093, 198, 26843, 2]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_native_greedy_equals_transformers_and_names_roentgen(default_model):
    tokenizer = AutoTokenizer.from_pretrained(str(default_model))
    prompt = nobel_prompt(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(str(default_model), dtype=torch.float32).eval()
    expected = hf_greedy(model, prompt, 24)
    engine = make_engine(default_model, max_model_len=512)
    request = GenerationRequest(
        "r", tuple(prompt), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )
    result = engine.generate([request])["r"]
    assert result["token_ids"] == expected
    assert "Wilhelm Conrad Röntgen" in result["text"]


@pytest.mark.slow
def test_the_copy_equals_transformers_gguf_loading_of_the_wheel(default_model):
    """transformers' own reading of the 98 MB file (about 30 s): every tensor equal."""
    from safetensors.torch import load_file

    source = ZOO[DEFAULT_MODEL_NAME].source_file()
    reference = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    )
    state = reference.state_dict()
    weights = load_file(str(default_model / "model.safetensors"))
    assert sorted(weights) == sorted(k for k in state if k != "lm_head.weight")
    assert all(torch.equal(w, state[n]) for n, w in weights.items())


def test_the_shipped_rag_adapter_merges_into_the_default_model(default_model):
    """The RAG model: the default model's weights plus the shipped adapter, nothing else changed."""
    from safetensors import safe_open

    from ragspeed.engine.native.loading.adapter import read_adapter
    from ragspeed.engine.native.loading.model_zoo import RAG_MODEL_NAME, resolve_model

    merged = resolve_model(RAG_MODEL_NAME, cache_dir=default_model.parent)
    pairs, scale = read_adapter(ZOO[RAG_MODEL_NAME].adapter)
    assert len(pairs) == 30 * 7
    with (
        safe_open(str(default_model / "model.safetensors"), framework="pt") as base,
        safe_open(f"{merged}/model.safetensors", framework="pt") as adapted,
    ):
        assert set(base.keys()) == set(adapted.keys())
        name = "model.layers.3.self_attn.q_proj.weight"
        a, b = pairs[name]
        expected = base.get_tensor(name) + scale * (b.float() @ a.float())
        assert torch.allclose(adapted.get_tensor(name), expected, atol=1e-6)
        assert torch.equal(adapted.get_tensor("model.norm.weight"), base.get_tensor("model.norm.weight"))
    assert json.loads(open(f"{merged}/config.json").read()) == json.loads(
        (default_model / "config.json").read_text()
    )
