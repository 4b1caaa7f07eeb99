"""`prompt_cache` commands, a typer sub-app mounted by `gateway.cli` (e.g. as `ragspeed cache`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ragspeed.prompt_cache.bench import CONTENDERS, bench_manager

app = typer.Typer(help="Prefix-cache tools.", no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Prefix-cache tools (a group, so that a single command keeps its name)."""


@app.command("bench-manager")
def bench_manager_command(
    num_tokens: int = typer.Option(2048, help="Prompt length in tokens."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    num_requests: int = typer.Option(50, help="Requests per round and contender."),
    rounds: int = typer.Option(5, help="Measured rounds (after one warm-up); the median is kept."),
    hash_algo: str = typer.Option("sha256", help="Block hash function: sha256 or blake2b."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the flat JSON here."),
) -> None:
    """Per-request bookkeeping of the KV cache manager: caching off, no hit, all hits."""
    result = bench_manager(
        num_tokens, block_size, num_requests=num_requests, rounds=rounds, hash_algo=hash_algo
    )
    typer.echo(
        f"{num_tokens}-token prompt, block size {block_size}, median of {rounds} rounds (µs)"
    )
    typer.echo(f"{'contender':<10}{'lookup+alloc+free':>20}{'cache_blocks':>15}{'total':>10}")
    for name in CONTENDERS:
        typer.echo(
            f"{name:<10}{result[f'{name}_lookup_alloc_free_us']:>20.1f}"
            f"{result[f'{name}_cache_blocks_us']:>15.1f}{result[f'{name}_total_us']:>10.1f}"
        )
    typer.echo(f"no-hit overhead: {result['no_hit_overhead_us']:.1f} µs per request")
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
