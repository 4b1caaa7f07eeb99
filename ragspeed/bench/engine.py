"""`ragspeed bench engine`: the native engine against transformers, with the hardware bounds.

The native engine runs as `ragspeed serve` does by default: `quantization` "auto" (a GGUF
file's own blocks, else the checkpoint's dtype) [quantization] and `kv_cache_dtype` "auto"
(fp16 on a CPU with the kernels) [kv_cache_dtype], with a step that carries decodes given 50 ms
(`--tpot-target-ms`, 'none': the token budget alone) [tpot_target_ms];
`--quantization int8|none` and `--kv-cache-dtype fp32` measure the other paths.

Figures (all from one run, after a warm-up, medians of `repeats` runs; JSON keys in brackets):
- throughput: `num_requests` concurrent requests of `prompt_len` random tokens, `output_len`
  greedy tokens each, EOS ignored; the native engine batches them, transformers runs
  `generate()` one request after another (its rate does not depend on how many wait, so it is
  measured on `transformers_requests` of them) [native_tokens_per_s, transformers_tokens_per_s,
  throughput_ratio]. Output tokens only.
- time per output token at batch 1 [tpot_ms, transformers_tpot_ms] against the bandwidth bound:
  weight bytes read per token / read bandwidth measured here, 9 reads before and 9 after the
  contenders, their median [tpot_bound_ms, read_bandwidth_gb_s; the spread in
  read_bandwidth_{first,last,min,max}_gb_s].
- time to first token of a `ttft_prompt_len`-token prompt [ttft_2048_ms] against the FLOP bound:
  FLOPs (projections, attention, one LM-head row) / fp32 GEMM rate measured here
  [ttft_2048_bound_ms].
- time per output token after that prompt, `long_output_len` greedy tokens in the same runs: a
  RAG request's decoding, which reads the context's keys and values beside the weights
  [tpot_2048_ms, transformers_tpot_2048_ms] against its bandwidth bound, the weight bytes and
  the KV cache's bytes per token / read bandwidth [tpot_2048_bound_ms].
- the attention share of TTFT at each of `attention_lens` prompt lengths (2,048 and 8,192; a
  length that leaves no room for the output token in the model's context is cut to fit): one
  prefill under torch's profiler, the time inside the engine's prefill-attention event over
  the prefill's time [attention_share_2048, attention_share_8191 on SmolLM2's 8,192 positions;
  the prefill's time under the profiler in attention_ttft_{N}_ms].
- the native engine's step shapes (bench.steps): a verification of 1 + 4 rows in plain steps
  after `prompt_len` and `ttft_prompt_len` tokens [verification_steps_{N}], and a
  `ttft_prompt_len`-token prompt prefilled in chunks of 64 beside a decode, per token, against
  the same prompt in chunks of 512 alone [chunk_beside_decode_ratio] (`--no-steps`: skipped).
- the served stream: `ragspeed serve` on the same model and settings in a child process, TPOT
  at batch 1 from a streaming client in this process, the `prompt_len`/`output_len` requests
  of the TPOT figure [served_tpot_ms, served_tpot_over_tpot] (`--no-served`: skipped).
- llama.cpp beside them, where llama-cpp-python is installed (bench.llamacpp: the same figures
  per GGUF type [llamacpp_<type>_*], the fastest type's [llamacpp_*, llamacpp_*_type] and the
  ratios to native [llamacpp_throughput_ratio, llamacpp_tpot_ratio, llamacpp_ttft_speedup,
  llamacpp_tpot_2048_ratio]).
A *ratio* divides two rates or two times of contenders; `*_over_bound` divides a time by its bound.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch

from ragspeed.bench import llamacpp
from ragspeed.bench.common import (
    TokenTimes,
    json_option,
    machine_line,
    median_gap,
    model_option,
    quantization_option,
    repeats_option,
    require_positive,
    threads_option,
    transformers_option,
    write_json,
)
from ragspeed.bench.steps import served_tpot, step_costs
from ragspeed.bench.tokens import random_prompt
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.compute.attention import PREFILL_ATTENTION_EVENT
from ragspeed.engine.native.compute.cpu_features import read_cpu_features
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME
from ragspeed.engine.protocol import GenerationRequest, SamplingParams


def read_bandwidth_samples(num_bytes: int = 512 * 2**20, repeats: int = 9) -> list[float]:
    """Bytes per second of `repeats` streaming reads (a sum over a tensor far larger than the
    caches), with the threads torch runs on."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    data.sum()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        samples.append(num_bytes / (time.perf_counter() - start))
    return samples


class BandwidthProbe:
    """Read bandwidth measured before and after the contenders of a benchmark.

    Single reads with several threads can spread widely within one run (by nearly 2x on a
    shared 2-core CPU), so the bound uses the median of all the reads of both probes, and the
    JSON keeps the spread.
    """

    def __init__(self) -> None:
        self.first = read_bandwidth_samples()
        self.last: list[float] = []

    def finish(self) -> dict[str, float]:
        """Probe again; the JSON figures (GB/s)."""
        self.last = read_bandwidth_samples()
        return {
            "read_bandwidth_gb_s": self.bandwidth / 1e9,
            "read_bandwidth_first_gb_s": statistics.median(self.first) / 1e9,
            "read_bandwidth_last_gb_s": statistics.median(self.last) / 1e9,
            "read_bandwidth_min_gb_s": min(self.first + self.last) / 1e9,
            "read_bandwidth_max_gb_s": max(self.first + self.last) / 1e9,
        }

    @property
    def bandwidth(self) -> float:
        return statistics.median(self.first + self.last)


def measure_gemm_rate(m: int = 2048, k: int = 1024, n: int = 2048, repeats: int = 5) -> float:
    """fp32 FLOP/s of a prefill-sized matrix product."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / statistics.median(times)


def prefill_flops(engine, num_tokens: int) -> float:
    """FLOPs of one prefill: every projection for every token, causal attention, one LM row."""
    arch = engine.arch
    model = engine.loaded.model
    projection_params = sum(m.num_params for m in model.layers.modules() if hasattr(m, "num_params"))
    attention = 2 * 2 * arch.num_layers * arch.num_heads * arch.head_dim * num_tokens**2 / 2
    return 2 * projection_params * num_tokens + attention + 2 * arch.vocab_size * arch.hidden_size


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class _NativeContender(TokenTimes):
    def __init__(self, engine):
        self.engine = engine
        self._ids = 0

    def _run(self, prompts: list[tuple[int, ...]], max_tokens: int) -> list[list[float]]:
        """Run requests together; per request the times its tokens arrived."""
        start = time.perf_counter()
        arrivals: dict[str, list[float]] = {}
        for prompt in prompts:
            self._ids += 1
            request_id = f"bench-{self._ids}"
            arrivals[request_id] = []
            self.engine.add_request(GenerationRequest(request_id, prompt, _greedy(max_tokens)))
        while self.engine.has_unfinished():
            outputs = self.engine.step()
            now = time.perf_counter() - start
            for out in outputs:
                arrivals[out.request_id].extend([now] * len(out.delta.token_ids))
        return list(arrivals.values())

    def throughput(self, prompts, max_tokens) -> float:
        start = time.perf_counter()
        arrivals = self._run(prompts, max_tokens)
        return sum(len(a) for a in arrivals) / (time.perf_counter() - start)

    def arrivals(self, prompt, max_tokens) -> list[float]:
        return self._run([prompt], max_tokens)[0]

    def attention_share(self, prompt) -> tuple[float, float]:
        """One prefill under torch's profiler: (share of its time in prefill attention, its
        time in seconds)."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            ttft = self.ttft(prompt)
        events = profiler.key_averages()
        attention_us = sum(e.cpu_time_total for e in events if e.key == PREFILL_ATTENTION_EVENT)
        return attention_us / 1e6 / ttft, ttft


def parse_lengths(text: str) -> tuple[int, ...]:
    """`2048,8192` -> (2048, 8192); an empty text -> (). Raise ValueError on anything else."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    try:
        lengths = tuple(int(part) for part in parts)
    except ValueError:
        raise ValueError(f"attention lengths must be integers separated by commas, got {text!r}") from None
    return lengths


def fit_lengths(lengths: tuple[int, ...], context: int) -> tuple[int, ...]:
    """Prompt lengths cut to leave the one output token room in a `context`-token model."""
    return tuple(sorted({min(n, context - 1) for n in lengths}))


class _TransformersContender(TokenTimes):
    """Plain `generate()`, one request at a time, token times from a streamer."""

    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def _generate(self, prompt: tuple[int, ...], max_tokens: int) -> list[float]:
        from transformers.generation.streamers import BaseStreamer

        times: list[float] = []
        start = time.perf_counter()

        class Clock(BaseStreamer):
            def put(self, value):
                times.append(time.perf_counter() - start)

            def end(self):
                pass

        with torch.inference_mode():
            self.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                streamer=Clock(),
            )
        return times[1:]  # the first put is the prompt

    def throughput(self, prompts, max_tokens) -> float:
        start = time.perf_counter()
        num_tokens = sum(len(self._generate(p, max_tokens)) for p in prompts)
        return num_tokens / (time.perf_counter() - start)

    def arrivals(self, prompt, max_tokens) -> list[float]:
        return self._generate(prompt, max_tokens)


@dataclass(frozen=True)
class EngineBenchOptions:
    """What `bench_engine` runs: the workloads' sizes, the contenders beside the native engine,
    and the native engine's settings (as serve's flags of the same names)."""

    num_requests: int = 16
    prompt_len: int = 256
    output_len: int = 64
    ttft_prompt_len: int = 2048
    long_output_len: int = 16
    attention_lens: tuple[int, ...] = (2048, 8192)
    repeats: int = 3
    transformers_requests: int = 4
    threads: int = 2
    with_transformers: bool = True
    with_llamacpp: bool = True
    llamacpp_gguf: tuple[str, ...] = ()
    llamacpp_requests: int = 4
    quantization: str | None = "auto"
    kv_cache_dtype: str = "auto"
    tpot_target_ms: float | None = 50.0
    seed: int = 0
    with_steps: bool = True
    with_served: bool = True

    def check(self) -> None:
        """Raise ValueError naming the first size out of range."""
        require_positive(
            num_requests=self.num_requests,
            prompt_len=self.prompt_len,
            output_len=self.output_len,
            ttft_prompt_len=self.ttft_prompt_len,
            repeats=self.repeats,
            threads=self.threads,
            transformers_requests=self.transformers_requests,
            llamacpp_requests=self.llamacpp_requests,
        )
        if self.long_output_len < 2:
            raise ValueError(
                f"long_output_len must be >= 2 (a TPOT needs two tokens), got {self.long_output_len}"
            )
        for length in self.attention_lens:
            require_positive(attention_len=length)


def bench_engine(
    model: str = DEFAULT_MODEL_NAME,
    json_path: str | None = None,
    options: EngineBenchOptions = EngineBenchOptions(),
) -> dict[str, Any]:
    """Measure the native engine (and transformers beside it); print a table, return flat JSON."""
    from transformers import AutoConfig

    from ragspeed.engine.native.core.factory import build_llm_engine
    from ragspeed.engine.native.loading.loader import context_limit, resolve_model_path

    options.check()
    torch.set_num_threads(options.threads)
    path = resolve_model_path(model)
    attention_lens = fit_lengths(options.attention_lens, context_limit(AutoConfig.from_pretrained(path)))
    max_model_len = _max_model_len(options, attention_lens)
    config = _engine_config(path, options, max_model_len)
    engine = build_llm_engine(config)
    contenders, requests, llama = _contenders(model, path, engine, options, max_model_len)
    probe = BandwidthProbe()
    gemm_rate = measure_gemm_rate()
    results = _settings_figures(model, engine, options, gemm_rate)
    results.update(_measure(contenders, requests, options, attention_lens, engine.arch.vocab_size))
    if options.with_steps:
        lengths = (options.prompt_len, options.ttft_prompt_len)
        results.update(
            step_costs(engine.loaded, lengths, prompt_len=options.ttft_prompt_len, repeats=options.repeats)
        )
    if options.with_served:
        results.update(_served(model, engine, options))
    results.update(probe.finish())
    _summarize(results, engine, options, probe.bandwidth, gemm_rate, llama)
    _report(results, options.ttft_prompt_len, attention_lens, llama)
    write_json(json_path, results)
    return results


def _served(model: str, engine: Any, options: EngineBenchOptions) -> dict[str, Any]:
    """The served stream's TPOT, the server on the native engine's settings."""
    o = options
    args = ["--quantization", o.quantization or "none", "--kv-cache-dtype", o.kv_cache_dtype]
    args += ["--tpot-target-ms", _budget_flag(o.tpot_target_ms)]
    # The prompts' ids must be the tokenizer's: a model's vocabulary may be padded past it.
    vocab = len(engine.tokenizer)
    return served_tpot(model, o.prompt_len, o.output_len, o.repeats, o.threads, vocab, o.seed, args)


def _budget_flag(tpot_target_ms: float | None) -> str:
    return "none" if tpot_target_ms is None else f"{tpot_target_ms:g}"


def _max_model_len(options: EngineBenchOptions, attention_lens: tuple[int, ...]) -> int:
    """Room for the longest request of every workload."""
    o = options
    longest = max(attention_lens, default=0) + 1
    warm_up = 64 + 4  # the warm-up's longest request
    return max(o.prompt_len + o.output_len, o.ttft_prompt_len + o.long_output_len, longest, warm_up)


def _engine_config(path: Path, options: EngineBenchOptions, max_model_len: int) -> EngineConfig:
    o = options
    return EngineConfig(
        model=str(path),
        max_model_len=max_model_len,
        num_kv_cache_tokens=max(o.num_requests * (o.prompt_len + o.output_len), max_model_len) + 1024,
        max_num_seqs=max(o.num_requests, 1),
        enable_prefix_caching=False,  # random prompts share nothing; keep the pool honest
        quantization=o.quantization,
        kv_cache_dtype=o.kv_cache_dtype,
        tpot_target_ms=o.tpot_target_ms,
        seed=o.seed,
    )


def _contenders(
    model: str, path: Path, engine: Any, options: EngineBenchOptions, max_model_len: int
) -> tuple[dict[str, Any], dict[str, int], dict[str, Any] | str | None]:
    """The contenders by name, the requests each runs at once in the throughput figure, and
    llama.cpp's contenders by GGUF type (or why it is skipped; None when not asked for)."""
    contenders: dict[str, Any] = {"native": _NativeContender(engine)}
    if options.with_transformers:
        contenders["transformers"] = _TransformersContender(path)
    requests = {"native": options.num_requests, "transformers": options.transformers_requests}
    llama = (
        llamacpp.build_contenders(model, options.llamacpp_gguf, options.threads, max_model_len)
        if options.with_llamacpp
        else None
    )
    if isinstance(llama, dict):
        for label, contender in llama.items():
            contenders[f"llamacpp_{label}"] = contender
            requests[f"llamacpp_{label}"] = options.llamacpp_requests
    return contenders, requests, llama


def _settings_figures(
    model: str, engine: Any, options: EngineBenchOptions, gemm_rate: float
) -> dict[str, Any]:
    """The JSON's first keys: what ran, and how."""
    return {
        "model": model,
        "quantization": engine.loaded.quantization or "none",
        "kv_cache_dtype": str(engine.kv_pool.kv.dtype).removeprefix("torch."),
        "tpot_target_ms": options.tpot_target_ms,
        "threads": options.threads,
        "num_requests": options.num_requests,
        "prompt_len": options.prompt_len,
        "output_len": options.output_len,
        "repeats": options.repeats,
        "transformers_requests": options.transformers_requests,
        "gemm_gflop_s": gemm_rate / 1e9,
        "cpu": read_cpu_features().describe(),
    }


def _measure(
    contenders: dict[str, Any],
    requests: dict[str, int],
    options: EngineBenchOptions,
    attention_lens: tuple[int, ...],
    vocab_size: int,
) -> dict[str, Any]:
    """Every contender's figures, after a warm-up of every code path; then the native engine's
    attention share at each length."""
    gen = torch.Generator().manual_seed(options.seed)

    def prompts(n: int, length: int) -> list[tuple[int, ...]]:
        return [random_prompt(gen, length, vocab_size) for _ in range(n)]

    figures: dict[str, Any] = {}
    with torch.inference_mode():
        for contender in contenders.values():  # warm-up: every code path once
            contender.throughput(prompts(2, 32), 4)
            contender.ttft(prompts(1, 64)[0])
        for name, contender in contenders.items():
            figures.update(_measure_contender(name, contender, requests[name], options, prompts))
        for length in attention_lens:
            share, ttft = contenders["native"].attention_share(prompts(1, length)[0])
            figures[f"attention_share_{length}"] = share
            figures[f"attention_ttft_{length}_ms"] = ttft * 1e3
    return figures


def _measure_contender(
    name: str,
    contender: Any,
    num_requests: int,
    options: EngineBenchOptions,
    prompts: Callable[[int, int], list[tuple[int, ...]]],
) -> dict[str, float]:
    """One contender's throughput, TPOT at batch 1, TTFT of the long prompt and TPOT after it
    (medians of `repeats` runs); a progress line on stderr."""
    o = options
    long_len = o.ttft_prompt_len
    rates = [
        contender.throughput(prompts(num_requests, o.prompt_len), o.output_len) for _ in range(o.repeats)
    ]
    tpots = [contender.tpot(prompts(1, o.prompt_len)[0], o.output_len) for _ in range(o.repeats)]
    runs = [contender.arrivals(prompt, o.long_output_len) for prompt in prompts(o.repeats, long_len)]
    figures = {
        f"{name}_tokens_per_s": statistics.median(rates),
        f"{name}_tpot_ms": statistics.median(tpots) * 1e3,
        f"{name}_ttft_{long_len}_ms": statistics.median(r[0] for r in runs) * 1e3,
        f"{name}_tpot_{long_len}_ms": statistics.median(median_gap(r) for r in runs) * 1e3,
    }
    print(  # progress: a slow baseline on a busy machine can take many minutes
        f"{name}: {figures[f'{name}_tokens_per_s']:.1f} tok/s, TPOT "
        f"{figures[f'{name}_tpot_ms']:.1f} ms, TTFT {long_len} "
        f"{figures[f'{name}_ttft_{long_len}_ms']:.0f} ms, TPOT after it "
        f"{figures[f'{name}_tpot_{long_len}_ms']:.1f} ms",
        file=sys.stderr,
        flush=True,
    )
    return figures


def _summarize(
    results: dict[str, Any],
    engine: Any,
    options: EngineBenchOptions,
    bandwidth: float,
    gemm_rate: float,
    llama: dict[str, Any] | str | None,
) -> None:
    """Add the bounds and ratios to `results`; the native engine's figures lose their prefix."""
    ttft_len = options.ttft_prompt_len
    weight_bytes = engine.loaded.model.num_weight_bytes_per_token
    results["weight_bytes_per_token"] = weight_bytes
    results["tpot_ms"] = results.pop("native_tpot_ms")
    results["tpot_bound_ms"] = weight_bytes / bandwidth * 1e3
    results["tpot_over_bound"] = results["tpot_ms"] / results["tpot_bound_ms"]
    long_tpot = f"tpot_{ttft_len}"
    results[f"{long_tpot}_ms"] = results.pop(f"native_{long_tpot}_ms")
    kv_bytes = engine.arch.kv_bytes_per_token * engine.kv_pool.kv.element_size()
    context = ttft_len + options.long_output_len / 2  # the mean context of its output tokens
    results[f"{long_tpot}_bound_ms"] = (weight_bytes + kv_bytes * context) / bandwidth * 1e3
    results[f"{long_tpot}_over_bound"] = results[f"{long_tpot}_ms"] / results[f"{long_tpot}_bound_ms"]
    results[f"ttft_{ttft_len}_ms"] = results.pop(f"native_ttft_{ttft_len}_ms")
    results[f"ttft_{ttft_len}_bound_ms"] = prefill_flops(engine, ttft_len) / gemm_rate * 1e3
    results["ttft_over_bound"] = results[f"ttft_{ttft_len}_ms"] / results[f"ttft_{ttft_len}_bound_ms"]
    if "served_tpot_ms" in results:
        results["served_tpot_over_tpot"] = results["served_tpot_ms"] / results["tpot_ms"]
    if options.with_transformers:
        results["throughput_ratio"] = results["native_tokens_per_s"] / results["transformers_tokens_per_s"]
        results["transformers_tpot_over_bound"] = results["transformers_tpot_ms"] / results["tpot_bound_ms"]
    if isinstance(llama, dict):
        results.update(llamacpp.summary(results, llama, options.llamacpp_requests, ttft_len))
    elif isinstance(llama, str):
        results["llamacpp_skipped"] = llama


def _report(
    results: dict[str, Any],
    ttft_len: int,
    attention_lens: tuple[int, ...],
    llama: dict[str, Any] | str | None,
) -> None:
    print_table(results, ttft_len, attention_lens)
    if isinstance(llama, dict):
        llamacpp.print_comparison(results, list(llama), ttft_len)
    elif isinstance(llama, str):
        print(llamacpp.skip_line(llama))


def print_table(r: dict[str, Any], ttft_len: int, attention_lens: tuple[int, ...] = ()) -> None:
    def fmt(value: Any, unit: str = "") -> str:
        return "-" if value is None else f"{value:,.1f}{unit}"

    rows = [
        (
            "throughput (tok/s)",
            r.get("native_tokens_per_s"),
            r.get("transformers_tokens_per_s"),
            None,
            r.get("throughput_ratio"),
        ),
        (
            "TPOT batch 1 (ms)",
            r.get("tpot_ms"),
            r.get("transformers_tpot_ms"),
            r.get("tpot_bound_ms"),
            r.get("tpot_over_bound"),
        ),
        (
            f"TTFT {ttft_len} (ms)",
            r.get(f"ttft_{ttft_len}_ms"),
            r.get(f"transformers_ttft_{ttft_len}_ms"),
            r.get(f"ttft_{ttft_len}_bound_ms"),
            r.get("ttft_over_bound"),
        ),
        (
            f"TPOT after {ttft_len} (ms)",
            r.get(f"tpot_{ttft_len}_ms"),
            r.get(f"transformers_tpot_{ttft_len}_ms"),
            r.get(f"tpot_{ttft_len}_bound_ms"),
            r.get(f"tpot_{ttft_len}_over_bound"),
        ),
    ]
    print(machine_line(r["threads"]))
    print(f"cpu: {r['cpu']}")
    print(
        f"model {r['model']}, native weights {r['quantization']}, KV {r['kv_cache_dtype']}, "
        f"step budget {_budget(r['tpot_target_ms'])}, {r['threads']} threads: "
        f"read {r['read_bandwidth_gb_s']:.1f} GB/s, GEMM {r['gemm_gflop_s']:.0f} GFLOP/s"
    )
    print(f"{'figure':<22}{'native':>12}{'transformers':>14}{'bound':>10}{'ratio':>8}")
    for name, native, hf, bound, ratio in rows:
        ratio_text = "-" if ratio is None else f"{ratio:.2f}x"
        print(f"{name:<22}{fmt(native):>12}{fmt(hf):>14}{fmt(bound):>10}{ratio_text:>8}")
    print("ratio: native/transformers for throughput; native/bound for times")
    if attention_lens:
        print(attention_line(r, attention_lens))
    for line in steps_lines(r, ttft_len):
        print(line)


def steps_lines(r: dict[str, Any], ttft_len: int) -> list[str]:
    """The step shapes' and the served stream's figures, where measured."""
    lines = []
    contexts = sorted(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("verification_steps_"))
    if contexts:
        costs = ", ".join(
            f"after {n:,} tokens {r[f'verification_{n}_ms']:.1f} ms, {r[f'verification_steps_{n}']:.2f} plain steps"
            for n in contexts
        )
        lines.append(f"verification of 1 + 4 rows: {costs}")
        lines.append(
            f"{ttft_len:,}-token prompt beside a decode in chunks of 64: "
            f"{r['chunk_beside_decode_ms_per_token']:.3f} ms a token, alone in chunks of 512: "
            f"{r['large_chunks_ms_per_token']:.3f} ({r['chunk_beside_decode_ratio']:.2f}x)"
        )
    if "served_tpot_ms" in r:
        lines.append(
            f"served TPOT at batch 1, from a streaming client: {r['served_tpot_ms']:.2f} ms "
            f"({r['served_tpot_over_tpot']:.2f}x the engine's {r['tpot_ms']:.2f})"
        )
    return lines


def attention_line(r: dict[str, Any], attention_lens: tuple[int, ...]) -> str:
    """`attention share of TTFT 2,048: 21.0%, 8,191: 48.3%` (native engine)."""
    shares = ", ".join(f"{n:,}: {r[f'attention_share_{n}']:.1%}" for n in attention_lens)
    return f"attention share of TTFT {shares}"


def _budget(tpot_target_ms: float | None) -> str:
    return "off" if tpot_target_ms is None else f"{tpot_target_ms:g} ms"


def _parse_budget(value: str) -> float | None:
    """--tpot-target-ms: milliseconds above 0, or 'none'."""
    if value.strip().lower() == "none":
        return None
    try:
        budget = float(value)
    except ValueError:
        raise ValueError(f"--tpot-target-ms takes milliseconds or 'none', got {value!r}") from None
    if not budget > 0:
        raise ValueError(f"--tpot-target-ms must be > 0 (or 'none'), got {value!r}")
    return budget


@click.command("engine")
@model_option
@json_option
@repeats_option
@threads_option
@click.option("--transformers-requests", default=4, type=int, help="requests through generate()")
@click.option(
    "--attention-lens",
    default="2048,8192",
    show_default=True,
    help="prompt lengths of the attention share of TTFT, separated by commas ('' for none); "
    "a length past the model's context less one output token is cut to it",
)
@transformers_option
@click.option(
    "--llamacpp/--no-llamacpp",
    "with_llamacpp",
    default=True,
    help="run llama.cpp beside where llama-cpp-python is installed (pip install 'ragspeed[llamacpp]')",
)
@click.option(
    "--llamacpp-gguf",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="GGUF file for llama.cpp, repeatable (default: the model's GGUF and its F16/Q8_0/BF16 copies)",
)
@click.option("--llamacpp-requests", default=4, type=int, help="requests through llama.cpp, one at a time")
@quantization_option("the native engine's weights, as serve's --quantization")
@click.option(
    "--kv-cache-dtype",
    type=click.Choice(["auto", "fp32", "fp16"]),
    default="auto",
    show_default=True,
    help="the native engine's KV cache, as serve's --kv-cache-dtype",
)
@click.option(
    "--tpot-target-ms",
    default="50",
    show_default=True,
    help="the time budget of a native step that carries decodes, as serve's --tpot-target-ms ('none': off)",
)
@click.option("--steps/--no-steps", "with_steps", default=True, help="the native engine's step shapes")
@click.option(
    "--served/--no-served",
    "with_served",
    default=True,
    help="the served stream's TPOT (starts ragspeed serve)",
)
def bench_engine_command(
    model: str,
    json_path: str | None,
    repeats: int,
    threads: int,
    transformers_requests: int,
    attention_lens: str,
    with_transformers: bool,
    with_llamacpp: bool,
    llamacpp_gguf: tuple[str, ...],
    llamacpp_requests: int,
    quantization: str,
    kv_cache_dtype: str,
    tpot_target_ms: str,
    with_steps: bool,
    with_served: bool,
) -> None:
    """Native engine vs transformers (and llama.cpp): throughput, TPOT and TTFT against the hardware bounds."""
    try:
        options = EngineBenchOptions(
            attention_lens=parse_lengths(attention_lens),
            repeats=repeats,
            threads=threads,
            transformers_requests=transformers_requests,
            with_transformers=with_transformers,
            with_llamacpp=with_llamacpp,
            llamacpp_gguf=llamacpp_gguf,
            llamacpp_requests=llamacpp_requests,
            quantization=quantization,  # "none": EngineConfig reads it as off
            kv_cache_dtype=kv_cache_dtype,
            tpot_target_ms=_parse_budget(tpot_target_ms),
            with_steps=with_steps,
            with_served=with_served,
        )
        bench_engine(model, json_path, options)
    except ValueError as error:
        raise click.UsageError(str(error)) from error
