"""The synchronous engine: sampling, stops, bad input, prefix caching, abort, loading."""

from __future__ import annotations

import json

import pytest
import torch

from ragspeed.engine.native.core.kv_cache import PoolTooSmallError
from ragspeed.engine.native.loading.loader import UnsupportedModelError, load_model
from ragspeed.engine.protocol import EngineError, GenerationRequest, PromptTooLongError, SamplingParams
from tests.engine.conftest import assert_all_blocks_free, hf_greedy, make_engine
from tests.engine.tiny_models import build_tiny_checkpoint

PROMPT = tuple(range(10, 50))


@pytest.fixture(scope="module")
def llama_engine(tiny_checkpoints):
    return make_engine(tiny_checkpoints["llama"])


def test_seeded_sampling_gives_the_same_text_twice(llama_engine):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    first = llama_engine.generate([GenerationRequest("s1", PROMPT, params)])["s1"]
    second = llama_engine.generate([GenerationRequest("s2", PROMPT, params)])["s2"]
    other = llama_engine.generate(
        [GenerationRequest("s3", PROMPT, SamplingParams(**{**params.__dict__, "seed": 8}))]
    )["s3"]
    assert first["text"] == second["text"] and first["token_ids"] == second["token_ids"]
    assert other["token_ids"] != first["token_ids"]
    assert_all_blocks_free(llama_engine)


def test_stop_token_ids_and_eos(llama_engine):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = llama_engine.generate([GenerationRequest("g", PROMPT, greedy)])["g"]["token_ids"]
    stop_at = ids[4]
    cut = ids.index(stop_at)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,))
    out = llama_engine.generate([GenerationRequest("st", PROMPT, params)])["st"]
    assert out["token_ids"] == ids[: cut + 1]
    assert out["finish_reason"] == "stop"
    # the stop token's text is not in the output
    assert out["text"] == llama_engine.tokenizer.decode(ids[:cut], skip_special_tokens=True)
    assert_all_blocks_free(llama_engine)


def test_stop_string_ends_generation_and_is_excluded(llama_engine):
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    full = llama_engine.generate([GenerationRequest("f", PROMPT, greedy)])["f"]["text"]
    stop = full[5:8]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop,))
    out = llama_engine.generate([GenerationRequest("ss", PROMPT, params)])["ss"]
    assert out["text"] == full[: full.index(stop)]
    assert out["finish_reason"] == "stop"
    assert_all_blocks_free(llama_engine)


def test_prompt_plus_max_tokens_over_the_context_is_refused(llama_engine):
    with pytest.raises(PromptTooLongError) as err:
        llama_engine.add_request(
            GenerationRequest("long", tuple(range(2, 252)), SamplingParams(max_tokens=10))
        )
    assert err.value.param == "max_tokens"
    assert err.value.code == "context_length_exceeded"
    assert err.value.message == (
        "prompt (250 tokens) plus max_tokens (10) exceeds the model's context of 256 tokens"
    )
    with pytest.raises(PromptTooLongError) as err:
        llama_engine.add_request(GenerationRequest("longer", (5,) * 300, SamplingParams()))
    assert err.value.param == "messages"
    assert not llama_engine.has_unfinished()


@pytest.mark.parametrize(
    "params, name",
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(min_p=2.0), "min_p"),
        (SamplingParams(stop_token_ids=(100_000,)), "stop_token_ids"),
    ],
)
def test_bad_sampling_parameters_name_the_parameter(llama_engine, params, name):
    with pytest.raises(EngineError) as err:
        llama_engine.add_request(GenerationRequest("bad", PROMPT, params))
    assert err.value.param == name


def test_abort_frees_blocks_at_once(llama_engine):
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    llama_engine.add_request(GenerationRequest("ab", PROMPT, params))
    llama_engine.step()
    llama_engine.step()
    assert llama_engine.stats()["num_blocks_used"] == 6  # 42 tokens in blocks of 8
    out = llama_engine.abort("ab")
    assert out.delta.finish_reason == "abort"
    assert llama_engine.abort("unknown") is None
    assert_all_blocks_free(llama_engine)


def test_prefix_cache_hit_gives_the_same_tokens(tiny_checkpoints, hf_models):
    engine = make_engine(tiny_checkpoints["qwen3"])
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = engine.generate([GenerationRequest("p1", PROMPT, params)])["p1"]
    second = engine.generate([GenerationRequest("p2", PROMPT, params)])["p2"]
    salted = engine.generate([GenerationRequest("p3", PROMPT, params, cache_salt="tenant")])["p3"]
    assert (first["num_cached_tokens"], second["num_cached_tokens"]) == (0, 32)
    assert salted["num_cached_tokens"] == 0
    assert first["token_ids"] == second["token_ids"] == hf_greedy(hf_models["qwen3"], list(PROMPT), 10)
    stats = engine.stats()
    assert (stats["prefix_cache_queries_tokens"], stats["prefix_cache_hits_tokens"]) == (120, 32)
    assert_all_blocks_free(engine)

    uncached = make_engine(tiny_checkpoints["qwen3"], enable_prefix_caching=False)
    uncached.generate([GenerationRequest("u1", PROMPT, params)])
    again = uncached.generate([GenerationRequest("u2", PROMPT, params)])["u2"]
    assert again["num_cached_tokens"] == 0 and again["token_ids"] == first["token_ids"]


def test_pool_too_small_for_one_request_is_a_startup_error(tiny_checkpoints):
    with pytest.raises(PoolTooSmallError) as err:
        make_engine(tiny_checkpoints["llama"], num_kv_cache_tokens=100, max_model_len=256)
    message = str(err.value)
    assert "12 blocks of 8 tokens (96 tokens)" in message
    assert "max_model_len=256" in message and "needs 32 blocks" in message


def test_unsupported_family_names_the_supported_ones(tmp_path, tiny_checkpoints):
    path = tmp_path / "gpt2ish"
    path.mkdir()
    config = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as err:
        load_model(path)
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert name in str(err.value)


def test_sharded_bf16_checkpoint_with_llama3_rope_loads_and_computes_in_fp32(tmp_path):
    from transformers import AutoModelForCausalLM

    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    path = build_tiny_checkpoint("llama", tmp_path / "src", seed=5, rope_parameters=rope)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((path / name).read_bytes())
    assert len(list(sharded.glob("*.safetensors"))) > 1
    engine = make_engine(sharded, dtype="float32")
    assert engine.loaded.model.embed_tokens.dtype == torch.float32
    reference = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 103))  # past the original 64 positions: the scaling matters
    out = engine.generate([GenerationRequest("b", tuple(prompt), params)])["b"]
    assert out["token_ids"] == hf_greedy(reference, prompt, 16)
    assert_all_blocks_free(engine)
