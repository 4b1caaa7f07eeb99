"""`ragspeed bench quant`: int8 weights (and a GGUF file's own blocks) against fp32 in the native
engine, and transformers fp32.

Figures (one run, after a warm-up, medians of `repeats` runs; JSON keys in brackets):
- time per output token at batch 1 of native int8, native fp32 and transformers fp32
  [int8_tpot_ms, fp32_tpot_ms, transformers_tpot_ms], each beside its bandwidth bound: weight
  bytes read per token / read bandwidth measured in this run [int8_tpot_bound_ms,
  fp32_tpot_bound_ms; transformers reads the fp32 bytes];
- time to first token of a `ttft_prompt_len`-token prompt, int8 and fp32 [int8_ttft_512_ms,
  fp32_ttft_512_ms];
- resident weight bytes [int8_weight_bytes, fp32_weight_bytes];
- for a GGUF model, the same timings of its own blocks [gguf_tpot_ms, gguf_tpot_bound_ms,
  gguf_ttft_512_ms, gguf_weight_bytes] and their decode's quality against fp32, which is the
  file's dequantized weights [gguf_decode_ppl_increase, gguf_decode_top1_agreement,
  gguf_decode_logit_rms_error];
- quality of int8 against fp32 on `text` (see engine.native.core.quality) [ppl_increase (a fraction),
  top1_agreement, logit_rms_error, ppl_fp32, ppl_int8], of the int8 prefill path the quality
  gate chose (engine.native.core.quality_gate) [int8_prefill_path; None: no path passed]; of the int8 decode
  kernels, teacher-forced on the same windows [decode_ppl_increase, decode_top1_agreement,
  decode_logit_rms_error]; and of every
  prefill path this CPU runs against the fp32 model: the int8 ones (fbgemm-u8, bf16-dequantized,
  fp32-dequantized) and, where the CPU has AMX-BF16 or AVX512-BF16, the fp32 model's bf16 prefill
  [quality_<path>_<figure>]; the CPU's capability line [cpu] and each engine's prefill line
  [<engine>_prefill].
Targets, on bench-0.5b: int8_tpot_ms <= 2.5 x int8_tpot_bound_ms; fp32/int8 TPOT >= 3;
int8 TTFT no worse than fp32. On the default model: ppl increase <= 1%, top-1
agreement >= 97% (prefill and decode), fp32/int8 TPOT >= 2.4. A *ratio* divides two contenders' times;
`*_over_bound` a time by its bound.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import click
import torch

from ragspeed.bench.common import (
    json_option,
    machine_line,
    model_option,
    prefill_line,
    repeats_option,
    require_positive,
    threads_option,
    transformers_option,
    write_json,
)
from ragspeed.bench.engine import (
    BandwidthProbe,
    _NativeContender,
    _TransformersContender,
)
from ragspeed.bench.tokens import random_prompt
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME
from ragspeed.shipped_data import WIKITEXT


@dataclass(frozen=True)
class _QualityReports:
    """Every quality comparison against the fp32 model (engine.native.core.quality's reports)."""

    int8: dict[str, Any]  # by int8 prefill path
    dense: dict[str, Any]  # the fp32 model's faster prefill paths
    decode: Any  # the int8 decode kernels, teacher-forced
    kv_fp16: Any  # the fp16 KV cache alone (fp32 weights)
    gguf: dict[str, Any]  # "gguf_decode" and "default", for a GGUF model
    int8_path: Any  # the prefill path the gate chose; None: none passed
    timed_path_name: str  # the path the timings run on (the most precise one where none passed)


def run_bench_quant(
    model: str = DEFAULT_MODEL_NAME,
    json_path: str | None = None,
    *,
    text: str,
    prompt_len: int = 64,
    output_len: int = 32,
    ttft_prompt_len: int = 512,
    repeats: int = 3,
    threads: int = 2,
    with_transformers: bool = True,
    quality_window: int = 128,
    quality_windows: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure int8 vs fp32 (and transformers); print a table, return flat JSON."""
    from ragspeed.engine.native.compute.cpu_features import read_cpu_features
    from ragspeed.engine.native.loading.loader import resolve_model_path

    sizes = dict(
        prompt_len=prompt_len, output_len=output_len, ttft_prompt_len=ttft_prompt_len, repeats=repeats
    )
    require_positive(**sizes, threads=threads, quality_window=quality_window, quality_windows=quality_windows)
    if output_len < 2:
        raise ValueError(f"output_len must be >= 2 (a TPOT needs two tokens), got {output_len}")
    if not Path(text).is_file():
        raise ValueError(f"text {text!r} is not a file")
    torch.set_num_threads(threads)
    path = resolve_model_path(model)
    max_model_len = max(prompt_len + output_len, ttft_prompt_len + 1, quality_window)
    engines = _build_engines(path, max_model_len, seed)
    contenders: dict[str, Any] = {name: _NativeContender(e) for name, e in engines.items()}
    if with_transformers:
        contenders["transformers"] = _TransformersContender(path)
    features = read_cpu_features()
    quality = _measure_quality(engines, features, threads, text, quality_window, quality_windows)
    probe = BandwidthProbe()
    results: dict[str, Any] = {
        "model": model,
        "cpu": features.describe(),
        "int8_prefill_path": None if quality.int8_path is None else quality.int8_path.name,
        **{f"{name}_prefill": prefill_line(engine) for name, engine in engines.items()},
        **{
            f"quality_{name}_{key}": value
            for name, report in {**quality.int8, **quality.dense}.items()
            for key, value in asdict(report).items()
        },
        "threads": threads,
        "load_avg_1m": os.getloadavg()[0],
        "prompt_len": prompt_len,
        "output_len": output_len,
        "repeats": repeats,
    }
    vocab = engines["fp32"].arch.vocab_size
    results.update(_measure_times(contenders, list(engines), vocab, seed=seed, **sizes))
    results.update(probe.finish())
    _add_bounds(results, engines, probe.bandwidth, ttft_prompt_len, with_transformers)
    results.update(_quality_figures(quality))
    results.update(_targets(results))
    print_table(results, ttft_prompt_len)
    write_json(json_path, results)
    return results


def _build_engines(path: Path, max_model_len: int, seed: int) -> dict[str, Any]:
    """Native engines by name: int8, fp32 and, when the model is a GGUF file, its own blocks
    (engine.native.compute.quant.gguf_blocks)."""
    from ragspeed.engine.native.core.factory import build_llm_engine
    from ragspeed.engine.native.loading.gguf import source_of

    kinds = {"int8": "int8", "fp32": None, **({"gguf": "gguf"} if source_of(path) is not None else {})}
    return {
        name: build_llm_engine(
            EngineConfig(
                model=str(path),
                dtype="float32",  # the reference and the int8 timings: no bf16 dense prefill
                quantization=quantization,
                max_model_len=max_model_len,
                num_kv_cache_tokens=max_model_len + 1024,
                max_num_seqs=4,
                enable_prefix_caching=False,  # repeated prompts must not hit the cache
                seed=seed,
            )
        )
        for name, quantization in kinds.items()
    }


def _measure_quality(
    engines: dict[str, Any], features: Any, threads: int, text: str, window: int, num_windows: int
) -> _QualityReports:
    """Every engine's logits against the fp32 model's on `num_windows` windows of `text`. Leaves
    the int8 model on the prefill path the gate chose, the fp32 model on fp32."""
    from ragspeed.engine.native.compute.quant.prefill import prefill_candidates, runnable_paths
    from ragspeed.engine.native.compute.quant.probe import machine_probe
    from ragspeed.engine.native.core.quality import compare_logits, text_windows
    from ragspeed.engine.native.core.quality_gate import gate_prefill, use_prefill_path
    from ragspeed.engine.native.core.window_logits import decode_window_logits, window_logits
    from ragspeed.engine.native.models.linear import BLOCKS_PATHS, DENSE_PREFILL_PATHS

    windows = text_windows(engines["fp32"].tokenizer, text, window=window, num_windows=num_windows)
    int8_loaded, fp32_loaded = engines["int8"].loaded, engines["fp32"].loaded
    reference = {tuple(ids): window_logits(fp32_loaded, ids) for ids in windows}

    def against_fp32(logits) -> Any:
        return compare_logits(lambda ids: reference[tuple(ids)], logits, windows)

    def prefill_against_fp32(loaded, path) -> Any:
        use_prefill_path(loaded.model, path)
        return against_fp32(lambda ids: window_logits(loaded, ids))

    # The prefill paths fastest first, as the engines' start-up measured (or read) them.
    path_probe = machine_probe(engines["fp32"].arch.hidden_size, threads)
    candidates = prefill_candidates(features, path_probe)
    int8_reports = {p.name: prefill_against_fp32(int8_loaded, p) for p in candidates}
    decode_report = against_fp32(lambda ids: decode_window_logits(int8_loaded, ids))
    # The fp16 KV cache alone (fp32 weights), and with the file's blocks: serve's default path.
    kv_fp16_report = against_fp32(lambda ids: window_logits(fp32_loaded, ids, kv_dtype=torch.float16))
    gguf_reports = {}
    if "gguf" in engines:  # its decode reads the blocks; its prefill, each path the CPU runs
        gguf = engines["gguf"]
        gguf_reports = {
            name: against_fp32(partial(decode_window_logits, gguf.loaded, kv_dtype=kv_dtype))
            for name, kv_dtype in (("gguf_decode", torch.float32), ("default", torch.float16))
        }
        # The integer prefill paths on the file's blocks against the fp32 model of its
        # weights: the gate that makes one of them serve's default (engine.native.core.precision).
        for path in BLOCKS_PATHS:
            if path.missing(features) is None:
                name = "gguf_prefill_" + path.name.replace("-", "_")
                gguf_reports[name] = prefill_against_fp32(gguf.loaded, path)
        if gguf.prefill_choice is not None:  # back on the path its start-up chose
            use_prefill_path(gguf.loaded.model, gguf.prefill_choice.path)
    outcome = gate_prefill(candidates, lambda p: int8_reports[p.name])
    # The timings run on the chosen path (the most precise one where none passed).
    timed_path = outcome.path or candidates[-1]
    use_prefill_path(int8_loaded.model, timed_path)
    # The fp32 model's own faster paths (bf16 where the CPU has it), then back on fp32.
    dense_reports = {
        p.name: prefill_against_fp32(fp32_loaded, p)
        for p in runnable_paths(DENSE_PREFILL_PATHS, features, path_probe)[:-1]
    }
    use_prefill_path(fp32_loaded.model, DENSE_PREFILL_PATHS[-1])
    return _QualityReports(
        int8_reports,
        dense_reports,
        decode_report,
        kv_fp16_report,
        gguf_reports,
        outcome.path,
        timed_path.name,
    )


def _measure_times(
    contenders: dict[str, Any],
    engine_names: list[str],
    vocab: int,
    *,
    prompt_len: int,
    output_len: int,
    ttft_prompt_len: int,
    repeats: int,
    seed: int,
) -> dict[str, float]:
    """Medians of `repeats` runs: every contender's TPOT at batch 1, the native engines' TTFT."""
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for contender in contenders.values():  # warm-up: prefill and decode paths once
            contender.tpot(random_prompt(gen, 32, vocab), 4)
        # Contenders alternate within each repeat, so a change of the machine's speed during
        # the run (this VM's read bandwidth switches between ~33 and ~55 GB/s) reaches all of
        # them alike instead of tilting the ratios; medians over the repeats.
        tpots: dict[str, list[float]] = {name: [] for name in contenders}
        ttfts: dict[str, list[float]] = {name: [] for name in engine_names}
        for _ in range(repeats):
            prompt = random_prompt(gen, prompt_len, vocab)
            for name, contender in contenders.items():
                tpots[name].append(contender.tpot(prompt, output_len))
        for _ in range(repeats):
            prompt = random_prompt(gen, ttft_prompt_len, vocab)
            for name in engine_names:
                ttfts[name].append(contenders[name].ttft(prompt))
    return {
        **{f"{name}_tpot_ms": statistics.median(times) * 1e3 for name, times in tpots.items()},
        **{
            f"{name}_ttft_{ttft_prompt_len}_ms": statistics.median(times) * 1e3
            for name, times in ttfts.items()
        },
    }


def _add_bounds(
    results: dict[str, Any], engines: dict[str, Any], bandwidth: float, ttft_len: int, with_transformers: bool
) -> None:
    """Each engine's weight bytes and TPOT bound; the ratios between contenders."""
    for name, engine in engines.items():
        stats = engine.stats()
        results[f"{name}_weight_bytes"] = int(stats["weight_bytes"])
        per_token = engine.loaded.model.num_weight_bytes_per_token
        results[f"{name}_weight_bytes_per_token"] = per_token
        results[f"{name}_tpot_bound_ms"] = per_token / bandwidth * 1e3
        results[f"{name}_tpot_over_bound"] = results[f"{name}_tpot_ms"] / results[f"{name}_tpot_bound_ms"]
    results["fp32_over_int8_tpot"] = results["fp32_tpot_ms"] / results["int8_tpot_ms"]
    results["int8_over_fp32_ttft"] = results[f"int8_ttft_{ttft_len}_ms"] / results[f"fp32_ttft_{ttft_len}_ms"]
    if with_transformers:
        results["transformers_tpot_bound_ms"] = results["fp32_tpot_bound_ms"]
        results["transformers_tpot_over_bound"] = (
            results["transformers_tpot_ms"] / results["transformers_tpot_bound_ms"]
        )


def _quality_figures(quality: _QualityReports) -> dict[str, Any]:
    """The timed int8 path's figures, the decode kernels', the fp16 KV cache's and a GGUF
    file's blocks' (with their targets)."""
    timed = quality.int8[quality.timed_path_name]
    figures: dict[str, Any] = {
        "quality_tokens": timed.num_predictions,
        "ppl_fp32": timed.ppl_reference,
        "ppl_int8": timed.ppl_quantized,
        "ppl_increase": timed.ppl_increase,
        "top1_agreement": timed.top1_agreement,
        "logit_rms_error": timed.logit_rms_error,
    }
    for name, report in (("decode", quality.decode), ("kv_fp16", quality.kv_fp16)):
        figures[f"{name}_ppl_increase"] = report.ppl_increase
        figures[f"{name}_top1_agreement"] = report.top1_agreement
        figures[f"{name}_logit_rms_error"] = report.logit_rms_error
    for name, report in quality.gguf.items():
        figures[f"{name}_ppl_increase"] = report.ppl_increase
        figures[f"{name}_top1_agreement"] = report.top1_agreement
        figures[f"{name}_logit_rms_error"] = report.logit_rms_error
        if name.startswith("gguf_prefill_"):  # the prefill gate (engine.native.core.precision.PREFILL_GATE)
            figures[f"target_{name}_ppl_increase_le_0_1pct"] = report.ppl_increase <= 0.001
            figures[f"target_{name}_top1_agreement_ge_99pct"] = report.top1_agreement >= 0.99
            continue
        figures[f"target_{name}_ppl_increase_le_0_1pct"] = abs(report.ppl_increase) <= 0.001
        figures[f"target_{name}_top1_agreement_ge_99_5pct"] = report.top1_agreement >= 0.995
    return figures


def _targets(r: dict[str, Any]) -> dict[str, Any]:
    """The fp32/gguf ratio where a GGUF file ran, then every target's pass or fail."""
    figures: dict[str, Any] = {}
    if "gguf_decode_ppl_increase" in r:  # a GGUF file ran
        figures["fp32_over_gguf_tpot"] = r["fp32_tpot_ms"] / r["gguf_tpot_ms"]
    figures["target_int8_tpot_within_2_5x_bound"] = r["int8_tpot_over_bound"] <= 2.5
    figures["target_fp32_over_int8_tpot_ge_3"] = r["fp32_over_int8_tpot"] >= 3
    figures["target_int8_ttft_no_worse"] = r["int8_over_fp32_ttft"] <= 1.0
    # the default model's: the gate's figures and decode >= 2.4x fp32's
    figures["target_ppl_increase_le_1pct"] = r["ppl_increase"] <= 0.01
    figures["target_top1_agreement_ge_97pct"] = r["top1_agreement"] >= 0.97
    figures["target_decode_ppl_increase_le_1pct"] = r["decode_ppl_increase"] <= 0.01
    figures["target_decode_top1_agreement_ge_97pct"] = r["decode_top1_agreement"] >= 0.97
    figures["target_fp32_over_int8_tpot_ge_2_4"] = r["fp32_over_int8_tpot"] >= 2.4
    return figures


def print_table(r: dict[str, Any], ttft_len: int) -> None:
    _print_contenders(r, ttft_len)
    _print_quality(r)


def _print_contenders(r: dict[str, Any], ttft_len: int) -> None:
    """The machine, the engines' paths and one row of times a contender."""

    def fmt(value: Any) -> str:
        return "-" if value is None else f"{value:,.1f}"

    print(machine_line(r["threads"]))
    print(
        f"model {r['model']}, {r['threads']} threads, load {r['load_avg_1m']:.1f}: "
        f"read {r['read_bandwidth_gb_s']:.1f} GB/s\ncpu {r['cpu']}\n"
        f"int8 prefill path {r['int8_prefill_path'] or 'none passed the gate'}"
    )
    for name in ("int8", "fp32", "gguf"):
        if f"{name}_prefill" in r:
            print(f"{name} engine {r[f'{name}_prefill']}")
    print(
        f"{'contender':<16}{'TPOT ms':>10}{'bound ms':>10}{'/bound':>8}"
        f"{f'TTFT {ttft_len} ms':>15}{'weights MB':>12}"
    )
    for name in ("gguf", "int8", "fp32", "transformers"):
        if f"{name}_tpot_ms" not in r:
            continue
        ttft = r.get(f"{name}_ttft_{ttft_len}_ms")
        weight = r.get(f"{name}_weight_bytes")
        print(
            f"{name:<16}{fmt(r[f'{name}_tpot_ms']):>10}{fmt(r[f'{name}_tpot_bound_ms']):>10}"
            f"{r[f'{name}_tpot_over_bound']:>7.2f}x{fmt(ttft):>15}"
            f"{fmt(None if weight is None else weight / 1e6):>12}"
        )


def _print_quality(r: dict[str, Any]) -> None:
    """The ratios, every quality comparison against fp32, and the targets."""
    print(
        f"fp32/int8 TPOT {r['fp32_over_int8_tpot']:.2f}x, int8/fp32 TTFT "
        f"{r['int8_over_fp32_ttft']:.2f}x; int8 vs fp32 on {r['quality_tokens']} tokens: "
        f"ppl {r['ppl_fp32']:.2f} -> {r['ppl_int8']:.2f} ({r['ppl_increase']:+.2%}), "
        f"top-1 agreement {r['top1_agreement']:.2%}, logit RMS error {r['logit_rms_error']:.3f}"
    )
    print(
        f"int8 decode kernels vs fp32: ppl {r['decode_ppl_increase']:+.2%}, top-1 agreement "
        f"{r['decode_top1_agreement']:.2%}, logit RMS error {r['decode_logit_rms_error']:.3f}"
    )
    lines = {
        "kv_fp16": "fp16 KV cache (fp32 weights) vs fp32",
        "gguf_decode": "gguf blocks' decode vs fp32 (the file's dequantized weights)",
        "default": "serve's default (gguf blocks, fp16 KV cache) vs fp32",
    }
    prefill_names = [k.removesuffix("_top1_agreement") for k in r if k.startswith("gguf_prefill_")]
    for name in sorted(n for n in prefill_names if not n.endswith(("_ppl_increase", "_logit_rms_error"))):
        lines[name] = f"gguf blocks' prefill {name.removeprefix('gguf_prefill_')} vs fp32"
    for name, label in lines.items():
        if f"{name}_top1_agreement" in r:
            print(
                f"{label}: ppl {r[f'{name}_ppl_increase']:+.3%}, top-1 agreement "
                f"{r[f'{name}_top1_agreement']:.2%}, logit RMS error {r[f'{name}_logit_rms_error']:.4f}"
            )
    if "fp32_over_gguf_tpot" in r:
        print(f"fp32/gguf TPOT {r['fp32_over_gguf_tpot']:.2f}x")
    paths = sorted(
        {
            k.removeprefix("quality_").removesuffix("_ppl_increase")
            for k in r
            if k.endswith("_ppl_increase") and k.startswith("quality_")
        }
    )
    for path in paths:
        print(
            f"prefill path {path} vs fp32: ppl {r[f'quality_{path}_ppl_increase']:+.2%}, "
            f"top-1 agreement {r[f'quality_{path}_top1_agreement']:.2%}"
        )
    targets = [k for k in r if k.startswith("target_")]
    print("targets: " + ", ".join(f"{k[7:]}={'pass' if r[k] else 'FAIL'}" for k in targets))


@click.command("quant")
@model_option
@json_option
@repeats_option
@threads_option
@click.option("--output-len", default=32, type=int, help="tokens per TPOT run")
@transformers_option
@click.option(
    "--text",
    default=str(WIKITEXT),
    show_default="the shipped WikiText-2 test text",
    type=click.Path(exists=True, dir_okay=False),
    help="text file for perplexity and agreement",
)
def bench_quant(
    model: str,
    json_path: str | None,
    repeats: int,
    threads: int,
    output_len: int,
    with_transformers: bool,
    text: str,
) -> None:
    """int8 vs fp32 weights: TPOT beside the bandwidth bound, TTFT, perplexity, agreement."""
    try:
        run_bench_quant(
            model,
            json_path,
            repeats=repeats,
            threads=threads,
            output_len=output_len,
            with_transformers=with_transformers,
            text=text,
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from error
