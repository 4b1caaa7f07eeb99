"""CPU memory on huge pages (engine.native.compute.huge_pages): zeroed tensors and tensors gathered back to
back, the fused decoder's weights moved into one run in the order a step reads them, and the KV
pool; where Linux gives huge pages, the memory is on them."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch

from ragspeed.engine.native.compute.cpu_kernels import blocked_kernels_available
from ragspeed.engine.native.compute.huge_pages import (
    ALIGNMENT,
    HUGE_PAGE,
    gather_on_huge_pages,
    huge_page_zeros,
)
from ragspeed.engine.native.core.kv_cache import KVCachePool
from ragspeed.engine.native.loading.loader import load_model

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """Linux's transparent huge page setting (`always`, `madvise`, `never`), or None."""
    try:
        return re.search(r"\[(\w+)\]", THP_SETTING.read_text()).group(1)
    except (OSError, AttributeError):
        return None


def _huge_kib(address: int) -> int:
    """The kB of huge pages in the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        bounds = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if bounds:
            inside = int(bounds[1], 16) <= address < int(bounds[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_huge_page_zeros_are_zeros_on_a_huge_page_boundary():
    for shape, dtype in [((3, 5, 7), torch.float16), ((1 << 20,), torch.float32), ((0, 4), torch.int64)]:
        t = huge_page_zeros(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any()
        assert t.data_ptr() % HUGE_PAGE == 0
    t = huge_page_zeros((4, 4), torch.float32)
    t += 1.5  # writable, and its own
    assert torch.equal(t, torch.full((4, 4), 1.5)) and not huge_page_zeros((4, 4), torch.float32).any()


def test_gathered_copies_are_equal_contiguous_and_back_to_back_in_order():
    generator = torch.Generator().manual_seed(0)
    sources = [
        torch.randint(0, 255, (37,), generator=generator, dtype=torch.uint8),
        torch.randn(5, 9, generator=generator).half(),
        torch.randn(16, 3, generator=generator).t(),  # not contiguous
        torch.tensor(2.5),
        torch.randint(-128, 127, (300,), generator=generator, dtype=torch.int8),
    ]
    copies = gather_on_huge_pages(sources)
    for source, copy in zip(sources, copies):
        assert torch.equal(copy, source) and copy.dtype == source.dtype and copy.is_contiguous()
        assert copy.data_ptr() % ALIGNMENT == 0
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    for before, after in zip(copies, copies[1:]):  # in order, no overlap, no more than a line apart
        end = before.data_ptr() + before.numel() * before.element_size()
        assert end <= after.data_ptr() < end + ALIGNMENT
    sources[1].zero_()
    assert copies[1].any()  # copies, not views


def test_without_madvise_the_same_memory_comes_on_ordinary_pages(monkeypatch):
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    zeros = huge_page_zeros((5, 3), torch.float32)
    (copy,) = gather_on_huge_pages([torch.arange(7)])
    assert not zeros.any() and zeros.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(copy, torch.arange(7))


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="Linux gives no huge pages here")
def test_the_memory_is_on_huge_pages_where_linux_gives_them():
    zeros = huge_page_zeros((2 * HUGE_PAGE,), torch.uint8)
    zeros.fill_(1)  # pages come when written
    (copy,) = gather_on_huge_pages([torch.ones(2 * HUGE_PAGE, dtype=torch.uint8)])
    assert _huge_kib(zeros.data_ptr()) >= 2 * HUGE_PAGE // 1024
    assert _huge_kib(copy.data_ptr()) >= 2 * HUGE_PAGE // 1024


def test_the_kv_pool_is_zeroed_on_a_huge_page_boundary(tiny_checkpoints):
    arch = load_model(tiny_checkpoints["llama"], max_model_len=64).arch
    pool = KVCachePool(arch, 8, 4, torch.float16, "cpu")
    assert pool.kv.data_ptr() % HUGE_PAGE == 0 and not pool.kv.any()
    assert pool.k_caches[0].data_ptr() == pool.kv.data_ptr()


@pytest.mark.skipif(
    not blocked_kernels_available(torch.device("cpu")), reason="ragspeed's CPU kernels are off"
)
def test_the_fused_decoder_reads_its_weights_in_one_run_in_step_order(tiny_checkpoints):
    from ragspeed.engine.native.compute.cpu_kernels.decoder import _projections

    loaded = load_model(tiny_checkpoints["llama"], max_model_len=64, quantization="int8")
    model = loaded.model
    weights = [p.blocked_weight() for layer in model.layers for p in _projections(layer)]
    head = model.lm_head.blocked_weight()
    weights += [head] if head is not None else []
    before = [(w.blocks.clone(), w.scales.clone()) for w in weights]
    assert model._fused_decoder() is not None
    tensors = [t for w in weights for t in (w.blocks, w.scales, w.bias) if t is not None]
    for (blocks, scales), weight in zip(before, weights):
        assert torch.equal(weight.blocks, blocks) and torch.equal(weight.scales, scales)
    for before_it, after_it in zip(tensors, tensors[1:]):
        end = before_it.data_ptr() + before_it.numel() * before_it.element_size()
        assert end <= after_it.data_ptr() < end + ALIGNMENT
