"""TTFT of one long prompt on each prefill path of a GGUF model, alternated in one process:
`python -m ragspeed.bench.prefill_paths [--model M] [--prompt-len 2048] [--repeats 3]`.

One engine (serve's defaults: `--quantization auto`, the file's blocks) is moved from path to
path (engine.quant.gate.use_prefill_path) between runs, so every path sees the same model,
threads and machine; each run is a fresh random prompt (no prefix cache hit), the paths taking
turns in each round so that other work on a shared machine slows them alike; the median of the
rounds is reported, with the ratio to fp32 (of the medians, and the median of each round's
ratio to the fp32 run beside it) and each path's start-up gate figures (against fp32
prefill of the same weights: engine.precision). Prints a table and one line of JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import click
import torch

from ragspeed.engine.model_zoo import DEFAULT_MODEL_NAME


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
    chosen = engine.prefill_choice.path if engine.prefill_choice is not None else paths[0]
    use_prefill_path(engine.loaded.model, chosen)
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    fp32_runs = times[paths[0].name]
    # Each round's ratio to fp32's run beside it, then their median: robust to a round that other
    # work on the machine slowed throughout.
    paired = {
        name: statistics.median(t / f for t, f in zip(runs, fp32_runs))
        for name, runs in times.items()
        if name != paths[0].name
    }
    reports = {} if engine.prefill_choice is None else engine.prefill_choice.reports
    result: dict[str, Any] = {
        "model": model,
        "cpu": features.describe(),
        "load_average": os.getloadavg(),
        "threads": threads,
        "prompt_len": prompt_len,
        "repeats": repeats,
        "chosen_prefill_path": chosen.name,
        **{f"ttft_ms_{name}": value for name, value in medians.items()},
        **{f"ttft_runs_ms_{name}": [t * 1e3 for t in runs] for name, runs in times.items()},
        **{
            f"over_fp32_{name}": value / medians[paths[0].name]
            for name, value in medians.items()
            if name != paths[0].name
        },
        **{f"paired_over_fp32_{name}": ratio for name, ratio in paired.items()},
        **{
            f"gate_{name}": {"ppl_increase": r.ppl_increase, "top1_agreement": r.top1_agreement}
            for name, r in reports.items()
        },
    }
    print(f"{result['cpu']}; load average {result['load_average']}; {threads} threads")
    print(f"TTFT of {prompt_len} tokens, median of {repeats} alternated rounds; chosen: {chosen.name}")
    for name, value in medians.items():
        ratio = value / medians[paths[0].name]
        gate = reports.get(name)
        figures = f"; gate: top-1 {gate.top1_agreement:.2%}, ppl {gate.ppl_increase:+.3%}" if gate else ""
        pair = f" (per round {paired[name]:.2f}x)" if name in paired else ""
        print(f"  {name:14s} {value:9.1f} ms  {ratio:.2f}x fp32{pair}{figures}")
    print(json.dumps(result))
    return result


@click.command()
@click.option("--model", default=DEFAULT_MODEL_NAME, show_default=True)
@click.option("--prompt-len", default=2048, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--threads", default=2, show_default=True)
def main(model: str, prompt_len: int, repeats: int, threads: int) -> None:
    start = time.perf_counter()
    run_prefill_paths(model, prompt_len, repeats, threads)
    print(f"ran in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
