"""Logits of windows of text through the model runner: what the quality gate compares
(engine.native.core.quality defines the figures).

Each window is one prefill from position 0 into a KV pool of its own, through a `ModelRunner`
over the loaded model, so the gate measures the products, attention and threads that serve.
"""

from __future__ import annotations

import torch

from ragspeed.engine.native.core.kv_cache import KVCachePool
from ragspeed.engine.native.core.model_runner import ModelRunner
from ragspeed.engine.native.core.quality import QualityReport, compare_logits
from ragspeed.engine.native.core.scheduler_output import TokenSequence
from ragspeed.engine.native.loading.loader import LoadedModel


def window_logits(
    loaded: LoadedModel,
    token_ids: list[int],
    block_size: int = 16,
    kv_dtype: torch.dtype | None = None,
    *,
    decode_kernels: bool = False,
    int16_attention: bool = False,
) -> torch.Tensor:
    """fp32 logits [len(token_ids), vocab] of one sequence: one prefill through paged attention,
    its KV pool in `kv_dtype` (default the model's dtype), every product on the prefill's
    kernels (or, with `decode_kernels`, on the decode kernels), the attention's products on
    int16 where `int16_attention` (ModelRunner.int16_attention)."""
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    device, dtype = loaded.model.device, loaded.model.dtype
    pool = KVCachePool(loaded.arch, num_blocks, block_size, kv_dtype or dtype, device)
    runner = ModelRunner(loaded.model, loaded.rotary, pool, device)
    runner.int16_attention = int16_attention
    chunk = TokenSequence(list(token_ids)).chunk(0, n, tuple(range(num_blocks)))
    return runner.chunk_logits(chunk, decode_kernels=decode_kernels)  # [n, vocab]


def decode_window_logits(
    loaded: LoadedModel, token_ids: list[int], kv_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`window_logits` with every product on the decode kernels (engine.native.compute.cpu_kernels.blocked:
    int8 weights times int16 activations): each position's logits as a decode step computes
    them, teacher-forced."""
    return window_logits(loaded, token_ids, kv_dtype=kv_dtype, decode_kernels=True)


def compare_quality(
    reference: LoadedModel, quantized: LoadedModel, windows: list[list[int]]
) -> QualityReport:
    return compare_logits(
        lambda ids: window_logits(reference, ids),
        lambda ids: window_logits(quantized, ids),
        windows,
    )
