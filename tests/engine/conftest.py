"""Tiny seeded checkpoints of each family, built once per session, and engines over them."""

from __future__ import annotations

import ctypes
import functools
import shutil
import weakref

import pytest
import torch

from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.compute.cpu_features import CpuFeatures
from ragspeed.engine.native.compute.cpu_kernels import load_library
from ragspeed.engine.native.compute.cpu_kernels.blocked import INT8_GROUP
from ragspeed.engine.native.core.factory import build_llm_engine
from ragspeed.engine.native.core.llm_engine import LLMEngine
from tests.engine.tiny_models import build_tiny_checkpoint

# CPUs the precision and probe tests inject: Zen 3 (AVX2 only), a Xeon with AMX, Zen 4.
AVX2 = CpuFeatures("AMD EPYC", frozenset({"avx2"}), "AVX2")
AMX = CpuFeatures(
    "Intel Xeon",
    frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"}),
    "AVX512",
)
AVX512_BF16 = CpuFeatures(
    "AMD EPYC Zen 4", frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}), "AVX512"
)

# The builds of the kernels a test runs on this CPU: its own, an AVX2-only CPU's, plain C's.
KERNEL_ISAS = ("native", "avx2", "plain")


def kernel_library(isa: str):
    """The kernels built for `isa` (one of KERNEL_ISAS, or AVX_VNNI), or the test skipped where
    that build failed or this CPU cannot run it."""
    library = _avx_vnni_library() if isa == AVX_VNNI else load_library(isa)
    if library is None:
        pytest.skip(f"the {isa} build of the kernels failed here, or this CPU has no {isa}")
    return library


# An AVX2 CPU with VEX-encoded VNNI and no AVX-512 (Intel's Alder Lake and later): the kernels'
# branches for it, which only some kernels have (prefill attention's int16 products), run where
# this CPU has AVX-VNNI and the session runs its own ISA.
AVX_VNNI = "avx-vnni"


@functools.cache
def _avx_vnni_library() -> ctypes.CDLL | None:
    from ragspeed.engine.native.compute.cpu_kernels import build
    from ragspeed.environment import current

    # /proc/cpuinfo itself: the tests' read_cpu_features reports a fixed set
    with open("/proc/cpuinfo") as cpuinfo:
        has_avx_vnni = "avx_vnni" in cpuinfo.read().split()
    if load_library() is None or current().cpu_isa != "native" or not has_avx_vnni:
        return None
    target = build.cache_dir() / "kernels-avx-vnni-test.so"
    build._compile(shutil.which(current().compiler) or "gcc", target, (*build.FLAGS, "-mno-avx512f"))
    return build._bind(ctypes.CDLL(str(target)))


FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
SEEDS = {"llama": 1, "qwen2": 2, "qwen3": 3, "mistral": 4}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    return {f: build_tiny_checkpoint(f, root / f, seed=SEEDS[f]) for f in FAMILIES}


@pytest.fixture(scope="session")
def hf_models(tiny_checkpoints) -> dict:
    from transformers import AutoModelForCausalLM

    return {
        f: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
        for f, p in tiny_checkpoints.items()
    }


# Per model while it lives: a model built inside one test must not find the entries of an earlier
# one that happened to have the same id().
_HF_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate()`, greedy, EOS ignored: the reference token ids (memoized: the
    same prompts serve several scheduling modes)."""
    cache = _HF_CACHE.setdefault(model, {})
    key = (tuple(prompt), max_new_tokens)
    if key not in cache:
        cache[key] = _hf_greedy(model, prompt, max_new_tokens)
    return cache[key]


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=1,
        )
    return out[0, len(prompt) :].tolist()


def make_engine(path, features=None, prefill_probe=None, **overrides) -> LLMEngine:
    """An engine of `engine_config(path, **overrides)`."""
    return build_llm_engine(engine_config(path, **overrides), features=features, prefill_probe=prefill_probe)


def engine_config(path, **overrides) -> EngineConfig:
    """The tests' config, on fp32 unless asked: `--dtype auto` would pick bf16 prefill products
    on a CPU with AVX512-BF16 or AMX, whose rounding depends on the batch's rows, and the fp16 KV cache
    of `--kv-cache-dtype auto` rounds every key and value, while these tests compare runs token
    for token and against fp32 references (engine.native.core.precision's own tests choose paths with
    injected CPU features; test_kv_dtype covers the fp16 pool). No step time budget unless
    asked: it sizes chunks by the machine's measured speed, so a busy machine would change the
    steps these tests count (test_stall_free covers the budget)."""
    kwargs = dict(
        model=str(path),
        max_model_len=256,
        num_kv_cache_tokens=4096,
        block_size=8,
        dtype="float32",
        kv_cache_dtype="fp32",
        tpot_target_ms=None,
    )
    kwargs.update(overrides)
    return EngineConfig(**kwargs)


def speculate_every_step(engine: LLMEngine) -> None:
    """Pin the step-level switch on (per-request k still adapts): tests of the speculative
    mechanism must not depend on the step times the controller measures."""
    engine.speculator.controller.batch_allows = lambda decodes, num_tokens: True


def assert_all_blocks_free(engine: LLMEngine) -> None:
    engine.manager.check_invariants()
    assert engine.manager.num_free_blocks == engine.manager.num_blocks
    assert not engine.has_unfinished()


def int16_rows(x: torch.Tensor) -> torch.Tensor:
    """What the int8 kernel multiplies for x [m, k]: each group of INT8_GROUP inputs rounded to
    int16 steps of max |x| / 32767 (fp32 arithmetic, as kernels_common.h's quantize_rows)."""
    m, k = x.shape
    groups = -(-k // INT8_GROUP)
    padded = torch.zeros(m, groups * INT8_GROUP).index_copy_(1, torch.arange(k), x).view(m, groups, -1)
    amax = padded.abs().amax(dim=2, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros(()))
    return (torch.round(padded * inverse) * (amax / 32767.0)).view(m, -1)[:, :k]
