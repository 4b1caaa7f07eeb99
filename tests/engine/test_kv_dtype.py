"""The KV pool's dtype (`--kv-cache-dtype`): fp16 by default on a CPU with the kernels, half the
bytes of fp32, and answers that follow the fp32 pool's to fp16 rounding."""

from __future__ import annotations

import pytest
import torch

from ragspeed.engine.native.compute.cpu_kernels import load_library
from ragspeed.engine.native.core.kv_cache import resolve_kv_dtype
from ragspeed.engine.protocol import GenerationRequest, SamplingParams
from tests.engine.conftest import make_engine

PROMPT = tuple(range(10, 60))


def test_auto_is_fp16_for_an_fp32_model_on_a_cpu_with_the_kernels():
    half = torch.float16 if load_library() is not None else torch.float32
    assert resolve_kv_dtype("auto", torch.float32, "cpu") == half
    assert resolve_kv_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.bfloat16, "cuda") == torch.bfloat16
    assert resolve_kv_dtype("fp32", torch.float32, "cpu") == torch.float32
    assert resolve_kv_dtype("fp16", torch.float32, "cuda") == torch.float16
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'; known: auto, fp32, fp16"):
        resolve_kv_dtype("int4", torch.float32, "cpu")


def _run(engine, request_id: str) -> dict:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    return engine.generate([GenerationRequest(request_id, PROMPT, params)])[request_id]


def test_an_fp16_pool_holds_half_the_bytes_and_follows_the_fp32_answers(tiny_checkpoints):
    full = make_engine(tiny_checkpoints["llama"])
    half = make_engine(tiny_checkpoints["llama"], kv_cache_dtype="fp16")
    assert half.kv_pool.kv.dtype == torch.float16
    assert half.kv_pool.num_bytes * 2 == full.kv_pool.num_bytes
    reference = _run(full, "a")
    out = _run(half, "a")
    assert out["token_ids"] == reference["token_ids"]
    got = torch.tensor([lp.logprob for lp in out["logprobs"]])
    want = torch.tensor([lp.logprob for lp in reference["logprobs"]])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
    assert not torch.equal(got, want)  # the keys and values were rounded
    # The prefix cache serves fp16 blocks: a repeat prefills only its last token.
    assert half.num_cached_prefix_tokens(PROMPT, None) >= len(PROMPT) - half.config.block_size
    assert _run(half, "b")["token_ids"] == out["token_ids"]
