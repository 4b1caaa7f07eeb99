"""Stored document KV placed into the KV pool with rowwise.c (engine.document_kv's CPU fast
path): the fp16 store read once, each key rotated by its position delta and the pool written
once."""

from __future__ import annotations

import torch

from ragspeed.engine.cpu_kernels.attention import KV_DTYPES
from ragspeed.engine.cpu_kernels.build import load_library


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
