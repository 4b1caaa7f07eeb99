"""Build the native engine from its parts, one stage after another:

1. *load*: the model's weights, config and rotation table (engine.native.loading.loader), and its tokenizer;
2. *precision*, after loading and apart from the loader: what the weights and the prefill
   products serve in (engine.native.core.precision: auto's int8 quality gate, the prefill path);
3. *KV*: the pool, sized from the token budget or free memory (engine.native.core.kv_cache), the model
   runner that computes into it and the block manager that hands out its blocks.
`LLMEngine` then wires the scheduler, sampler, speculator and document cache over those parts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.compute.cpu_features import CpuFeatures
from ragspeed.engine.native.compute.quant.probe import PrefillProbe
from ragspeed.engine.native.core.kv_cache import KVCachePool, plan_num_blocks, resolve_kv_dtype
from ragspeed.engine.native.core.llm_engine import LLMEngine
from ragspeed.engine.native.core.model_runner import ModelRunner
from ragspeed.engine.native.core.precision import choose_precision
from ragspeed.engine.native.loading.loader import LoadedModel, load_for_engine, resolve_model_path
from ragspeed.engine.native.loading.model_zoo import resolve_tokenizer
from ragspeed.prompt_cache.manager import KVCacheManager


def build_llm_engine(
    config: EngineConfig,
    *,
    loaded: LoadedModel | None = None,  # already loaded (benches share one model between engines)
    tokenizer: Any = None,
    features: CpuFeatures | None = None,  # default: this CPU's (engine.native.compute.cpu_features)
    prefill_probe: PrefillProbe
    | None = None,  # default: measured here, cached (engine.native.compute.quant.probe)
) -> LLMEngine:
    """A native engine for `config`, from the model given or loaded here."""
    num_threads = config.num_threads or torch.get_num_threads()
    if loaded is None:
        loaded = load_model_for(config, num_threads)
    if loaded.arch.draft_vocab_size is not None:
        raise ValueError(
            f"model {config.model!r} is a draft with a {loaded.arch.draft_vocab_size}-token sub-vocabulary"
            " head, not a model to serve: pass it as --draft-model of its target"
        )
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_tokenizer(config.tokenizer, loaded.path))
    unquantized = replace(config, quantization=None)
    precision = choose_precision(
        loaded,
        config,
        tokenizer,
        lambda: load_for_engine(
            loaded.path, unquantized, max_model_len=config.max_model_len, num_threads=num_threads
        ),
        num_threads=num_threads,
        features=features,
        prefill_probe=prefill_probe,
    )
    runner, manager = build_kv(config, precision.loaded, num_threads)
    return LLMEngine(
        config,
        loaded=precision.loaded,
        tokenizer=tokenizer,
        runner=runner,
        manager=manager,
        prefill_choice=precision.prefill,
    )


def load_model_for(config: EngineConfig, num_threads: int) -> LoadedModel:
    """The load stage: `config.model` resolved (zoo name, folder, GGUF file, hub id) and loaded."""
    path = resolve_model_path(config.model)
    return load_for_engine(path, config, max_model_len=config.max_model_len, num_threads=num_threads)


def build_kv(
    config: EngineConfig, loaded: LoadedModel, num_threads: int
) -> tuple[ModelRunner, KVCacheManager]:
    """The KV stage: a pool of as many blocks as `config` and memory allow, the runner of
    `loaded` over it, and the manager of its blocks (prefix caching keyed by model and dtype)."""
    dtype = resolve_kv_dtype(config.kv_cache_dtype, loaded.model.dtype, config.device)
    num_blocks = plan_num_blocks(
        loaded.arch,
        block_size=config.block_size,
        dtype=dtype,
        max_model_len=loaded.rotary.freqs_cis.shape[0],
        num_kv_cache_tokens=config.num_kv_cache_tokens,
        memory_fraction=config.kv_cache_memory_fraction,
        device=config.device,
    )
    pool = KVCachePool(loaded.arch, num_blocks, config.block_size, dtype, config.device)
    runner = ModelRunner(loaded.model, loaded.rotary, pool, config.device, num_threads=num_threads)
    manager = KVCacheManager(
        num_blocks,
        config.block_size,
        enable_caching=config.enable_prefix_caching,
        extra_key=f"{loaded.path.resolve()}|{dtype}",
    )
    return runner, manager
