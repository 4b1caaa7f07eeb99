"""KV into the pool with rowwise.c: a step's keys and values (engine.native.compute.attention's CPU fast path:
torch's index_copy_ into an fp16 pool converts one element at a time), and stored document KV
(engine.native.core.document_kv's: the fp16 store read once, each key rotated by its position delta and the
pool written once)."""

from __future__ import annotations

import torch

from ragspeed.engine.native.compute.cpu_kernels.attention import KV_DTYPES
from ragspeed.engine.native.compute.cpu_kernels.build import load_library


def write_kernel_applies(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """k, v [n, num_kv_heads, head_dim] fp32 on CPU, each row's heads contiguous, into a
    contiguous fp32 or fp16 pool."""
    return (
        len(k) > 0
        and all(x.device.type == "cpu" and x.dtype == torch.float32 and x[0].is_contiguous() for x in (k, v))
        and k_cache.dtype in KV_DTYPES
        and k_cache.is_contiguous()
        and load_library() is not None
    )


def write_kv(
    k: torch.Tensor,  # [n, num_kv_heads, head_dim] fp32
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] fp32 or fp16
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [n] int64
    num_threads: int,
) -> None:
    """k_cache[slots] = k, v_cache[slots] = v, rounded to the pool's dtype."""
    library = load_library()
    assert library is not None, "write_kernel_applies checks for the kernels"
    assert v_cache.dtype == k_cache.dtype and v_cache.is_contiguous()
    assert slots.dtype == torch.int64 and slots.is_contiguous() and len(slots) == len(k)
    n = k.shape[0]
    library.ragspeed_write_kv(
        k.data_ptr(),
        v.data_ptr(),
        k.stride(0) if n > 1 else 0,
        v.stride(0) if n > 1 else 0,
        slots.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        n,
        k_cache.shape[1] * k_cache.shape[2],
        k_cache.dtype == torch.float16,
        num_threads,
    )


def place_kernel_applies(kv: torch.Tensor, pool: torch.Tensor) -> bool:
    """kv fp16 on CPU into an fp32 or fp16 pool on CPU."""
    return (
        kv.device.type == "cpu"
        and kv.dtype == torch.float16
        and pool.device.type == "cpu"
        and pool.dtype in KV_DTYPES
        and pool.is_contiguous()
        and load_library() is not None
    )


def place_kv(
    kv: torch.Tensor,  # [2, num_layers, n, num_kv_heads, head_dim] fp16
    rotation: torch.Tensor,  # [head_dim / 2] complex64: the keys' shift
    slots: torch.Tensor,  # [n] int64
    pool: torch.Tensor,  # [2, num_layers, num_slots, num_kv_heads, head_dim] fp32 or fp16
    num_threads: int,
) -> None:
    """Write kv into the pool at `slots`, its keys multiplied by `rotation` (pairs adjacent)."""
    kv = kv.contiguous()
    cos_sin = torch.view_as_real(rotation).contiguous()  # [head_dim / 2, 2]
    slots = slots.contiguous()
    _, num_layers, n, num_kv_heads, head_dim = kv.shape
    library = load_library()
    assert library is not None, "place_kernel_applies checks for the kernels"
    library.ragspeed_place_kv(
        kv.data_ptr(),
        cos_sin.data_ptr(),
        slots.data_ptr(),
        pool.data_ptr(),
        num_layers,
        n,
        num_kv_heads,
        head_dim,
        pool.shape[2],
        pool.dtype == torch.float16,
        num_threads,
    )
