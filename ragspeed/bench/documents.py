"""`ragspeed bench documents`: time to first token of a 20-document request whose documents'
KV is stored (the document cache), against full prefill and against its own bound.

One process, one `LLMEngine` with prefix caching and the document store on; TTFT measured
in-process, from `add_request` to the step that samples the first token. Prompts are laid out
as the gateway lays them out (gateway.prompt: system prompt, numbered documents, question),
with the documents' token spans. Each trial has a question and 20 documents (passages cut from
the shipped system_prompt.txt, or a QA file's documents with `--data`) and a tenant salt of its
own, and runs three requests:

- *full*: the documents prefilled in context (no document cache); only the system prompt comes
  from the prefix cache [ttft_full_ms];
- *cold*: the documents reversed and seen for the first time: each is prefilled on its own
  after the system prompt and stored [ttft_cold_ms];
- *warm*: the documents in their own order, every one in the store, and no prefix beyond the
  first document in the prefix cache [ttft_warm_ms].

The bound of a warm request: its fresh tokens (`recomputed_tokens`, and the last prompt token)
at the full prefill's rate per token, plus the bytes that placing the documents moves (the
stored KV read, the pool's KV written) at the copy bandwidth measured in the same run
[ttft_warm_bound_ms]. `warm_over_bound` = warm / bound. A step of a few fresh tokens cannot
spread the weights' bytes over many tokens as a long prefill does: `ttft_warm_bound_weights_ms`
adds one read of the weights at that bandwidth (what the bound leaves out). Store figures: bytes per token (K and V
at every layer) in the storage dtype and in each storage format the store offers, and documents
per GB at the trials' mean document length.

`--hit-rate` measures instead what the store keeps of a corpus: a pass over the questions (each
with its documents, one tenant, one system prompt), then the same questions in reverse order,
with the store's default budgets (engine.native.core.document_kv.open_document_store: the RAM tier a share
of available memory, the disk tier 8 GiB in a fresh folder) unless `--ram-bytes` /
`--disk-bytes` set them. It reports each pass's share of documents found in the store, by tier.
With `--bookkeeping` no model runs: the documents are tokenized as the gateway tokenizes them
and the real `DocumentStore` is fed payloads of the model's real size (zeros, written to real
files), so the hits are exactly the store's, without the prefill's hours on a small CPU.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import click
import torch

from ragspeed.bench.common import (
    json_option,
    machine_line,
    model_option,
    prefill_line,
    require_positive,
    write_json,
)
from ragspeed.document import Document
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME
from ragspeed.engine.protocol import (
    DOCUMENT_GLUE_MODES,
    DocumentCacheOptions,
    GenerationRequest,
    SamplingParams,
)
from ragspeed.gateway.prompt import Segments, assemble_prompt
from ragspeed.prompt_cache.document_store import DTYPE_ITEMSIZES, DocumentKV, KVLayout, document_key

NUM_DOCUMENTS = 20
SYSTEM_PROMPT = "Answer the question using only the provided search results."
QUESTIONS = (
    "Which step comes first?",
    "What does the policy say about refunds?",
    "Who may change the settings?",
    "How long is data kept?",
    "What happens after an outage?",
)
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def shipped_trials(num_trials: int) -> list[tuple[str, list[Document]]]:
    """Trials of 20 passages (about 100 words each) cut from the shipped system prompt, a
    different rotation for each trial."""
    text = resources.files("ragspeed.bench").joinpath("system_prompt.txt").read_text(encoding="utf-8")
    words = text.split()
    size = max(len(words) // NUM_DOCUMENTS, 1)
    passages = [" ".join(words[i * size : (i + 1) * size]) for i in range(NUM_DOCUMENTS)]
    trials = []
    for t in range(num_trials):
        rotated = passages[t:] + passages[:t]
        trials.append(
            (QUESTIONS[t % len(QUESTIONS)], [Document(f"p{t}-{i}", p) for i, p in enumerate(rotated)])
        )
    return trials


def file_trials(path: Path, num_trials: int) -> list[tuple[str, list[Document]]]:
    """The first `num_trials` questions of a QA file (one JSON object a line, `question` and
    `documents` as strings or {title, text})."""
    trials: list[tuple[str, list[Document]]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if len(trials) == num_trials:
            break
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            docs = [d if isinstance(d, dict) else {"text": d} for d in record["documents"]]
            documents = [
                Document(f"{number}-{i}", d["text"], d.get("title") or "") for i, d in enumerate(docs)
            ]
            trials.append((str(record["question"]), documents))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a question with documents ({error})") from None
    if len(trials) < num_trials:
        raise ValueError(f"{path}: {len(trials)} question(s) with documents, {num_trials} asked")
    return trials


def copy_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes moved (read + written) per second by a large tensor copy: the best of `repeats`."""
    source = torch.ones(num_bytes // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def _ttft(engine: Any, request: GenerationRequest) -> tuple[float, Any]:
    """Seconds from admission to the first sampled token; and the request's document report."""
    start = time.perf_counter()
    engine.add_request(request)
    elapsed, report = None, None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != request.request_id:
                continue
            report = out.delta.documents if out.delta.documents is not None else report
            if elapsed is None and out.delta.token_ids:
                elapsed = time.perf_counter() - start
    assert elapsed is not None
    return elapsed, report


def run_bench_documents(
    model: str = DEFAULT_MODEL_NAME,
    json_path: str | None = None,
    *,
    data: Path | None = None,
    num_trials: int = 5,
    policy: str = "reuse",
    glue: str = "reuse",
    threads: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Full, cold and warm TTFT per trial; print a table, return (and write) flat JSON."""
    from ragspeed.engine.native.core.factory import build_llm_engine
    from ragspeed.engine.native.loading.loader import resolve_model_path

    require_positive(num_trials=num_trials)
    options = DocumentCacheOptions(policy, glue=glue)  # ValueError names a bad policy or glue
    if threads is not None:
        require_positive(threads=threads)
        torch.set_num_threads(threads)
    trials = file_trials(data, num_trials) if data is not None else shipped_trials(num_trials)
    engine = build_llm_engine(
        EngineConfig(
            model=str(resolve_model_path(model)),
            num_kv_cache_tokens=32768,
            enable_prefix_caching=True,
            seed=seed,
        )
    )
    if engine.documents is None:
        raise ValueError(f"{model}: its rope cannot be shifted, so document KV cannot be reused")
    with torch.inference_mode():
        trial_times = _measure_trials(engine, options, trials)
    results: dict[str, Any] = {
        "model": model,
        "data": str(data) if data else "shipped passages",
        "num_trials": num_trials,
        "policy": policy,
        "glue": glue,
        **_summarize(engine, trial_times, copy_bandwidth()),
        "threads": torch.get_num_threads(),
        "prefill": prefill_line(engine),
    }
    print_table(results)
    write_json(json_path, results)
    return results


def _measure_trials(
    engine: Any, options: DocumentCacheOptions, trials: list[tuple[str, list[Document]]]
) -> dict[str, list[float]]:
    """Per trial: TTFT seconds of the full prompt [full], of its documents new to the store
    [cold] and stored [warm]; the warm request's fresh tokens, prompt tokens, placed tokens
    and tokens per document."""
    tokenizer = engine.tokenizer

    def request(name: str, question: str, documents: list[Document], cached: bool, salt: str):
        segments = Segments(SYSTEM_PROMPT, tuple(documents), (), question)
        prompt = assemble_prompt(tokenizer, segments, documents, document_spans=cached)
        return GenerationRequest(
            name,
            prompt.token_ids,
            _GREEDY,
            cache_salt=salt,
            document_spans=prompt.document_spans,
            document_cache=options if cached else None,
        )

    times: dict[str, list[float]] = {
        key: [] for key in ("full", "cold", "warm", "fresh", "prompt_tokens", "placed", "document_tokens")
    }
    # Warm-up (not timed): kernels, allocators, and the system prompt in the prefix cache
    # of the full requests (salt "full"; the documents reversed, so no trial's prompt is).
    question, documents = trials[0]
    _ttft(engine, request("warmup-full", question, documents[::-1], False, "full"))
    _ttft(engine, request("warmup-cached", question, documents, True, "warmup"))
    for t, (question, documents) in enumerate(trials):
        salt = f"trial-{t}"  # every trial's documents are new to the store
        full_request = request(f"full-{t}", question, documents, False, "full")
        times["full"].append(_ttft(engine, full_request)[0])
        times["cold"].append(_ttft(engine, request(f"cold-{t}", question, documents[::-1], True, salt))[0])
        warm_request = request(f"warm-{t}", question, documents, True, salt)
        seconds, report = _ttft(engine, warm_request)
        times["warm"].append(seconds)
        times["fresh"].append(report.num_recomputed_tokens + 1)  # and the last prompt token
        times["prompt_tokens"].append(len(full_request.prompt_token_ids))
        spans = warm_request.document_spans
        times["placed"].append(sum(e - s for s, e in spans))
        times["document_tokens"].append(times["placed"][-1] / len(spans))
    return times


def _summarize(engine: Any, trials: dict[str, list[float]], bandwidth: float) -> dict[str, Any]:
    """Medians of the trials, the warm TTFT's bound (fresh tokens at the full prompt's rate
    per token, plus the placed KV's bytes at the copy bandwidth) and the store's footprint."""
    from ragspeed.engine.native.core.document_kv import STORAGE_DTYPES

    full, cold, warm = (statistics.median(trials[key]) for key in ("full", "cold", "warm"))
    shape = engine.runner.kv_pool.kv.shape  # [2, L, blocks, block_size, H, D]
    per_token = shape[0] * shape[1] * shape[4] * shape[5]  # K and V elements of one token
    stored = STORAGE_DTYPES[engine.documents.storage_dtype].itemsize
    pool = engine.runner.kv_pool.kv.element_size()
    placed_bytes = (
        statistics.median(trials["placed"]) * per_token * (stored + pool)
    )  # stored read, pool written
    per_prompt_token_s = statistics.median(f / p for f, p in zip(trials["full"], trials["prompt_tokens"]))
    bound = statistics.median(trials["fresh"]) * per_prompt_token_s + placed_bytes / bandwidth
    weights_s = engine.runner.model.num_weight_bytes_per_token / bandwidth
    tokens_per_document = statistics.mean(trials["document_tokens"])
    return {
        "prompt_tokens": statistics.median(trials["prompt_tokens"]),
        "tokens_per_document": tokens_per_document,
        "ttft_full_ms": full * 1000,
        "ttft_cold_ms": cold * 1000,
        "ttft_warm_ms": warm * 1000,
        "warm_over_full": warm / full,
        "cold_over_full": cold / full,
        "fresh_tokens": statistics.median(trials["fresh"]),
        "ttft_warm_bound_ms": bound * 1000,
        "warm_over_bound": warm / bound,
        "ttft_warm_bound_weights_ms": (bound + weights_s) * 1000,
        "copy_gb_per_s": bandwidth / 1e9,
        "store_bytes_per_token": per_token * stored,
        "store_documents_per_gb": 1e9 / (per_token * stored * tokens_per_document),
        "store_bytes_per_token_by_format": {
            name: per_token * dtype.itemsize for name, dtype in STORAGE_DTYPES.items()
        },
    }


def print_table(r: dict[str, Any]) -> None:
    print(machine_line(r["threads"]))
    print(r["prefill"])
    print(
        f"document cache, {r['model']}: {r['num_trials']} trials ({r['data']}), "
        f"{r['prompt_tokens']:.0f}-token prompts, policy {r['policy']}, glue {r['glue']}"
    )
    print(f"  {'TTFT full prefill':28s} {r['ttft_full_ms']:10.1f} ms")
    print(
        f"  {'TTFT cold (first sight)':28s} {r['ttft_cold_ms']:10.1f} ms   ({r['cold_over_full']:.2f}x full)"
    )
    print(
        f"  {'TTFT warm (documents stored)':28s} {r['ttft_warm_ms']:10.1f} ms   ({r['warm_over_full']:.3f}x full,"
        f" {r['fresh_tokens']:.0f} fresh tokens)"
    )
    print(
        f"  {'warm bound':28s} {r['ttft_warm_bound_ms']:10.1f} ms   (warm {r['warm_over_bound']:.2f}x its bound;"
        f" copy {r['copy_gb_per_s']:.1f} GB/s)"
    )
    print(f"  {'warm bound, one weight read':28s} {r['ttft_warm_bound_weights_ms']:10.1f} ms")
    print(
        f"  store: {r['store_bytes_per_token'] / 1024:.1f} KiB a token,"
        f" {r['store_documents_per_gb']:,.0f} documents per GB"
    )
    formats = ", ".join(f"{name} {size:,}" for name, size in r["store_bytes_per_token_by_format"].items())
    print(f"  store bytes per token by format: {formats}")


def _hit_rate_prompts(
    tokenizer: Any, trials: list[tuple[str, list[Document]]]
) -> list[tuple[GenerationRequest, list[int], list[tuple[int, ...]]]]:
    """Per question: its request as the gateway lays it out (document spans marked), the prefix
    before its first document, and each document's token ids."""
    prompts = []
    for index, (question, documents) in enumerate(trials):
        segments = Segments(SYSTEM_PROMPT, tuple(documents), (), question)
        prompt = assemble_prompt(tokenizer, segments, documents, document_spans=True)
        spans = prompt.document_spans
        tokens = prompt.token_ids
        request = GenerationRequest(
            f"q{index}", tokens, _GREEDY, document_spans=spans, document_cache=DocumentCacheOptions("reuse")
        )
        prompts.append((request, list(tokens[: spans[0][0]]), [tuple(tokens[s:e]) for s, e in spans]))
    return prompts


def _kv_layout(model_path: Path, storage_dtype: str) -> KVLayout:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    num_heads = config.num_attention_heads
    return KVLayout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        dtype=storage_dtype,
    )


def run_hit_rate(
    model: str = DEFAULT_MODEL_NAME,
    json_path: str | None = None,
    *,
    data: Path | None = None,
    num_trials: int = 60,
    bookkeeping: bool = False,
    ram_bytes: int | None = None,
    disk_bytes: int | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """The store's hit rate over a pass of the questions and the same questions reversed."""
    from transformers import AutoTokenizer

    from ragspeed.engine.native.core.document_kv import open_document_store
    from ragspeed.engine.native.loading.loader import resolve_model_path

    require_positive(num_trials=num_trials)
    if threads is not None:
        require_positive(threads=threads)
        torch.set_num_threads(threads)
    trials = file_trials(data, num_trials) if data is not None else shipped_trials(num_trials)
    model_path = resolve_model_path(model)
    defaults = EngineConfig()
    with tempfile.TemporaryDirectory(prefix="ragspeed-hit-rate-") as folder:
        config = EngineConfig(
            model=str(model_path),
            enable_prefix_caching=True,
            document_cache_bytes=ram_bytes,
            document_cache_dir=folder,
            document_cache_disk_bytes=defaults.document_cache_disk_bytes
            if disk_bytes is None
            else disk_bytes,
        )
        layout = _kv_layout(model_path, config.document_cache_dtype)
        if bookkeeping:
            tokenizer = AutoTokenizer.from_pretrained(model_path)
            pool_shape = [2, layout.num_layers, 1, 1, layout.num_kv_heads, layout.head_dim]
            store = open_document_store(config, f"bookkeeping:{model}", pool_shape)
            lookup = _bookkeeping_lookup(store, layout, f"bookkeeping:{model}")
        else:
            from ragspeed.engine.native.core.factory import build_llm_engine

            engine = build_llm_engine(config)
            if engine.documents is None:
                raise ValueError(f"{model}: its rope cannot be shifted, so document KV cannot be reused")
            tokenizer, store = engine.tokenizer, engine.documents.store
            lookup = _engine_lookup(engine)
        prompts = _hit_rate_prompts(tokenizer, trials)
        passes = {}
        started = time.perf_counter()
        for name, order in (("first", prompts), ("reversed", prompts[::-1])):
            counts = {"documents": 0, "hits": 0, "ram": 0, "disk": 0}
            for number, prompt in enumerate(order, start=1):
                for key, value in lookup(prompt).items():
                    counts[key] += value
                if number % 10 == 0:
                    print(
                        f"  {name} pass: {number}/{len(order)} questions, {time.perf_counter() - started:.0f} s",
                        file=sys.stderr,
                    )
            passes[name] = counts
        stats = store.stats
    per_document = statistics.mean(len(tokens) for _, _, documents in prompts for tokens in documents)
    bytes_per_token = math.prod(layout.shape(1)) * DTYPE_ITEMSIZES[layout.dtype]
    results: dict[str, Any] = {
        "model": model,
        "data": str(data) if data else "shipped passages",
        "num_questions": num_trials,
        "mode": "bookkeeping" if bookkeeping else "engine",
        "tokens_per_document": per_document,
        "bytes_per_token": bytes_per_token,
        "bytes_per_document": per_document * bytes_per_token,
        "ram_capacity_bytes": stats.capacity_bytes,
        "disk_capacity_bytes": stats.disk_capacity_bytes,
        "disk_bytes": stats.disk_bytes,
        "ram_evictions": stats.evictions,
        "disk_evictions": stats.disk_evictions,
        "seconds": time.perf_counter() - started,
        "threads": torch.get_num_threads(),
    }
    for name, counts in passes.items():
        documents = max(counts["documents"], 1)
        results[f"{name}_documents"] = counts["documents"]
        results[f"{name}_hit_rate"] = counts["hits"] / documents
        results[f"{name}_ram_hit_rate"] = counts["ram"] / documents
        results[f"{name}_disk_hit_rate"] = counts["disk"] / documents
    print_hit_rate(results)
    write_json(json_path, results)
    return results


def _bookkeeping_lookup(store: Any, layout: KVLayout, fingerprint: str):
    """A question's documents looked up in `store` as the engine looks them up, and the missed
    ones stored with payloads of their real size (zeros: one shared read-only buffer)."""
    zeros = memoryview(bytes(1 << 20)).toreadonly()

    def lookup(prompt: tuple[GenerationRequest, list[int], list[tuple[int, ...]]]) -> dict[str, int]:
        nonlocal zeros
        _, prefix, documents = prompt
        counts = {"documents": len(documents), "hits": 0, "ram": 0, "disk": 0}
        for token_ids in documents:
            key = document_key(fingerprint, None, prefix, token_ids)
            found = store.find(key, token_ids)
            if found is not None:
                counts["hits"] += 1
                counts[found.tier] += 1
                continue
            shape = layout.shape(len(token_ids))
            num_bytes = DTYPE_ITEMSIZES[layout.dtype] * math.prod(shape)
            if num_bytes > len(zeros):
                zeros = memoryview(bytes(2 * num_bytes)).toreadonly()
            store.put(DocumentKV(key, token_ids, len(prefix), layout.dtype, shape, zeros[:num_bytes]))
        return counts

    return lookup


def _engine_lookup(engine: Any):
    """A question run through the engine (one token, glue recomputed): its documents' hits by tier."""

    def lookup(prompt: tuple[GenerationRequest, list[int], list[tuple[int, ...]]]) -> dict[str, int]:
        request = prompt[0]
        _, report = _ttft(engine, request)
        return {
            "documents": report.num_hit + report.num_computed,
            "hits": report.num_hit,
            "ram": report.num_hit_ram,
            "disk": report.num_hit_disk,
        }

    return lookup


def print_hit_rate(r: dict[str, Any]) -> None:
    print(machine_line(r["threads"]))
    print(
        f"document store hit rate, {r['model']} ({r['mode']}): {r['num_questions']} questions ({r['data']}),"
        f" {r['tokens_per_document']:.0f} tokens a document, {r['bytes_per_document'] / 1e6:.2f} MB stored"
    )
    print(
        f"  budgets: RAM {r['ram_capacity_bytes'] / 2**20:,.0f} MiB, disk {r['disk_capacity_bytes'] / 2**20:,.0f} MiB;"
        f" {r['disk_bytes'] / 2**20:,.0f} MiB on disk after both passes;"
        f" evictions RAM {r['ram_evictions']}, disk {r['disk_evictions']}"
    )
    for name in ("first", "reversed"):
        print(
            f"  {name + ' pass':16s} {r[f'{name}_hit_rate']:7.1%} of {r[f'{name}_documents']} documents hit"
            f" (RAM {r[f'{name}_ram_hit_rate']:.1%}, disk {r[f'{name}_disk_hit_rate']:.1%})"
        )


@click.command("documents")
@model_option
@json_option
@click.option(
    "--data",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="QA jsonl whose questions' documents are used  [default: passages of the shipped system_prompt.txt]",
)
@click.option("--num-trials", default=5, type=click.IntRange(min=1), help="questions, each with 20 documents")
@click.option(
    "--policy", default="reuse", type=click.Choice(["reuse", "sink", "blend"]), help="repair policy"
)
@click.option(
    "--glue", default="reuse", type=click.Choice(DOCUMENT_GLUE_MODES), help="the glue between documents"
)
@click.option(
    "--threads", default=None, type=click.IntRange(min=1), help="torch CPU threads (default: torch's)"
)
@click.option(
    "--hit-rate",
    is_flag=True,
    help="measure the store's hit rate over a pass of the questions and the same questions reversed",
)
@click.option(
    "--bookkeeping",
    is_flag=True,
    help="--hit-rate without the model: the store fed payloads of the real size",
)
@click.option(
    "--ram-bytes",
    default=None,
    type=click.IntRange(min=0),
    help="--hit-rate: RAM tier budget [default: the store's]",
)
@click.option(
    "--disk-bytes",
    default=None,
    type=click.IntRange(min=0),
    help="--hit-rate: disk tier budget [default: the store's]",
)
def bench_documents(
    model: str,
    json_path: str | None,
    data: Path | None,
    num_trials: int,
    policy: str,
    glue: str,
    threads: int | None,
    hit_rate: bool,
    bookkeeping: bool,
    ram_bytes: int | None,
    disk_bytes: int | None,
) -> None:
    """Warm TTFT of a 20-document request from the document store, against full prefill and its
    bound; or (--hit-rate) the store's hit rate over a corpus."""
    try:
        if hit_rate:
            run_hit_rate(
                model,
                json_path,
                data=data,
                num_trials=num_trials,
                bookkeeping=bookkeeping,
                ram_bytes=ram_bytes,
                disk_bytes=disk_bytes,
                threads=threads,
            )
            return
        run_bench_documents(
            model, json_path, data=data, num_trials=num_trials, policy=policy, glue=glue, threads=threads
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from error
