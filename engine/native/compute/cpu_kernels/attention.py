"""Attention over the paged KV pool in the C kernels (engine.native.compute.attention's CPU fast paths): decodes
(attention.c) and prefill chunks (prefill_attention.c), each reading keys and values where they
lie in the pool.

engine.native.compute.attention's SDPA paths gather each context out of the pool and call SDPA; they are the
reference of both kernels. bench-135m, batch 1, 256 tokens of context: the gather and SDPA took
about 90 us per layer, 2.8 ms of a 27 ms step.
"""

from __future__ import annotations

import ctypes

import torch

from ragspeed.engine.native.compute.cpu_kernels.build import load_library

MAX_GROUP = 16  # query heads per KV head (attention.c's MAX_GROUP)
MAX_HEAD_DIM = 256
KV_DTYPES = (torch.float32, torch.float16)  # the pools the kernels read and write


def _kernels_fit(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Heads within the kernels' limits, and the kernels built here."""
    return num_heads // num_kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM and load_library() is not None


def _fp32_on_cpu(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.float32


def decode_kernel_applies(q: torch.Tensor, num_kv_heads: int) -> bool:
    """q [num_tokens, num_heads, head_dim]: fp32 on CPU, within the kernel's limits."""
    return _fp32_on_cpu(q) and _kernels_fit(q.shape[1], num_kv_heads, q.shape[2])


def prefill_kernel_fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the prefill kernel runs a model of these heads here (its fp32 queries on CPU):
    the decode kernel's limits, and head_dim in whole vectors of 16 floats (the kernel's output
    is written a vector at a time)."""
    return head_dim % 16 == 0 and _kernels_fit(num_heads, num_kv_heads, head_dim)


def prefill_kernel_applies(q: torch.Tensor, num_kv_heads: int) -> bool:
    """q [num_tokens, num_heads, head_dim] fp32 on CPU, of a model prefill_kernel_fits."""
    return _fp32_on_cpu(q) and prefill_kernel_fits(q.shape[1], num_kv_heads, q.shape[2])


def paged_prefill_attention(
    q: torch.Tensor,  # [n, num_heads, head_dim]: the context's last n positions
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] fp32 or fp16
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [blocks] int64, the context's
    num_cached: int,  # keys before the chunk's first query
    block_size: int,
    scale: float,
    num_threads: int = 1,
    library: ctypes.CDLL | None = None,
    int16_attention: bool = False,
) -> torch.Tensor:
    """Causal softmax(q K^T * scale) V of a chunk after `num_cached` keys -> [n, num_heads, head_dim].
    `library`: the kernels' build to run (tests: a narrower CPU's), by default this CPU's.
    `int16_attention`: the scores and the weighted sums as dot products of int16s (q, K, the
    softmax weights and V rounded per vector or tile: prefill_attention.c), an approximation the
    quality gate clears per model."""
    library = library or load_library()
    assert library is not None, "prefill_kernel_applies checks for the kernels"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_table.is_contiguous()
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_DTYPES, k_cache.dtype
    n, num_heads, head_dim = q.shape
    assert block_table.numel() * block_size >= num_cached + n, "the table holds the whole context"
    q = q.contiguous()
    out = torch.empty_like(q)
    library.ragspeed_prefill_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        out.data_ptr(),
        n,
        num_cached,
        num_heads,
        k_cache.shape[1],
        head_dim,
        block_size,
        scale,
        k_cache.dtype == torch.float16,
        int16_attention,
        num_threads,
    )
    return out


def paged_decode_attention(
    q: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] fp32 or fp16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_decodes, max_blocks] int64
    context_lens: torch.Tensor,  # [num_decodes] int64
    block_size: int,
    scale: float,
    num_threads: int = 1,
) -> torch.Tensor:
    """softmax(q K^T * scale) V per decode over its context -> [num_decodes, num_heads, head_dim]."""
    library = load_library()
    assert library is not None, "decode_kernel_applies checks for the kernels"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_DTYPES, k_cache.dtype
    num_decodes, num_heads, head_dim = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    library.ragspeed_paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        num_decodes,
        num_heads,
        k_cache.shape[1],
        head_dim,
        block_tables.shape[1],
        block_size,
        scale,
        k_cache.dtype == torch.float16,
        num_threads,
    )
    return out
