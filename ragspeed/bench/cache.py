"""`ragspeed bench cache`: time to first token with the static system prompt's KV cached or not.

Workloads (one run, one process, both contenders share the model's weights, each has its own
KV pool; TTFT measured in-process on `LLMEngine`, from `add_request` to the step that samples
the first token):

- *shared prefix*: a ~2,000-word static system prompt (shipped as ragspeed/bench/system_prompt.txt, or `--system-prompt FILE`) followed
  by each of 20 distinct short questions. *cold*: prefix caching off, every request prefills the
  whole prompt [ttft_cold_ms]; *warm*: prefix caching on, the system prompt prefilled once
  before timing, so each request prefills only its question's tokens and the last partial
  block [ttft_warm_ms]. `ttft_speedup` = cold / warm (medians). Target >= 10.
- *no hit*: prompts of random tokens that share nothing (so caching can only cost: hashing
  every full block, bookkeeping). Each prompt runs on both engines back to back, the order
  alternating; `no_hit_overhead` = median over prompts of (on / off) - 1. Target <= 0.03.
  `no_hit_hash_ms` is the hashing alone (`cache_blocks`' work), measured directly: the noise
  floor of a shared CPU is larger than the overhead itself, so this is the figure that holds.

Cold requests are slow (a full prefill each), so by default only the first `num_cold` questions
are also timed with the cache off. One torch thread by default: on a shared, loaded CPU two
threads stall on each other at every op, which makes a short step several times slower and
its time erratic.

The limit beside the figure: a warm request still prefills `warm_prefill_tokens` tokens, so its
TTFT cannot drop below that prefill; `ttft_speedup_bound` = prompt tokens / warm prefill tokens.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import click
import torch

from ragspeed.bench.common import json_option, machine_line, model_option, require_positive, write_json
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME
from ragspeed.engine.protocol import GenerationRequest, SamplingParams

QUESTIONS = (
    "How do I reset my password?",
    "What is the refund window?",
    "Can I change my delivery address?",
    "Where is my invoice?",
    "How do I cancel my subscription?",
    "Do you ship abroad?",
    "Which payment methods do you accept?",
    "How long does shipping take?",
    "Can I talk to a human?",
    "Is my data encrypted?",
    "How do I export my data?",
    "What does the premium plan include?",
    "Why was my card declined?",
    "How do I add a user?",
    "Can I pause my plan?",
    "Where do I find the API key?",
    "What are your opening hours?",
    "How do I report a bug?",
    "Can I get a discount for a nonprofit?",
    "How do I delete my account?",
)
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
MAX_MODEL_LEN = 4096


def _ttft_s(engine: Any, request_id: str, prompt: tuple[int, ...]) -> tuple[float, int]:
    """Seconds from admission to the first sampled token; and the cached tokens reported."""
    start = time.perf_counter()
    engine.add_request(GenerationRequest(request_id, prompt, _GREEDY))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.delta.token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished():
                    engine.step()
                return elapsed, out.delta.num_cached_tokens


def run_bench_cache(
    model: str = DEFAULT_MODEL_NAME,
    json_path: str | None = None,
    *,
    num_questions: int = 20,
    num_cold: int = 5,
    no_hit_prompts: int = 12,
    no_hit_len: int = 512,
    threads: int = 1,
    seed: int = 0,
    system_prompt: str | None = None,
) -> dict[str, Any]:
    """Cache on and warm vs cache off; print a table, return (and write) flat JSON.
    `system_prompt`: the static prefix's text (default: the shipped system_prompt.txt)."""
    from ragspeed.engine.native.core.factory import build_llm_engine
    from ragspeed.engine.native.loading.loader import resolve_model_path

    require_positive(
        num_questions=num_questions,
        num_cold=num_cold,
        no_hit_prompts=no_hit_prompts,
        no_hit_len=no_hit_len,
        threads=threads,
    )
    if num_questions > len(QUESTIONS):
        raise ValueError(f"num_questions must be <= {len(QUESTIONS)}, got {num_questions}")
    torch.set_num_threads(threads)
    path = resolve_model_path(model)
    if system_prompt is None:
        system_prompt = (
            resources.files("ragspeed.bench").joinpath("system_prompt.txt").read_text(encoding="utf-8")
        )
    cached_config = EngineConfig(
        model=str(path),
        max_model_len=MAX_MODEL_LEN,
        num_kv_cache_tokens=16384,
        max_num_batched_tokens=4096,
        seed=seed,
        enable_prefix_caching=True,
    )
    cached = build_llm_engine(cached_config)
    plain = build_llm_engine(
        replace(cached_config, enable_prefix_caching=False), loaded=cached.loaded, tokenizer=cached.tokenizer
    )
    static, prompts = shared_prefix_prompts(cached.tokenizer, system_prompt.strip(), num_questions)
    with torch.inference_mode():
        shared = _measure_shared_prefix(cached, plain, prompts, num_cold)
        no_hit = _measure_no_hit(cached, plain, no_hit_prompts, no_hit_len, seed)
    results = {
        "model": model,
        "prompt_tokens": len(prompts[0]),
        "static_tokens": len(static),
        "num_questions": num_questions,
        "num_cold": num_cold,
        **_shared_prefix_figures(shared, len(prompts[0])),
        "no_hit_prompt_tokens": no_hit_len,
        **_no_hit_figures(no_hit),
        "threads": threads,
    }
    print_table(results)
    write_json(json_path, results)
    return results


def shared_prefix_prompts(
    tokenizer: Any, system_text: str, num_questions: int
) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """The static prefix's tokens, and the prompts: that prefix, then each question."""
    # Static prefix first (docs/architecture.md, contract 1); the question after it.
    static = tuple(tokenizer.encode(f"System: {system_text}\n\n", add_special_tokens=False))
    prompts = [
        static + tuple(tokenizer.encode(f"User: {q}\nAssistant:", add_special_tokens=False))
        for q in QUESTIONS[:num_questions]
    ]
    if max(len(p) for p in prompts) + 1 > MAX_MODEL_LEN:
        raise ValueError(
            f"the prompt has {max(len(p) for p in prompts)} tokens; max_model_len is {MAX_MODEL_LEN}"
        )
    return static, prompts


def _measure_shared_prefix(
    cached: Any, plain: Any, prompts: list[tuple[int, ...]], num_cold: int
) -> dict[str, list[Any]]:
    """TTFT seconds of the first `num_cold` prompts with the cache off [cold], of every prompt
    with the prefix cached [warm], and the cached tokens each warm request reported."""
    # Warm-up: both engines run once (allocators, kernels); this also caches the static
    # prefix in the cached engine, which is the "warm" state being measured.
    _ttft_s(plain, "warmup-off", prompts[0])
    _ttft_s(cached, "warmup-on", prompts[0])
    cold: list[float] = []
    warm: list[float] = []
    cached_tokens: list[int] = []
    for i, prompt in enumerate(prompts):
        if i < num_cold:
            cold.append(_ttft_s(plain, f"cold-{i}", prompt)[0])
        seconds, num_cached = _ttft_s(cached, f"warm-{i}", prompt)
        warm.append(seconds)
        cached_tokens.append(num_cached)
    return {"cold": cold, "warm": warm, "cached_tokens": cached_tokens}


def _measure_no_hit(cached: Any, plain: Any, num_prompts: int, prompt_len: int, seed: int) -> dict[str, Any]:
    """Random prompts that share nothing, on both engines back to back (the order alternating):
    TTFT seconds on and off, their ratios, the cached tokens (0 expected), and the seconds
    hashing each prompt's blocks takes alone."""
    from ragspeed.prompt_cache.hashing import hash_request_blocks

    gen = torch.Generator().manual_seed(seed)
    vocab = cached.arch.vocab_size
    random_prompts = [
        tuple(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()) for _ in range(num_prompts + 1)
    ]
    _ttft_s(cached, "nh-warmup-on", random_prompts[-1])
    _ttft_s(plain, "nh-warmup-off", random_prompts[-1])
    ratios, on_times, off_times, hits = [], [], [], 0
    for i, prompt in enumerate(random_prompts[:-1]):
        order = [(cached, "on"), (plain, "off")] if i % 2 == 0 else [(plain, "off"), (cached, "on")]
        times = {}
        for engine, label in order:
            times[label], num_cached = _ttft_s(engine, f"nh-{label}-{i}", prompt)
            hits += num_cached
        ratios.append(times["on"] / times["off"])
        on_times.append(times["on"])
        off_times.append(times["off"])
    hash_times = []
    for prompt in random_prompts[:-1]:
        start = time.perf_counter()
        hash_request_blocks(prompt, cached.manager.block_size, extra_key=cached.manager.extra_key)
        hash_times.append(time.perf_counter() - start)
    return {"ratios": ratios, "on": on_times, "off": off_times, "hits": hits, "hash": hash_times}


def _shared_prefix_figures(shared: dict[str, list[Any]], prompt_tokens: int) -> dict[str, Any]:
    cold, warm = statistics.median(shared["cold"]), statistics.median(shared["warm"])
    cached_tokens = statistics.median(shared["cached_tokens"])
    warm_prefill = prompt_tokens - cached_tokens
    return {
        "ttft_cold_ms": cold * 1000,
        "ttft_warm_ms": warm * 1000,
        "ttft_speedup": cold / warm,
        "cached_tokens_median": cached_tokens,
        "warm_prefill_tokens": warm_prefill,
        "ttft_speedup_bound": prompt_tokens / max(warm_prefill, 1),
    }


def _no_hit_figures(no_hit: dict[str, Any]) -> dict[str, Any]:
    off = statistics.median(no_hit["off"])
    return {
        "no_hit_ttft_on_ms": statistics.median(no_hit["on"]) * 1000,
        "no_hit_ttft_off_ms": off * 1000,
        "no_hit_overhead": statistics.median(no_hit["ratios"]) - 1.0,
        "no_hit_cached_tokens": no_hit["hits"],
        "no_hit_hash_ms": statistics.median(no_hit["hash"]) * 1000,
        "no_hit_hash_share": statistics.median(no_hit["hash"]) / off,
    }


def print_table(r: dict[str, Any]) -> None:
    print(machine_line(r["threads"]))
    print(
        f"prefix cache, {r['model']}: {r['prompt_tokens']}-token prompts "
        f"({r['static_tokens']} static), {r['num_questions']} questions"
    )
    print(f"  {'TTFT cache off (cold)':32s} {r['ttft_cold_ms']:10.1f} ms")
    print(
        f"  {'TTFT cache on, warm':32s} {r['ttft_warm_ms']:10.1f} ms"
        f"   ({r['cached_tokens_median']:.0f} cached, {r['warm_prefill_tokens']:.0f} prefilled)"
    )
    print(
        f"  {'speedup (target >= 10)':32s} {r['ttft_speedup']:10.1f} x"
        f"   (bound {r['ttft_speedup_bound']:.0f} x)"
    )
    print(
        f"  no shared prefix, {r['no_hit_prompt_tokens']} tokens: on {r['no_hit_ttft_on_ms']:.1f} ms,"
        f" off {r['no_hit_ttft_off_ms']:.1f} ms"
    )
    print(
        f"  {'no-hit overhead (target <= 0.03)':32s} {r['no_hit_overhead']:+10.3f}"
        f"   (hashing alone {r['no_hit_hash_ms']:.2f} ms = {r['no_hit_hash_share']:.4f})"
    )


@click.command("cache")
@model_option
@json_option
@click.option("--num-questions", default=20, type=int, help="distinct questions after the system prompt")
@click.option("--num-cold", default=5, type=int, help="questions also timed with the cache off")
@click.option("--threads", default=1, type=int, help="torch CPU threads")
@click.option(
    "--system-prompt",
    "system_prompt_file",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="text file of the static system prompt  [default: the shipped system_prompt.txt]",
)
def bench_cache(
    model: str,
    json_path: str | None,
    num_questions: int,
    num_cold: int,
    threads: int,
    system_prompt_file: Path | None,
) -> None:
    """TTFT with the static system prompt cached (warm) vs prefix caching off (cold)."""
    system_prompt = system_prompt_file.read_text(encoding="utf-8") if system_prompt_file else None
    try:
        run_bench_cache(
            model,
            json_path,
            num_questions=num_questions,
            num_cold=num_cold,
            threads=threads,
            system_prompt=system_prompt,
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from error
