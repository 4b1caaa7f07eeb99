"""CPU memory on 2 MiB pages where Linux gives them: what a decode step streams through.

A decode step reads every weight and its requests' KV cache once, hundreds of MiB on 4 KiB
pages: tens of thousands of pages a step, each a TLB miss and a page walk. Linux backs an
anonymous mapping with 2 MiB pages (transparent huge pages) where it is asked to with
madvise(MADV_HUGEPAGE) and its setting (/sys/kernel/mm/transparent_hugepage/enabled) is
`madvise` or `always`; with `never`, or where madvise is missing, the same memory comes on
ordinary pages and everything works as before.

`gather_on_huge_pages` copies tensors back to back into one such mapping, in the order a step
reads them; `huge_page_zeros` is a zeroed tensor in its own. Both map fresh anonymous memory,
which is zero and costs nothing until written.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # a cache line: where each gathered tensor starts


def _mapping(num_bytes: int) -> torch.Tensor:
    """num_bytes of fresh zeroed memory, uint8, starting on a 2 MiB boundary, asked for huge pages."""
    # Private: a shared anonymous mapping is shmem, whose huge pages follow another setting.
    region = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError:  # a kernel built without transparent huge pages
            pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while any view lives
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + num_bytes]


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, on huge pages where the kernel allows."""
    num_bytes = math.prod(shape) * dtype.itemsize
    return _mapping(max(num_bytes, 1))[:num_bytes].view(dtype).view(shape)


def gather_on_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU `tensors`, back to back in one mapping in their order (each on a
    cache line), on huge pages where the kernel allows."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    starts, end = [], 0
    for size in sizes:
        starts.append(-(-end // ALIGNMENT) * ALIGNMENT)
        end = starts[-1] + size
    memory = _mapping(max(end, 1))
    return [
        memory[start : start + size].view(t.dtype).view(t.shape).copy_(t)
        for t, start, size in zip(tensors, starts, sizes)
    ]
