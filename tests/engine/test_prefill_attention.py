"""The prefill attention kernel (engine/native/compute/cpu_kernels/prefill_attention.c) against causal attention
in float64, on every build of the kernels this CPU runs: its fp32 products, and its products on
int16 (`int16_attention`)."""

from __future__ import annotations

import math

import pytest
import torch

from ragspeed.engine.native.compute.cpu_kernels import load_library
from ragspeed.engine.native.compute.cpu_kernels.attention import paged_prefill_attention
from tests.engine.conftest import AVX_VNNI, KERNEL_ISAS, kernel_library

pytestmark = pytest.mark.skipif(
    load_library() is None, reason="ragspeed's CPU kernels could not be built here"
)

U = 2.0**-24  # fp32's unit roundoff


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _pool(gen, context: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype):
    """A pool with room for the context and 7 blocks more, the context's blocks in random order."""
    num_blocks = -(-context // block_size)
    pool_blocks = num_blocks + 7
    table = torch.randperm(pool_blocks, generator=gen)[:num_blocks]
    shape = (pool_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    v_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    return k_cache, v_cache, table


def _context(cache: torch.Tensor, table: torch.Tensor, block_size: int, context: int) -> torch.Tensor:
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:context]
    return cache[slots].double()  # [context, num_kv_heads, head_dim]


def _check(out, q, keys, values, num_cached: int, scale: float, int16: bool = False) -> None:
    """out within the rounding bound of fp32 arithmetic from float64 causal attention.

    Each score is a sum of head_dim products scaled by scale * log2(e): its error is at most
    gamma(head_dim + 2) times the sum of its terms' magnitudes A, which moves its weight 2^s by
    a factor of at most 1 + ln2 * gamma(head_dim + 2) * A; the weights' polynomial adds 2e-7, and
    the output, a weighted mean of the value rows summed over the context (and rescaled once a
    tile), gamma(context + tiles) times the weighted mean of their magnitudes M. Twice all that
    is the tolerance, per row and element: a key read from the wrong place, or masked one too
    late or too early, moves an output by about M / context, far beyond it.

    With `int16` the rounding to int16 adds three terms (L: the kernel's qk_limit of a dot
    product's length; a rounding's error is half its step, plus fp32's in computing it):
    - a score moves by at most d = |q|_1 e_k + |k|_1 e_q + head_dim e_q e_k, where e_q and e_k
      are the errors of the query's and the key's elements (each vector's step: its largest
      magnitude / L(head_dim)); its weight by a factor 2^d, so the output by (2^(2d) - 1) M;
    - a value moves by at most e_v: half its key's step (the largest magnitude of its row / L(64));
    - a weight times its value's step w moves by half its tile's step (the tile's largest w /
      L(64)); times a rounded value (at most L(64)) that is half the tile's largest weight times
      V, the values' largest magnitude; the tiles' largest weights add up to at most the row's
      sum, so 64 keys a tile move the output by at most 32 V / L(64).
    Such bounds catch a broken layout of pairs (an error of the order of M), not a key masked one
    too late; the same tiles and masks run in fp32, which the fp32 bound checks, and
    test_equal_scores_weigh_the_visible_values_alike_on_int16 checks them on int16 exactly.
    """
    n, num_heads, head_dim = q.shape
    group = num_heads // keys.shape[1]
    context = keys.shape[0]
    k = keys.repeat_interleave(group, dim=1)  # [context, num_heads, head_dim]
    v = values.repeat_interleave(group, dim=1)
    qd = q.double()
    scores = torch.einsum("qhd,khd->hqk", qd, k) * scale
    visible = torch.ones(n, context, dtype=torch.bool).tril(num_cached)
    weights = scores.masked_fill(~visible, -math.inf).softmax(-1)  # [num_heads, n, context]
    expected = torch.einsum("hqk,khd->qhd", weights, v)
    magnitudes = torch.einsum("qhd,khd->hqk", qd.abs(), k.abs()) * scale / math.log(2)
    worst = magnitudes.masked_fill(~visible, 0).amax(-1).transpose(0, 1)  # [n, num_heads]
    mean_value = torch.einsum("hqk,khd->qhd", weights, v.abs())
    tiles = -(-context // 64)
    relative = 2 * (math.log(2) * _gamma(head_dim + 2) * worst + 2e-7 + _gamma(context + 3 * tiles))
    tolerance = relative.unsqueeze(-1) * mean_value
    if int16:
        limit, tile_limit = _limit(head_dim), _limit(64)
        qs = qd * (scale / math.log(2))  # the queries as the kernel scales them, base 2
        e_q = qs.abs().amax(-1) * (0.5 / limit + 4 * U)  # [n, num_heads]
        e_k = k.abs().amax(-1) * (0.5 / limit + 4 * U)  # [context, num_heads]
        moved = (
            torch.einsum("qh,kh->hqk", qs.abs().sum(-1), e_k)
            + torch.einsum("qh,khd->hqk", e_q, k.abs())
            + head_dim * torch.einsum("qh,kh->hqk", e_q, e_k)
        )
        d = moved.masked_fill(~visible, 0).amax(-1).transpose(0, 1)  # [n, num_heads]
        largest = v.abs().amax(-1).amax(0).view(1, -1, 1)  # V of each head
        e_v = largest * (0.5 / tile_limit + 4 * U)
        weights_moved = 1.01 * 32 / tile_limit * largest
        tolerance = tolerance + 2 * ((2 ** (2 * d) - 1).unsqueeze(-1) * mean_value + e_v + weights_moved)
    error = (out.double() - expected).abs()
    assert (error <= tolerance).all(), float((error - tolerance).max())


def _limit(length: int) -> float:
    """prefill_attention.c's qk_limit: the largest int16 magnitude of a dot product of `length`
    pairs that stays within int32."""
    return math.floor(math.sqrt((2**31 - 1) / length))


# (num_heads, num_kv_heads, head_dim, block_size): SmolLM2's 9 / 3 / 64; a group of 8 and of 16
# (fewer positions a task); one query head per KV head with head_dim 128; blocks of 5 and 7.
LAYOUTS = [(9, 3, 64, 16), (4, 2, 16, 5), (8, 1, 32, 7), (32, 2, 64, 16), (2, 2, 128, 16)]
# (queries, keys before them): one query, tiles and tasks cut inside, a long cached prefix.
CHUNKS = [(1, 0), (1, 130), (50, 0), (130, 3), (70, 200)]


@pytest.mark.parametrize("isa", [*KERNEL_ISAS, AVX_VNNI])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", LAYOUTS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("int16", [False, True], ids=["fp32", "int16"])
def test_a_chunk_attends_causally_to_its_context(
    isa, num_heads, num_kv_heads, head_dim, block_size, kv_dtype, int16
):
    library = kernel_library(isa)
    gen = torch.Generator().manual_seed(num_heads + head_dim + block_size)
    for n, num_cached in CHUNKS:
        context = num_cached + n
        k_cache, v_cache, table = _pool(gen, context, num_kv_heads, head_dim, block_size, kv_dtype)
        q = torch.randn(n, num_heads, head_dim, generator=gen) * 2
        scale = head_dim**-0.5
        out = paged_prefill_attention(
            q, k_cache, v_cache, table, num_cached, block_size, scale, 2, library, int16_attention=int16
        )
        keys, values = (_context(c, table, block_size, context) for c in (k_cache, v_cache))
        _check(out, q, keys, values, num_cached, scale, int16)


def test_scores_far_apart_weigh_only_the_largest():
    """Scores 40 apart in every tile (most weights underflow to 0) and a later tile's larger
    maximum (the earlier tiles' sums rescaled): still within the bound."""
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, table = _pool(gen, 300, 3, 64, 16, torch.float32)
    q = torch.randn(300, 9, 64, generator=gen)
    k_cache[table[-1] * 16] *= 40  # one key of the last block dominates its queries
    out = paged_prefill_attention(q, k_cache, v_cache, table, 0, 16, 0.125, 2)
    keys, values = (_context(c, table, 16, 300) for c in (k_cache, v_cache))
    _check(out, q, keys, values, 0, 0.125)


@pytest.mark.parametrize("isa", [*KERNEL_ISAS, AVX_VNNI])
@pytest.mark.parametrize("int16", [False, True], ids=["fp32", "int16"])
def test_a_row_has_the_same_bits_in_any_chunking_and_on_any_threads(isa, int16):
    """Each row adds its terms in an order fixed by its position alone: a prompt prefilled in one
    chunk or in three, on one thread or two, gives the same bits."""
    library = kernel_library(isa)
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache, table = _pool(gen, 333, 3, 64, 16, torch.float16)
    q = torch.randn(333, 9, 64, generator=gen)

    def attend(a: int, b: int, threads: int) -> torch.Tensor:
        return paged_prefill_attention(
            q[a:b], k_cache, v_cache, table, a, 16, 0.125, threads, library, int16_attention=int16
        )

    whole = attend(0, 333, 1)
    assert torch.equal(attend(0, 333, 2), whole)
    chunked = [attend(a, b, 2) for a, b in [(0, 100), (100, 101), (101, 333)]]
    assert torch.equal(torch.cat(chunked), whole)


@pytest.mark.parametrize("isa", [*KERNEL_ISAS, AVX_VNNI])
@pytest.mark.parametrize("head_dim", [16, 64, 80])
def test_equal_scores_weigh_the_visible_values_alike_on_int16(isa, head_dim):
    """Zero queries give every visible key the same weight; values that are whole multiples of
    a power of two, each key's reaching the rounding's limit, round to themselves, and so do their
    weights (times the keys' equal steps): so each output is the mean of its visible values but
    for fp32's rounding of their sums. A pair of keys or a channel out of place, or a key masked
    one too late or too early, moves it by its values' spread / context."""
    library = kernel_library(isa)
    gen = torch.Generator().manual_seed(head_dim)
    context, num_cached, tile_limit = 150, 40, _limit(64)
    k_cache, v_cache, table = _pool(gen, context, 2, head_dim, 16, torch.float32)
    values = torch.randint(-tile_limit, tile_limit + 1, (context, 2, head_dim), generator=gen).float()
    values[:, :, 0] = tile_limit  # every key's largest: a step of exactly 2^-6
    slots = (table[:, None] * 16 + torch.arange(16)).flatten()[:context]
    v_cache[slots] = values * 2.0**-6
    q = torch.zeros(context - num_cached, 4, head_dim)
    out = paged_prefill_attention(
        q, k_cache, v_cache, table, num_cached, 16, 0.125, 2, library, int16_attention=True
    )
    v = _context(v_cache, table, 16, context).repeat_interleave(2, dim=1)  # [context, 4, head_dim]
    expected = v.cumsum(0)[num_cached:] / torch.arange(num_cached + 1, context + 1).view(-1, 1, 1)
    error = (out.double() - expected).abs()
    assert (error <= _gamma(context + 8) * v.abs().amax(0)).all(), float(error.max())
