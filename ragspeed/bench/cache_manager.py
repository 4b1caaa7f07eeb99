"""`ragspeed bench cache-manager`: the KV cache manager's per-request bookkeeping, to quote the
cache's no-hit overhead.

One *cycle* is what the engine does per request: `get_computed_blocks`, `allocate_slots`,
`cache_blocks` (after the prefill) and `free`. Three contenders run side by side in one process:

- `off`: caching disabled (allocation only), the baseline;
- `miss`: caching on, every prompt distinct from its first token (no hit: the overhead the cache
  adds to a workload with no shared prefix: hashing every block once, and evicting);
- `hit`: caching on, the same prompt every time (all full blocks but the last token's are hits).

Each contender runs `num_requests` cycles per round; the figure is the median over `rounds`
rounds after one warm-up round, in microseconds per request. As in `timeit`, the cyclic garbage
collector is paused while a contender runs (after a full collection), so that a collection
triggered by one contender's garbage is not charged to another.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import click

from ragspeed.bench.common import machine_line, write_json
from ragspeed.prompt_cache.manager import KVCacheManager

CONTENDERS = ("off", "miss", "hit")


def _time_cycles(manager: KVCacheManager, prompts: list[list[int]]) -> tuple[float, float]:
    """(lookup + allocate + free, cache_blocks) in microseconds per request, averaged."""
    bookkeeping = caching = 0.0
    clock = time.perf_counter
    for index, token_ids in enumerate(prompts):
        request_id = f"bench-{index}"
        t0 = clock()
        block_ids, _ = manager.get_computed_blocks(token_ids)
        if manager.allocate_slots(request_id, len(token_ids), block_ids) is None:
            raise RuntimeError("benchmark pool too small")
        t1 = clock()
        manager.cache_blocks(request_id, token_ids, len(token_ids))
        t2 = clock()
        manager.free(request_id)
        t3 = clock()
        bookkeeping += (t1 - t0) + (t3 - t2)
        caching += t2 - t1
    return bookkeeping / len(prompts) * 1e6, caching / len(prompts) * 1e6


def bench_manager(
    num_tokens: int = 2048,
    block_size: int = 16,
    *,
    num_requests: int = 50,
    rounds: int = 5,
    hash_algo: str = "sha256",
) -> dict[str, float]:
    """Per-request manager overhead for a `num_tokens` prompt; a flat dict of numbers.

    Keys: `{off,miss,hit}_lookup_alloc_free_us`, `{...}_cache_blocks_us`, `{...}_total_us`,
    `no_hit_overhead_us` (miss total minus off total), plus the parameters. A hit costs more
    bookkeeping than a miss (every full block is hashed and verified) but saves its prefill.
    """
    if num_tokens < 2 or block_size <= 0 or num_requests <= 0 or rounds <= 0:
        raise ValueError("num_tokens >= 2, block_size, num_requests and rounds > 0 required")
    blocks_per_request = -(-num_tokens // block_size)
    # Room for one request plus a few requests' worth of cached-but-free blocks to evict.
    num_blocks = 4 * blocks_per_request
    base = [(i * 7919) % 50_000 + 1 for i in range(num_tokens)]
    distinct = [[-(n + 1)] + base[1:] for n in range(num_requests)]  # differ in block 0

    def build(enable_caching: bool) -> KVCacheManager:
        return KVCacheManager(num_blocks, block_size, enable_caching=enable_caching, hash_algo=hash_algo)

    miss_round = 0

    def run_off() -> tuple[float, float]:
        return _time_cycles(managers["off"], distinct)

    def run_miss() -> tuple[float, float]:
        # Fresh distinct prompts every round, so a later round never hits an earlier one.
        nonlocal miss_round
        miss_round += 1
        prompts = [[miss_round * 1_000_000 + n] + base[1:] for n in range(num_requests)]
        return _time_cycles(managers["miss"], prompts)

    def run_hit() -> tuple[float, float]:
        return _time_cycles(managers["hit"], [base] * num_requests)

    managers = {"off": build(False), "miss": build(True), "hit": build(True)}
    runners: dict[str, Callable[[], tuple[float, float]]] = {
        "off": run_off,
        "miss": run_miss,
        "hit": run_hit,
    }
    samples = _sample(runners, rounds)
    result: dict[str, float] = {
        "num_tokens": num_tokens,
        "block_size": block_size,
        "num_requests": num_requests,
        "rounds": rounds,
        **_summarize(samples),
    }
    for manager in managers.values():
        manager.check_invariants()
    return result


def _sample(
    runners: dict[str, Callable[[], tuple[float, float]]], rounds: int
) -> dict[str, list[tuple[float, float]]]:
    """Each contender's (bookkeeping, caching) microseconds per round, after a warm-up round."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in CONTENDERS}
    for round_index in range(rounds + 1):
        for name in CONTENDERS:  # interleaved, so drift of the machine hits all alike
            gc.collect()
            gc.disable()
            try:
                sample = runners[name]()
            finally:
                gc.enable()
            if round_index:  # round 0 warms up (and primes the `hit` cache)
                samples[name].append(sample)
    return samples


def _summarize(samples: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
    """Medians per contender and the no-hit overhead (miss total minus off total)."""
    result: dict[str, float] = {}
    for name in CONTENDERS:
        bookkeeping = statistics.median(s[0] for s in samples[name])
        caching = statistics.median(s[1] for s in samples[name])
        result[f"{name}_lookup_alloc_free_us"] = round(bookkeeping, 2)
        result[f"{name}_cache_blocks_us"] = round(caching, 2)
        result[f"{name}_total_us"] = round(bookkeeping + caching, 2)
    result["no_hit_overhead_us"] = round(result["miss_total_us"] - result["off_total_us"], 2)
    return result


@click.command("cache-manager")
@click.option("--num-tokens", default=2048, type=int, help="Prompt length in tokens.")
@click.option("--block-size", default=16, type=int, help="Tokens per KV block.")
@click.option("--num-requests", default=50, type=int, help="Requests per round and contender.")
@click.option(
    "--rounds", default=5, type=int, help="Measured rounds (after one warm-up); the median is kept."
)
@click.option(
    "--hash-algo", default="sha256", type=click.Choice(["sha256", "blake2b"]), help="Block hash function."
)
@click.option(
    "--json",
    "json_path",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the flat JSON here.",
)
def bench_cache_manager(
    num_tokens: int, block_size: int, num_requests: int, rounds: int, hash_algo: str, json_path: Path | None
) -> None:
    """Per-request bookkeeping of the KV cache manager: caching off, no hit, all hits."""
    try:
        result = bench_manager(
            num_tokens, block_size, num_requests=num_requests, rounds=rounds, hash_algo=hash_algo
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    click.echo(machine_line())
    click.echo(f"{num_tokens}-token prompt, block size {block_size}, median of {rounds} rounds (µs)")
    click.echo(f"{'contender':<10}{'lookup+alloc+free':>20}{'cache_blocks':>15}{'total':>10}")
    for name in CONTENDERS:
        click.echo(
            f"{name:<10}{result[f'{name}_lookup_alloc_free_us']:>20.1f}"
            f"{result[f'{name}_cache_blocks_us']:>15.1f}{result[f'{name}_total_us']:>10.1f}"
        )
    click.echo(f"no-hit overhead: {result['no_hit_overhead_us']:.1f} µs per request")
    write_json(json_path, result)
