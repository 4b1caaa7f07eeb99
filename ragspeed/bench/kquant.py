"""`ragspeed bench kquant`: products of a few rows with GGUF's K-quants on their blocks, against
the fp32 product of the same weights dequantized (what a K-quant model decoded on before).

Contenders, for each shape and row count, side by side in one process:

- `q4k` / `q6k`: the K-quant kernels (engine.native.compute.cpu_kernels.BlockedWeight on Q4_K's or Q6_K's
  unpacked integers and fp32 steps, engine.native.compute.quant.k_quants), with random valid values;
- `kmix`: the mixed kernel on rows of both, four fifths Q4_K and the rest Q6_K (Q4_K_M's fused
  QKV of SmolLM2: Q and K Q4_K, V Q6_K), converted by engine.native.compute.quant.gguf_blocks.as_mixed;
- `fp32`: ragspeed's fp32 kernel on the weight those values stand for, the blocked copy a
  dense weight decodes with;
- `torch`: `x @ W.T` on that weight.

A decode step reads every weight from memory once, so each contender cycles over copies of its
weight filling `footprint` bytes (far beyond the caches, as a model's layers are) and a figure
is the median over `repeats` cycles of the time per product. The bound beside it: its weight bytes over the
read bandwidth measured in the same run (engine's BandwidthProbe).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import click
import torch

from ragspeed.bench.common import json_option, machine_line, threads_option, write_json
from ragspeed.bench.engine import BandwidthProbe
from ragspeed.engine.native.compute.cpu_features import read_cpu_features
from ragspeed.engine.native.compute.cpu_kernels import BlockedWeight, blocked_kernels_available
from ragspeed.engine.native.compute.cpu_kernels.blocked import INT8_GROUP, Q6K_STEP
from ragspeed.engine.native.compute.quant.gguf_blocks import as_mixed, kernel_dequantize

# (in_features, out_features): SmolLM2-135M's output, gate (or up), down and fused QKV projections.
SHAPES = ((576, 576), (576, 1536), (1536, 576), (576, 960))
KINDS = ("q4k", "q6k", "kmix")
ROWS = (1, 4)  # a decode step; a verification of three drafts


def _k_quant(kind: str, in_features: int, out_features: int, gen: torch.Generator):
    """Random integers and fp32 scales of `kind`, of a trained model's magnitudes."""
    shape = (out_features, in_features)
    if kind == "kmix":
        num_q4k = out_features * 4 // 5
        parts = [
            _k_quant("q4k", in_features, num_q4k, gen),
            _k_quant("q6k", in_features, out_features - num_q4k, gen),
        ]
        pairs = [as_mixed(*part) for part in parts]
        return torch.cat([q for q, _ in pairs]), torch.cat([scales for _, scales in pairs])
    if kind == "q4k":
        q = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8)
        return q, torch.randn(out_features, in_features // INT8_GROUP, 2, generator=gen) * 0.01
    q = torch.randint(-32, 32, shape, generator=gen, dtype=torch.int8)
    return q, torch.randn(out_features, in_features // Q6K_STEP, generator=gen) * 0.003


def _per_product(products: Sequence[Callable[[], object]], repeats: int) -> float:
    """Median seconds a product over `repeats` cycles through `products`, after one cycle."""
    for product in products:
        product()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for product in products:
            product()
        times.append((time.perf_counter() - start) / len(products))
    return statistics.median(times)


def bench_k_quants(
    shapes: tuple[tuple[int, int], ...] = SHAPES,
    rows: tuple[int, ...] = ROWS,
    *,
    footprint: int = 128 * 2**20,
    repeats: int = 15,
    threads: int = 1,
    seed: int = 0,
) -> dict[str, float]:
    """A flat dict of numbers: for each kind, shape (`{in}x{out}`) and row count, `{kind}_{shape}_
    r{rows}_{contender}_us` for the kind and its `fp32` and `torch` contenders, and
    `..._speedup` (the fp32 kernel's time over the kind's); `{kind}_{shape}_{contender}_bytes`
    the bytes a product reads; the read bandwidth."""
    if not blocked_kernels_available(torch.device("cpu")):
        raise RuntimeError("ragspeed's CPU kernels could not be built here")
    if footprint < 1 or repeats < 1 or threads < 1:
        raise ValueError(
            f"footprint, repeats and threads must be >= 1, got {footprint}, {repeats}, {threads}"
        )
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    probe = BandwidthProbe()
    result: dict[str, float] = {"threads": threads, "footprint_bytes": footprint, "repeats": repeats}
    for kind in KINDS:
        for in_features, out_features in shapes:
            shape = f"{in_features}x{out_features}"
            q, scales = _k_quant(kind, in_features, out_features, gen)
            weight = kernel_dequantize(q, scales)
            own, fp32 = BlockedWeight(q, None, scales), BlockedWeight(weight)
            # copies in memory of their own, as many as fill the footprint
            weights = {
                kind: [BlockedWeight(q, None, scales) for _ in range(-(-footprint // own.num_bytes))],
                "fp32": [BlockedWeight(weight) for _ in range(-(-footprint // fp32.num_bytes))],
            }
            dense = [weight.clone() for _ in range(-(-footprint // fp32.num_bytes))]
            result[f"{kind}_{shape}_{kind}_bytes"] = own.num_bytes
            result[f"{kind}_{shape}_fp32_bytes"] = fp32.num_bytes
            for num_rows in rows:
                x = torch.randn(num_rows, in_features, generator=gen)
                key = f"{kind}_{shape}_r{num_rows}"
                for name, blocked in weights.items():
                    products = [partial(w.forward, x, threads) for w in blocked]
                    result[f"{key}_{name}_us"] = _per_product(products, repeats) * 1e6
                torch_products = [partial(torch.mm, x, w.t()) for w in dense]
                result[f"{key}_torch_us"] = _per_product(torch_products, repeats) * 1e6
                result[f"{key}_speedup"] = result[f"{key}_fp32_us"] / result[f"{key}_{kind}_us"]
    result.update(probe.finish())
    return result


def print_table(result: dict[str, float], shapes, rows, echo=click.echo) -> None:
    """One line a kind, shape and row count: each contender's microseconds a product, the
    bounds of the K-quant and fp32 kernels, and the speedup over fp32."""
    bandwidth = result["read_bandwidth_gb_s"] * 1e3  # bytes per microsecond
    echo(f"read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s; bound = weight bytes / bandwidth")
    echo(
        f"{'kind':<5} {'in x out':>10} {'rows':>4} {'K-quant us':>11} {'bound':>6} "
        f"{'fp32 us':>8} {'bound':>6} {'torch us':>9} {'speedup':>8}"
    )
    for kind in KINDS:
        for in_features, out_features in shapes:
            shape = f"{in_features}x{out_features}"
            own, fp32 = (result[f"{kind}_{shape}_{name}_bytes"] / bandwidth for name in (kind, "fp32"))
            for num_rows in rows:
                key = f"{kind}_{shape}_r{num_rows}"
                echo(
                    f"{kind:<5} {shape:>10} {num_rows:>4} {result[f'{key}_{kind}_us']:>11.1f} {own:>6.1f} "
                    f"{result[f'{key}_fp32_us']:>8.1f} {fp32:>6.1f} {result[f'{key}_torch_us']:>9.1f} "
                    f"{result[f'{key}_speedup']:>7.2f}x"
                )


@click.command("kquant")
@json_option
@threads_option
@click.option("--repeats", default=15, type=int, help="cycles per figure; the median is reported")
@click.option(
    "--footprint-mib", default=128, type=int, help="MiB of weight copies each contender cycles over"
)
@click.option(
    "--shape",
    "shape_names",
    multiple=True,
    help="one of the shapes (in x out, e.g. 576x960) to run, repeatable; default: all",
)
def bench_kquant(
    json_path: str | None, threads: int, repeats: int, footprint_mib: int, shape_names: tuple[str, ...]
) -> None:
    """K-quant products on their blocks against the fp32 product of the dequantized weights."""
    known = [f"{i}x{o}" for i, o in SHAPES]
    unknown = sorted(set(shape_names) - set(known))
    if unknown:
        raise click.UsageError(f"unknown shape {', '.join(unknown)}; these run: {', '.join(known)}")
    shapes = tuple(s for s, name in zip(SHAPES, known, strict=True) if not shape_names or name in shape_names)
    try:
        result = bench_k_quants(
            shapes, ROWS, footprint=footprint_mib * 2**20, repeats=repeats, threads=threads
        )
    except (RuntimeError, ValueError) as error:
        raise click.UsageError(str(error)) from error
    click.echo(machine_line(threads))
    click.echo(f"cpu: {read_cpu_features().describe()}")
    print_table(result, shapes, ROWS)
    write_json(Path(json_path) if json_path else None, result)
