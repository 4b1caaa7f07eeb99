"""The vLLM backend: the config mapping everywhere, the engine only where vllm is installed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from ragspeed.engine.backends.vllm import (
    VLLMEngine,
    vllm_available,
    vllm_engine_args,
    vllm_sampling_kwargs,
    vllm_token_logprobs,
)
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.protocol import GenerationRequest, SamplingParams, TokenLogprob


def test_engine_args_map_the_native_config():
    config = EngineConfig(
        backend="vllm",
        model="m",
        dtype="bfloat16",
        block_size=32,
        num_kv_cache_tokens=65536,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
        max_model_len=8192,
        seed=3,
    )
    assert vllm_engine_args(config, "/models/m") == {
        "model": "/models/m",
        "tokenizer": "/models/m",
        "dtype": "bfloat16",
        "seed": 3,
        "block_size": 32,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": True,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 4096,
        "max_model_len": 8192,
        "num_gpu_blocks_override": 2048,
    }


def test_quantization_and_speculative_decoding_are_mapped():
    ngram = vllm_engine_args(
        EngineConfig(quantization="int8", speculative="ngram", num_speculative_tokens=3), "p"
    )
    assert ngram["quantization"] == "fp8"
    assert ngram["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    draft = vllm_engine_args(EngineConfig(speculative="draft", draft_model="d"), "p")
    assert draft["speculative_config"] == {"model": "d", "num_speculative_tokens": 4}
    int8_draft = vllm_engine_args(
        EngineConfig(speculative="draft", draft_model="d", draft_quantization="int8"), "p"
    )
    assert int8_draft["speculative_config"]["quantization"] == "fp8"
    with pytest.raises(ValueError, match="draft_quantization 'int4'"):
        vllm_engine_args(EngineConfig(speculative="draft", draft_model="d", draft_quantization="int4"), "p")
    assert "quantization" not in draft and "max_model_len" not in draft
    with pytest.raises(ValueError, match="draft_model"):
        vllm_engine_args(EngineConfig(speculative="draft"), "p")
    with pytest.raises(ValueError, match="quantization 'int4'"):
        vllm_engine_args(EngineConfig(quantization="int4"), "p")


def test_sampling_params_are_mapped():
    params = SamplingParams(
        max_tokens=5,
        temperature=0.7,
        top_p=0.9,
        top_k=0,
        min_p=0.05,
        seed=1,
        stop=("\n\n",),
        stop_token_ids=(2,),
        ignore_eos=True,
    )
    assert vllm_sampling_kwargs(params) == {
        "n": 1,
        "max_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.05,
        "seed": 1,
        "stop": ["\n\n"],
        "stop_token_ids": [2],
        "ignore_eos": True,
    }


def test_logprobs_are_mapped_only_when_asked():
    assert "logprobs" not in vllm_sampling_kwargs(SamplingParams())
    assert vllm_sampling_kwargs(SamplingParams(logprobs=0))["logprobs"] == 0
    assert vllm_sampling_kwargs(SamplingParams(logprobs=5))["logprobs"] == 5


def test_vllm_logprob_dicts_become_token_logprobs():
    def lp(logprob, rank):  # the fields of vllm.logprobs.Logprob that are read
        return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=None)

    entries = [
        {7: lp(-0.1, 1), 3: lp(-2.5, 2)},  # sampled token ranked first
        {9: lp(-4.0, 5), 2: lp(-0.3, 1), 8: lp(-1.2, 2)},  # sampled token outside the top 2
    ]
    assert vllm_token_logprobs((7, 9), entries, num_top=2) == (
        TokenLogprob(7, -0.1, ((7, -0.1), (3, -2.5))),
        TokenLogprob(9, -4.0, ((2, -0.3), (8, -1.2))),
    )
    assert vllm_token_logprobs((7,), entries[:1], num_top=0) == (TokenLogprob(7, -0.1, ()),)


@pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")
@pytest.mark.gpu
def test_vllm_engine_streams_a_greedy_completion(tiny_checkpoints):
    async def main():
        engine = VLLMEngine(EngineConfig(backend="vllm", model=str(tiny_checkpoints["llama"])))
        await engine.start()
        try:
            request = GenerationRequest(
                "v",
                tuple(range(10, 50)),
                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            )
            return [d async for d in engine.generate(request)]
        finally:
            await engine.shutdown()

    deltas = asyncio.run(main())
    assert sum(len(d.token_ids) for d in deltas) == 8
    assert deltas[-1].finish_reason == "length"


def test_start_without_vllm_says_what_to_install():
    if vllm_available():
        pytest.skip("vllm is installed")
    from ragspeed.engine.protocol import EngineError

    with pytest.raises(EngineError, match="pip install ragspeed\\[gpu\\]"):
        asyncio.run(VLLMEngine(EngineConfig(backend="vllm")).start())
