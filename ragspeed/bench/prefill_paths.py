"""`ragspeed bench prefill`: TTFT of one long prompt on each prefill path of a GGUF model,
alternated in one process, with where the time goes.

One engine (serve's defaults: `--quantization auto`, the file's blocks) is moved from setup to
setup between runs: a prefill path (engine.native.core.quality_gate.use_prefill_path) and its
attention, the CPU kernel or SDPA's flash kernel (ModelRunner.prefill_kernel). The reference is
fp32 with SDPA's attention (`fp32+sdpa`, the engine's prefill before its attention kernel); every
path then runs with the kernel, and the served path once more with the kernel's products on
int16 (`+int16-attention`, where the start-up gate may offer it). So every setup sees the same
model, threads and machine; each run is a fresh random prompt (no prefix cache hit), the setups
taking turns in each round so that other work on a shared machine slows them alike; the median
of the rounds is reported, with the ratio to the reference (of the medians, and the median of
each round's ratio to the reference's run beside it) and each path's start-up gate figures
(against fp32 prefill of the same weights: engine.native.core.precision).

Where the time goes, per path, in one more prefill under torch's profiler: attention's share of
its time (as `bench engine` measures it) and the projections' (QKV, output, gate-up, down of
every layer), with their rate (GFLOP/s): against fp32's, the kernels' own speed-up. The rest of
a prefill (attention, norms, rotary, the KV writes) does not change with the path, so TTFT's
ratio to fp32 with the same attention cannot fall below that rest's share. Prints the CPU and
its capabilities, a table and one line of JSON.

`--per-projection` adds which products int8 activations can take: the model with int8 rows in
one kind of projection only (every layer's QKV, output, gate-up or down; the others on
int16-blocks), against fp32 prefill of the same weights on windows of the shipped WikiText-2
text (top-1 agreement, perplexity: engine.native.core.quality), beside all-int8 and all-int16.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ragspeed.bench.common import (
    json_option,
    model_option,
    qa_data_option,
    threads_option,
    write_json,
)
from ragspeed.bench.tokens import random_prompt
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME
from ragspeed.shipped_data import NQ_QUESTIONS


def _projections(model: Any) -> dict[str, Any]:
    """The first layer's four projections (every layer has the same shapes)."""
    return _projections_of(model.layers[0])


def _projections_of(layer: Any) -> dict[str, Any]:
    """A decoder layer's four projections by kind."""
    return {
        "qkv": layer.self_attn.qkv_proj,
        "o": layer.self_attn.o_proj,
        "gate_up": layer.mlp.gate_up_proj,
        "down": layer.mlp.down_proj,
    }


PRODUCTS_EVENT = "ragspeed::prefill_products"  # the profiler's range around each projection


@contextlib.contextmanager
def _products_recorded(model: Any) -> Iterator[None]:
    """Every layer's projections inside a `PRODUCTS_EVENT` range of torch's profiler."""
    wrapped = [linear for layer in model.layers for linear in _projections_of(layer).values()]

    def recorded(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            with record_function(PRODUCTS_EVENT):
                return forward(x)

        return run

    for linear in wrapped:
        linear.forward = recorded(linear.forward)
    try:
        yield
    finally:
        for linear in wrapped:
            del linear.forward  # the class's forward again


def _where_time_goes(contender: Any, model: Any, prompt: tuple[int, ...]) -> tuple[float, float, float]:
    """One prefill under torch's profiler: (attention's share of its time, the projections'
    share, the projections' seconds)."""
    from ragspeed.engine.native.compute.attention import PREFILL_ATTENTION_EVENT

    with _products_recorded(model), profile(activities=[ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        contender.ttft(prompt)
        elapsed = time.perf_counter() - start
    totals = {e.key: e.cpu_time_total / 1e6 for e in profiler.key_averages()}
    attention, products = totals.get(PREFILL_ATTENTION_EVENT, 0.0), totals.get(PRODUCTS_EVENT, 0.0)
    return attention / elapsed, products / elapsed, products


def _per_projection_quality(engine: Any, num_windows: int = 16, window: int = 128) -> dict[str, Any]:
    """Top-1 agreement and perplexity against fp32 prefill with int8 rows in one kind of
    projection (the others int16-blocks), and in all or none of them."""
    from ragspeed.engine.native.core.quality import compare_logits, text_windows
    from ragspeed.engine.native.core.quality_gate import use_prefill_path
    from ragspeed.engine.native.core.window_logits import window_logits
    from ragspeed.engine.native.models.linear import DENSE_PREFILL_PATHS, INT8_BLOCKS, INT16_BLOCKS
    from ragspeed.shipped_data import WIKITEXT

    loaded, model = engine.loaded, engine.loaded.model
    windows = text_windows(engine.tokenizer, WIKITEXT, window=window, num_windows=num_windows)
    use_prefill_path(model, DENSE_PREFILL_PATHS[-1])
    reference = {tuple(ids): window_logits(loaded, ids) for ids in windows}
    settings: dict[str, tuple[Any, str | None]] = {
        "all_int16": (INT16_BLOCKS, None),
        **{f"only_{kind}_int8": (INT16_BLOCKS, kind) for kind in ("qkv", "o", "gate_up", "down")},
        "all_int8": (INT8_BLOCKS, None),
    }
    figures: dict[str, Any] = {}
    print(
        f"int8 rows by kind of projection, against fp32 prefill on {num_windows} windows of {window} tokens:"
    )
    for name, (path, int8_kind) in settings.items():
        use_prefill_path(model, path)
        for layer in model.layers:
            if int8_kind is not None:
                _projections_of(layer)[int8_kind].use_prefill(INT8_BLOCKS)
        report = compare_logits(
            lambda ids: reference[tuple(ids)], lambda ids: window_logits(loaded, ids), windows
        )
        figures[f"quality_{name}"] = {
            "top1_agreement": report.top1_agreement,
            "ppl_increase": report.ppl_increase,
        }
        print(f"  int8 rows {name:18s} top-1 {report.top1_agreement:.2%}, ppl {report.ppl_increase:+.3%}")
    figures["quality_predictions"] = report.num_predictions
    return figures


def _layer_flop(model: Any, rows: int) -> float:
    """Multiply-adds of one layer's projections on `rows` rows, as FLOP (2 a multiply-add)."""
    return sum(2.0 * rows * p.in_features * p.out_features for p in _projections(model).values())


def _prompts(vocab_size: int, prompt_len: int) -> Iterator[tuple[int, ...]]:
    """Fresh random prompts, seeded: no run hits the prefix cache of another."""
    generator = torch.Generator().manual_seed(0)
    while True:
        yield random_prompt(generator, prompt_len, vocab_size)


@dataclass(frozen=True)
class Setup:
    """A prefill path and the attention beside it: the CPU kernel (its products on int16 where
    `int16_attention`), or SDPA's (`kernel` False)."""

    path: Any  # engine.native.models.linear's PrefillPath
    kernel: bool = True
    int16_attention: bool = False

    @property
    def name(self) -> str:
        from ragspeed.engine.native.core.precision import INT16_ATTENTION

        if not self.kernel:
            return f"{self.path.name}+sdpa"
        return self.path.name + (f"+{INT16_ATTENTION}" if self.int16_attention else "")

    def use(self, engine: Any) -> None:
        from ragspeed.engine.native.core.quality_gate import use_prefill_path

        use_prefill_path(engine.loaded.model, self.path)
        engine.runner.prefill_kernel = self.kernel
        engine.runner.int16_attention = self.int16_attention


def _alternated_ttfts(
    contender: Any, setups: list[Setup], prompts: Iterator[tuple[int, ...]], repeats: int
) -> dict[str, list[float]]:
    """Each setup's TTFT (s) in `repeats` rounds, the setups taking turns in each (the first
    round warms up)."""
    times: dict[str, list[float]] = {s.name: [] for s in setups}
    for round_ in range(repeats + 1):
        for setup in setups:
            setup.use(contender.engine)
            ttft = contender.ttft(next(prompts))
            if round_:
                times[setup.name].append(ttft)
    return times


def rag_prompts(tokenizer: Any, data: Path, limit: int) -> list[tuple[int, ...]]:
    """The first `limit` questions of a QA file with their documents, as `eval rag` prompts them
    (its system prompt, every document, the gateway's layout)."""
    from ragspeed.document import Document
    from ragspeed.evals.rag import DEFAULT_SYSTEM_PROMPT, load_examples
    from ragspeed.gateway.prompt import Segments, assemble_prompt

    examples, _ = load_examples(data)
    prompts = []
    for example in examples[:limit]:
        documents = tuple(
            Document(f"{example.line}-{i}", p.text, p.title) for i, p in enumerate(example.documents)
        )
        segments = Segments(DEFAULT_SYSTEM_PROMPT, documents, (), example.question)
        prompts.append(assemble_prompt(tokenizer, segments, documents).token_ids)
    return prompts


def identical_answers(
    engine: Any, setups: list[Setup], prompts: list[tuple[int, ...]], max_tokens: int = 32
) -> dict[str, float]:
    """Each setup's share of greedy answers identical (token for token) to the first setup's,
    one request at a time; a cache salt per setup keeps one setup's KV from serving another."""
    from ragspeed.engine.protocol import GenerationRequest, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    answers: dict[str, list[tuple[int, ...]]] = {}
    for setup in setups:
        setup.use(engine)
        answers[setup.name] = []
        for i, prompt in enumerate(prompts):
            request = GenerationRequest(f"{setup.name}-{i}", prompt, sampling, cache_salt=setup.name)
            answers[setup.name].append(tuple(engine.generate([request])[request.request_id]["token_ids"]))
    exact = answers[setups[0].name]
    return {
        name: sum(a == b for a, b in zip(runs, exact)) / len(exact)
        for name, runs in answers.items()
        if name != setups[0].name
    }


def run_prefill_paths(
    model: str = DEFAULT_MODEL_NAME,
    prompt_len: int = 2048,
    repeats: int = 3,
    threads: int = 2,
    per_projection: bool = False,
    answers: int = 0,
    data: Path = NQ_QUESTIONS,
) -> dict[str, Any]:
    from ragspeed.bench.engine import _NativeContender
    from ragspeed.engine.config import EngineConfig
    from ragspeed.engine.native.compute.cpu_features import read_cpu_features
    from ragspeed.engine.native.core.factory import build_llm_engine
    from ragspeed.engine.native.models.linear import BLOCKS_PATHS, DENSE_PREFILL_PATHS

    torch.set_num_threads(threads)
    max_model_len = max(prompt_len + 8, 4096 if answers else 0)
    config = EngineConfig(model=model, max_model_len=max_model_len, quantization="auto", num_threads=threads)
    engine = build_llm_engine(config)
    features = read_cpu_features()
    fp32 = DENSE_PREFILL_PATHS[-1]
    paths = [fp32, *(p for p in BLOCKS_PATHS if p.missing(features) is None)]
    choice = engine.prefill_choice
    chosen = choice.path if choice is not None else fp32
    setups = [Setup(fp32, kernel=False), *map(Setup, paths)]
    if choice is not None and choice.plan.int16_attention:  # the served path with integer attention
        setups.append(Setup(chosen, int16_attention=True))
    answered = [*setups, *(Setup(p) for p in DENSE_PREFILL_PATHS[:-1] if p.missing(features) is None)]
    identical = (
        identical_answers(engine, answered, rag_prompts(engine.tokenizer, data, answers)) if answers else {}
    )
    contender = _NativeContender(engine)
    prompts = _prompts(engine.arch.vocab_size, prompt_len)
    times = _alternated_ttfts(contender, setups, prompts, repeats)
    shares = {}  # setup -> (attention's share, the products' share, the products' seconds)
    for setup in setups:
        setup.use(engine)
        shares[setup.name] = _where_time_goes(contender, engine.loaded.model, next(prompts))
    quality = _per_projection_quality(engine) if per_projection else {}
    Setup(chosen, int16_attention=choice is not None and choice.int16_attention).use(engine)
    products_flop = len(engine.loaded.model.layers) * _layer_flop(engine.loaded.model, prompt_len)
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    reference = setups[0].name
    # Each round's ratio to the reference's run beside it, then their median: robust to a round
    # that other work on the machine slowed throughout.
    paired = {
        name: statistics.median(t / f for t, f in zip(runs, times[reference]))
        for name, runs in times.items()
        if name != reference
    }
    reports = {} if engine.prefill_choice is None else engine.prefill_choice.reports
    result: dict[str, Any] = {
        "model": config.model,
        "cpu": features.describe(),
        "load_average": os.getloadavg(),
        "threads": threads,
        "prompt_len": prompt_len,
        "repeats": repeats,
        "chosen_prefill_path": fp32.name if choice is None else choice.name,
        "reference": reference,
        **{f"ttft_ms_{name}": value for name, value in medians.items()},
        **{f"ttft_runs_ms_{name}": [t * 1e3 for t in runs] for name, runs in times.items()},
        **{
            f"over_reference_{name}": value / medians[reference]
            for name, value in medians.items()
            if name != reference
        },
        **{f"paired_over_reference_{name}": ratio for name, ratio in paired.items()},
        **{f"attention_share_{name}": share[0] for name, share in shares.items()},
        **{f"products_share_{name}": share[1] for name, share in shares.items()},
        **{f"products_gflops_{name}": products_flop / share[2] / 1e9 for name, share in shares.items()},
        **{
            f"gate_{name}": {"ppl_increase": r.ppl_increase, "top1_agreement": r.top1_agreement}
            for name, r in reports.items()
        },
        **quality,
        **({"answers": answers} if answers else {}),
        **{f"identical_answers_{name}": share for name, share in identical.items()},
    }
    _print(result, setups, reports)
    return result


def _print(result: dict[str, Any], setups: list[Setup], reports: dict) -> None:
    reference = result["reference"]
    print(f"{result['cpu']}; load average {result['load_average']}; {result['threads']} threads")
    print(
        f"TTFT of {result['prompt_len']} tokens, median of {result['repeats']} alternated rounds; "
        f"chosen: {result['chosen_prefill_path']}; attention in the CPU kernel, {reference} with SDPA's"
    )
    width = max(len(setup.name) for setup in setups)
    for setup in setups:
        name = setup.name
        line = f"  {name:{width}s} {result[f'ttft_ms_{name}']:9.1f} ms"
        if name != reference:
            line += (
                f"  {result[f'over_reference_{name}']:.2f}x {reference} "
                f"(per round {result[f'paired_over_reference_{name}']:.2f}x)"
            )
        line += (
            f"; products {result[f'products_gflops_{name}']:.0f} GFLOP/s, "
            f"{result[f'products_share_{name}']:.0%} of TTFT; attention {result[f'attention_share_{name}']:.0%}"
        )
        from ragspeed.engine.native.core.precision import INT16_ATTENTION

        gate = (
            reports.get(INT16_ATTENTION if setup.int16_attention else setup.path.name)
            if setup.kernel
            else None
        )
        if gate:
            line += f"; gate: top-1 {gate.top1_agreement:.2%}, ppl {gate.ppl_increase:+.3%}"
        print(line)
    if "answers" in result:
        shares = [
            f"{k.removeprefix('identical_answers_')} {v:.1%}"
            for k, v in result.items()
            if k.startswith("identical_answers_")
        ]
        print(
            f"greedy answers identical to {reference}'s, {result['answers']} RAG questions: {', '.join(shares)}"
        )
    print(json.dumps(result))


@click.command("prefill")
@model_option
@json_option
@click.option("--prompt-len", default=2048, show_default=True, help="tokens of the prompt")
@click.option("--repeats", default=3, show_default=True, help="alternated rounds; the median is reported")
@threads_option
@click.option(
    "--per-projection",
    is_flag=True,
    help="also measure quality with int8 rows in one kind of projection only (the others int16)",
)
@click.option(
    "--answers",
    default=0,
    type=click.IntRange(min=0),
    show_default=True,
    help="also answer this many RAG questions greedily on every path: the share identical to the reference's",
)
@qa_data_option("QA jsonl the --answers questions come from (nq_dev.jsonl)")
def bench_prefill(
    model: str,
    json_path: str | None,
    prompt_len: int,
    repeats: int,
    threads: int,
    per_projection: bool,
    answers: int,
    data: Path,
) -> None:
    """TTFT of one long prompt on each prefill path of a GGUF model (fp32, int8-blocks,
    int16-blocks) with the CPU attention kernel, the served one also with that kernel's products
    on int16, and on fp32 with SDPA's attention (the reference), alternated in one process, with the start-up gate's figures, the products' rate
    and share of the time, and attention's share."""
    start = time.perf_counter()
    result = run_prefill_paths(model, prompt_len, repeats, threads, per_projection, answers, data)
    write_json(json_path, result)
    print(f"ran in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    bench_prefill()
