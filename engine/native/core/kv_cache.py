"""The paged KV cache's tensors: one preallocated pool of fixed-size blocks for all layers.

Layout: `[2 (K, V), num_layers, num_blocks, block_size, num_kv_heads, head_dim]`. Attention
sees each layer's K (or V) as `[num_blocks * block_size, num_kv_heads, head_dim]`, indexed by
slot (`block_id * block_size + offset`). Which blocks belong to whom is the
`KVCacheManager`'s business; this module only owns memory and sizes it.
"""

from __future__ import annotations

import torch

from ragspeed.engine.native.compute.cpu_kernels.build import load_library
from ragspeed.engine.native.compute.huge_pages import huge_page_zeros
from ragspeed.engine.native.models.arch import ModelArch


class PoolTooSmallError(ValueError):
    """The KV cache pool cannot hold even one request of the maximum length."""


class KVCachePool:
    def __init__(
        self,
        arch: ModelArch,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, arch.num_layers, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        # On a CPU, huge pages: decode attention streams each request's blocks every step.
        on_cpu = torch.device(device).type == "cpu"
        self.kv = huge_page_zeros(shape, dtype) if on_cpu else torch.zeros(shape, dtype=dtype, device=device)
        num_slots = num_blocks * block_size
        # [2, num_layers, num_slots, num_kv_heads, head_dim]: K and V of every layer by slot.
        self.by_slot = self.kv.view(2, arch.num_layers, num_slots, arch.num_kv_heads, -1)
        # Per-layer views, built once: the layer loop zips over them, no indexing per step.
        self.k_caches: list[torch.Tensor] = list(self.by_slot[0].unbind(0))
        self.v_caches: list[torch.Tensor] = list(self.by_slot[1].unbind(0))
        # The pool as rows of one token's K (or V) at one layer, and the first row of each
        # (K or V, layer): `write` puts a token range of every layer in one index_copy_.
        self._rows = self.kv.view(-1, arch.num_kv_heads * arch.head_dim)
        self._first_rows = (torch.arange(2 * arch.num_layers, device=self.kv.device) * num_slots).view(-1, 1)

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def write(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """kv [2, num_layers, n, num_kv_heads, head_dim] in the pool's dtype, where it lies,
        into `slots` ([n] int64) of every layer."""
        rows = kv.reshape(-1, self._rows.shape[1])  # [2 * num_layers * n, num_kv_heads * head_dim]
        self._rows.index_copy_(0, (self._first_rows + slots).view(-1), rows)

    def read(self, slots: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """K/V at `slots` ([n] int64): [2, num_layers, n, num_kv_heads, head_dim]; or, for one
        `layer`, its keys [n, num_kv_heads, head_dim]."""
        slots = slots.to(self.kv.device)
        if layer is not None:
            return self.k_caches[layer].index_select(0, slots)
        return self.by_slot.index_select(2, slots)


KV_CACHE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The pool's dtype for `--kv-cache-dtype`: "auto" is fp16 for an fp32 model on a CPU with
    ragspeed's kernels (decode attention reads half the bytes; they widen each key and value as
    they read it), else the model's dtype."""
    if name == "auto":
        half = (
            torch.device(device).type == "cpu" and model_dtype == torch.float32 and load_library() is not None
        )
        return torch.float16 if half else model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}; known: auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def available_memory_bytes(device: torch.device | str) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; set num_kv_cache_tokens")


def plan_num_blocks(
    arch: ModelArch,
    *,
    block_size: int,
    dtype: torch.dtype,
    max_model_len: int,
    num_kv_cache_tokens: int | None,
    memory_fraction: float,
    device: torch.device | str,
) -> int:
    """Blocks in the pool: from a token count, or a fraction of the free memory. Raises
    PoolTooSmallError, with the numbers, when one request of `max_model_len` would not fit."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    bytes_per_token = arch.kv_bytes_per_token * torch.tensor([], dtype=dtype).element_size()
    if num_kv_cache_tokens is not None:
        if num_kv_cache_tokens < 1:
            raise ValueError(f"num_kv_cache_tokens must be >= 1, got {num_kv_cache_tokens}")
        num_blocks = num_kv_cache_tokens // block_size
        source = f"num_kv_cache_tokens={num_kv_cache_tokens}"
    else:
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {memory_fraction}")
        budget = int(available_memory_bytes(device) * memory_fraction)
        num_blocks = budget // (bytes_per_token * block_size)
        source = (
            f"kv_cache_memory_fraction={memory_fraction} of free memory = {budget / 2**20:.0f} MiB"
            f" at {bytes_per_token} bytes per token"
        )
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise PoolTooSmallError(
            f"KV cache pool too small: {source} gives {num_blocks} blocks of {block_size} tokens "
            f"({num_blocks * block_size} tokens), but one request of max_model_len={max_model_len} "
            f"tokens needs {needed} blocks ({needed * block_size} tokens); raise "
            f"num_kv_cache_tokens or kv_cache_memory_fraction, or lower max_model_len"
        )
    return num_blocks
