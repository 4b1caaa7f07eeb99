"""`ragspeed bench prefill`: TTFT of one long prompt on each prefill path of a GGUF model,
alternated in one process, with where the time goes.

One engine (serve's defaults: `--quantization auto`, the file's blocks) is moved from path to
path (engine.quant.gate.use_prefill_path) between runs, so every path sees the same model,
threads and machine; each run is a fresh random prompt (no prefix cache hit), the paths taking
turns in each round so that other work on a shared machine slows them alike; the median of the
rounds is reported, with the ratio to fp32 (of the medians, and the median of each round's
ratio to the fp32 run beside it) and each path's start-up gate figures (against fp32 prefill of
the same weights: engine.precision).

Where the time goes, per path: attention's share of one prefill (torch's profiler, as `bench
engine`), and the products' share: one layer's four projections (QKV, output, gate-up, down)
timed on as many rows as the prompt, alternated between the paths, times the number of layers,
over the TTFT. Their rate (GFLOP/s) against fp32's is the kernels' own speed-up; the rest of a
prefill (attention, norms, rotary, the KV writes) does not change with the path, so TTFT's
ratio to fp32 cannot fall below that rest's share. Prints the CPU and its capabilities, a table
and one line of JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import click
import torch

from ragspeed.bench.common import json_option, model_option, threads_option, write_json
from ragspeed.engine.model_zoo import DEFAULT_MODEL_NAME


def _projections(model: Any) -> dict[str, Any]:
    """The first layer's four projections (every layer has the same shapes)."""
    layer = model.layers[0]
    return {
        "qkv": layer.self_attn.qkv_proj,
        "o": layer.self_attn.o_proj,
        "gate_up": layer.mlp.gate_up_proj,
        "down": layer.mlp.down_proj,
    }


def _products_seconds(model: Any, paths: list, rows: int, repeats: int) -> dict[str, float]:
    """Per path, the median time of one layer's four projections on `rows` random rows, the
    paths alternated in each round (the first round warms up)."""
    from ragspeed.engine.quant.gate import use_prefill_path

    generator = torch.Generator().manual_seed(1)
    inputs = {
        name: torch.randn(rows, linear.in_features, generator=generator)
        for name, linear in _projections(model).items()
    }
    times: dict[str, list[float]] = {p.name: [] for p in paths}
    for round_ in range(repeats + 1):
        for path in paths:
            use_prefill_path(model, path)
            start = time.perf_counter()
            for name, linear in _projections(model).items():
                linear(inputs[name])
            if round_:
                times[path.name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _layer_flop(model: Any, rows: int) -> float:
    """Multiply-adds of one layer's projections on `rows` rows, as FLOP (2 a multiply-add)."""
    return sum(2.0 * rows * p.in_features * p.out_features for p in _projections(model).values())


def run_prefill_paths(
    model: str = DEFAULT_MODEL_NAME, prompt_len: int = 2048, repeats: int = 3, threads: int = 2
) -> dict[str, Any]:
    from ragspeed.bench.engine import _NativeContender, _random_prompt
    from ragspeed.engine.config import EngineConfig
    from ragspeed.engine.cpu_features import read_cpu_features
    from ragspeed.engine.factory import build_llm_engine
    from ragspeed.engine.models.linear import BLOCKS_PATHS, DENSE_PREFILL_PATHS
    from ragspeed.engine.quant.gate import use_prefill_path

    torch.set_num_threads(threads)
    config = EngineConfig(model=model, max_model_len=prompt_len + 8, quantization="auto", num_threads=threads)
    engine = build_llm_engine(config)
    features = read_cpu_features()
    paths = [DENSE_PREFILL_PATHS[-1], *(p for p in BLOCKS_PATHS if p.missing(features) is None)]
    contender = _NativeContender(engine)
    generator = torch.Generator().manual_seed(0)
    vocab = engine.arch.vocab_size
    times: dict[str, list[float]] = {p.name: [] for p in paths}
    for round_ in range(repeats + 1):  # the first round warms up
        for path in paths:
            use_prefill_path(engine.loaded.model, path)
            ttft = contender.ttft(_random_prompt(generator, prompt_len, vocab))
            if round_:
                times[path.name].append(ttft)
    attention_share = {}
    for path in paths:
        use_prefill_path(engine.loaded.model, path)
        attention_share[path.name] = contender.attention_share(_random_prompt(generator, prompt_len, vocab))[
            0
        ]
    products = _products_seconds(engine.loaded.model, paths, prompt_len, repeats)
    chosen = engine.prefill_choice.path if engine.prefill_choice is not None else paths[0]
    use_prefill_path(engine.loaded.model, chosen)
    num_layers = len(engine.loaded.model.layers)
    layer_flop = _layer_flop(engine.loaded.model, prompt_len)
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    fp32 = paths[0].name
    # Each round's ratio to fp32's run beside it, then their median: robust to a round that other
    # work on the machine slowed throughout.
    paired = {
        name: statistics.median(t / f for t, f in zip(runs, times[fp32]))
        for name, runs in times.items()
        if name != fp32
    }
    reports = {} if engine.prefill_choice is None else engine.prefill_choice.reports
    result: dict[str, Any] = {
        "model": config.model,
        "cpu": features.describe(),
        "load_average": os.getloadavg(),
        "threads": threads,
        "prompt_len": prompt_len,
        "repeats": repeats,
        "chosen_prefill_path": chosen.name,
        **{f"ttft_ms_{name}": value for name, value in medians.items()},
        **{f"ttft_runs_ms_{name}": [t * 1e3 for t in runs] for name, runs in times.items()},
        **{f"over_fp32_{name}": value / medians[fp32] for name, value in medians.items() if name != fp32},
        **{f"paired_over_fp32_{name}": ratio for name, ratio in paired.items()},
        **{f"attention_share_{name}": share for name, share in attention_share.items()},
        **{f"products_gflops_{name}": layer_flop / s / 1e9 for name, s in products.items()},
        **{f"products_share_{name}": num_layers * s * 1e3 / medians[name] for name, s in products.items()},
        **{
            f"gate_{name}": {"ppl_increase": r.ppl_increase, "top1_agreement": r.top1_agreement}
            for name, r in reports.items()
        },
    }
    _print(result, paths, reports)
    return result


def _print(result: dict[str, Any], paths: list, reports: dict) -> None:
    fp32 = paths[0].name
    print(f"{result['cpu']}; load average {result['load_average']}; {result['threads']} threads")
    print(
        f"TTFT of {result['prompt_len']} tokens, median of {result['repeats']} alternated rounds; "
        f"chosen: {result['chosen_prefill_path']}"
    )
    for path in paths:
        name = path.name
        line = f"  {name:14s} {result[f'ttft_ms_{name}']:9.1f} ms"
        if name != fp32:
            line += f"  {result[f'over_fp32_{name}']:.2f}x fp32 (per round {result[f'paired_over_fp32_{name}']:.2f}x)"
        line += (
            f"; products {result[f'products_gflops_{name}']:.0f} GFLOP/s, "
            f"{result[f'products_share_{name}']:.0%} of TTFT; attention {result[f'attention_share_{name}']:.0%}"
        )
        gate = reports.get(name)
        if gate:
            line += f"; gate: top-1 {gate.top1_agreement:.2%}, ppl {gate.ppl_increase:+.3%}"
        print(line)
    print(json.dumps(result))


@click.command("prefill")
@model_option
@json_option
@click.option("--prompt-len", default=2048, show_default=True, help="tokens of the prompt")
@click.option("--repeats", default=3, show_default=True, help="alternated rounds; the median is reported")
@threads_option
def bench_prefill(model: str, json_path: str | None, prompt_len: int, repeats: int, threads: int) -> None:
    """TTFT of one long prompt on each prefill path of a GGUF model (fp32, int8-blocks,
    int16-blocks), alternated in one process, with the start-up gate's figures, the products'
    rate and share of the time, and attention's share."""
    start = time.perf_counter()
    result = run_prefill_paths(model, prompt_len, repeats, threads)
    write_json(json_path, result)
    print(f"ran in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    bench_prefill()
