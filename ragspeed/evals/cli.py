"""`ragspeed eval compression` (every method side by side with the baselines, in one run),
`ragspeed eval retrieval` (recall and latency of dense, BM25 and hybrid search; the index at scale)
and `ragspeed eval rag` (answer accuracy beside latency through the real gateway and engine).

Command logic lives in plain functions returning dicts; the click commands print them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from ragspeed.bench.common import (
    json_option,
    machine_line,
    print_rows,
    qa_data_option,
    seed_option,
    write_json,
)
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME
from ragspeed.evals.compression import FACTORS, evaluate, flatten, format_table, load_examples
from ragspeed.retrieval.config import IndexConfig, RetrievalConfig
from ragspeed.retrieval.errors import RetrievalError

DEFAULT_METHODS = "first-docs,bm25,fast,coarse-to-fine"


@click.group(name="eval")
def eval_group() -> None:
    """Quality evaluations of compression, retrieval and whole RAG answers on QA data files."""


def load_tokenizer(model: str = DEFAULT_MODEL_NAME, tokenizer: str | None = None):
    """The served model's tokenizer, which the gateway counts budgets with: `tokenizer` when
    given (a local path or hub id, as `ragspeed serve --tokenizer`), else `model`'s (a zoo name,
    a folder, a .gguf file or a hub id, as `ragspeed serve --model`)."""
    from transformers import AutoTokenizer

    from ragspeed.engine.native.loading.model_zoo import ModelUnavailableError, resolve_model

    try:
        return AutoTokenizer.from_pretrained(tokenizer or resolve_model(model, tokenizer_only=True))
    except (OSError, ValueError, ModelUnavailableError) as exc:
        option, name = ("--tokenizer", tokenizer) if tokenizer else ("--model", model)
        raise click.BadParameter(f"cannot load the tokenizer of {name!r}: {exc}", param_hint=option) from exc


def run_compression_eval(
    data: str,
    *,
    limit: int | None = None,
    methods: str = DEFAULT_METHODS,
    factors: tuple[int, ...] = FACTORS,
    model: str = DEFAULT_MODEL_NAME,
    tokenizer: str | None = None,
    llmlingua2_model: str | None = None,
    order: str = "original",
    cold_every_factor: bool = False,
) -> dict:
    """Run the evaluation; returns {"flat": {...}, "results": {...}, "setup": {...}}."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ragspeed.compression.registry import build_compressor
    from ragspeed.compression.scoring.embedding_cache import EmbeddingCache
    from ragspeed.compression.scoring.static_encoder import ensure_static_model

    examples = load_examples(data, limit)
    tok = load_tokenizer(model, tokenizer)
    names = [m.strip() for m in methods.split(",") if m.strip()]
    if llmlingua2_model and "llmlingua2" not in names:
        names.append("llmlingua2")
    import torch

    setup: dict = {
        "num_examples": len(examples),
        "cpu_load_1min": os.getloadavg()[0],
        "tokenizer": tokenizer or model,
        "torch_threads": torch.get_num_threads(),
    }
    if {"fast", "coarse-to-fine", "top-docs"} & set(names):
        _, setup["static_distill_s"] = ensure_static_model()
    compressors = {}
    for name in names:
        start = time.perf_counter()
        if name in ("fast", "coarse-to-fine", "top-docs"):
            compressors[name] = build_compressor(name, cache=EmbeddingCache(100_000), order=order)
        elif name == "llmlingua2":
            compressors[name] = build_compressor(name, model_path=llmlingua2_model)
        else:
            compressors[name] = build_compressor(name)
        setup[f"{name}_load_s"] = round(time.perf_counter() - start, 2)
    results = evaluate(examples, compressors, tok, factors=factors, cold_every_factor=cold_every_factor)
    setup["cpu_load_1min_after"] = os.getloadavg()[0]
    return {"flat": flatten(results), "results": results, "setup": setup}


@eval_group.command("compression")
@qa_data_option("QA jsonl (nq_dev.jsonl, hotpot_dev100.jsonl)")
@json_option
@click.option("--limit", default=None, type=click.IntRange(min=1), help="first N examples")
@click.option("--methods", default=DEFAULT_METHODS, help="comma-separated method names")
@click.option("--rates", default="4,8,16,32", help="compression factors (4 = keep 1/4)")
@click.option(
    "--model",
    default=DEFAULT_MODEL_NAME,
    show_default=True,
    help="the served model, whose tokenizer counts the tokens: a zoo name, a folder, a .gguf file or a hub id",
)
@click.option("--tokenizer", default=None, help="its tokenizer instead, as `ragspeed serve --tokenizer`")
@click.option("--llmlingua2-model", default=None, help="local LLMLingua-2 folder")
@click.option("--order", default="original", help="original | edges")
@click.option(
    "--cold-every-rate",
    "cold_every_factor",
    is_flag=True,
    help="cold latency at every rate, not only the first",
)
@click.option(
    "--threads",
    default=None,
    type=click.IntRange(min=1),
    help="torch threads for this run (default: torch's)",
)
def compression_command(
    data: Path,
    json_path: str | None,
    limit: int | None,
    methods: str,
    rates: str,
    model: str,
    tokenizer: str | None,
    llmlingua2_model: str | None,
    order: str,
    cold_every_factor: bool,
    threads: int | None,
) -> None:
    """Answer retention, achieved ratio and cold/warm latency, per method and rate."""
    try:
        factors = tuple(int(r) for r in rates.split(","))
    except ValueError as exc:
        raise click.BadParameter(
            f"expected integers like 4,8,16,32, got {rates!r}", param_hint="--rates"
        ) from exc
    if any(f < 1 for f in factors):
        raise click.BadParameter("factors must be >= 1", param_hint="--rates")
    if not data.is_file():
        raise click.BadParameter(f"{data} is not a file", param_hint="--data")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    out = run_compression_eval(
        str(data),
        limit=limit,
        methods=methods,
        factors=factors,
        model=model,
        tokenizer=tokenizer,
        llmlingua2_model=llmlingua2_model,
        order=order,
        cold_every_factor=cold_every_factor,
    )
    setup = out["setup"]
    click.echo(machine_line(setup["torch_threads"]))
    click.echo(
        f"{setup['num_examples']} examples from {data}; static model distilled in "
        f"{setup.get('static_distill_s', 0.0):.1f} s (0 = cached on disk); CPU load "
        f"{setup['cpu_load_1min']:.1f} -> {setup['cpu_load_1min_after']:.1f}"
    )
    click.echo(format_table(out["results"]))
    if json_path is not None:
        write_json(json_path, {**out["flat"], **{f"setup_{k}": v for k, v in setup.items()}})
        click.echo(f"wrote {json_path}")


def run_retrieval_eval(
    data: Path,
    *,
    distractors: Path | None,
    scale_n: int,
    scale_index: str,
    scale_queries: int,
    scale_clusters: int,
    model: str | None,
    config: RetrievalConfig | None = None,
) -> dict[str, Any]:
    from ragspeed.evals.retrieval import evaluate_quality, evaluate_scale

    result: dict[str, Any] = {}
    if not data.is_file():
        raise RetrievalError(f"--data {data} is not a file", "data")
    if distractors is not None and not distractors.is_file():
        raise RetrievalError(f"--distractors {distractors} is not a file", "distractors")
    from ragspeed.retrieval.embedders import SentenceTransformerEmbedder

    config = config or RetrievalConfig()
    embedder = SentenceTransformerEmbedder(model, progress_min_texts=config.progress_min_texts)
    result.update(evaluate_quality(data, embedder, config, distractors))
    if scale_n > 0:
        # The scale run measures the large-collection index, so "auto" means the large kind.
        kind = IndexConfig().large_index_kind if scale_index == "auto" else scale_index
        result.update(
            evaluate_scale(
                scale_n, IndexConfig(kind=kind), num_queries=scale_queries, num_clusters=scale_clusters
            )
        )
    return result


@eval_group.command("retrieval")
@qa_data_option("NQ-style QA JSONL.")
@json_option
@click.option(
    "--distractors",
    default=None,
    type=click.Path(path_type=Path),
    help="Text file, one extra passage per line.",
)
@click.option(
    "--scale-n", default=1_000_000, type=int, help="Synthetic vectors for the scale run (0 skips it)."
)
@click.option("--scale-index", default="auto", help="auto | ivf | hnsw | flat for the scale run.")
@click.option("--scale-queries", default=1000, type=int, help="Queries timed in the scale run.")
@click.option(
    "--scale-clusters", default=4096, type=int, help="Gaussian mixture components (~4 per IVF cell at 1M)."
)
@click.option("--model", default=None, help="Sentence-transformers model path (default: bundled MiniLM).")
@click.option("--rrf-k", default=RetrievalConfig().rrf_k, type=int, help="Reciprocal rank fusion constant k.")
@click.option(
    "--dense-weight",
    default=RetrievalConfig().dense_weight,
    type=float,
    help="Fusion weight of the dense ranking.",
)
@click.option(
    "--bm25-weight",
    default=RetrievalConfig().bm25_weight,
    type=float,
    help="Fusion weight of the BM25 ranking.",
)
def eval_retrieval_cmd(
    data: Path,
    json_path: str | None,
    distractors: Path | None,
    scale_n: int,
    scale_index: str,
    scale_queries: int,
    scale_clusters: int,
    model: str | None,
    rrf_k: int,
    dense_weight: float,
    bm25_weight: float,
) -> None:
    """Recall@1/5/20 (dense, BM25, hybrid) and latency on NQ passages; HNSW/IVF at scale."""
    try:
        out = run_retrieval_eval(
            data,
            distractors=distractors,
            scale_n=scale_n,
            scale_index=scale_index,
            scale_queries=scale_queries,
            scale_clusters=scale_clusters,
            model=model,
            config=RetrievalConfig(rrf_k=rrf_k, dense_weight=dense_weight, bm25_weight=bm25_weight),
        )
    except RetrievalError as exc:
        click.echo(f"error: {getattr(exc, 'message', exc)}", err=True)
        raise click.exceptions.Exit(2) from exc
    click.echo(machine_line())
    print_rows(out.items(), echo=click.echo)
    write_json(json_path, out)


def parse_settings(assignments: tuple[str, ...]) -> dict[str, Any]:
    """`KEY=VALUE` gateway settings (values parsed as YAML), checked against `ragspeed serve`'s."""
    import yaml

    from ragspeed.gateway.settings import OPTIONS

    values: dict[str, Any] = {}
    for text in assignments:
        key, sep, value = text.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise click.BadParameter(f"{text!r}: expected KEY=VALUE", param_hint="--set")
        if key not in OPTIONS:
            raise click.BadParameter(
                f"{text!r}: '{key}' is not a `ragspeed serve` setting", param_hint="--set"
            )
        values[key] = yaml.safe_load(value) if value.strip() else None
    return values


class Progress:
    """A progress bar on a terminal; elsewhere (a log, a pipe) a plain stderr line at most every
    `every_s` seconds, as a bar cannot redraw there."""

    def __init__(self, total: int, label: str, every_s: float = 10.0):
        self.total, self.label, self.every_s = total, label, every_s
        self.done = 0
        self._last = time.monotonic()
        self._bar: Any = None
        if sys.stderr.isatty():
            self._bar = click.progressbar(
                length=total, label=label, file=sys.stderr, item_show_func=lambda s: s
            )

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def step(self, what: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1, what)
        elif self.done == self.total or time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            click.echo(f"{self.label}: {self.done}/{self.total} requests ({what})", err=True)


@eval_group.command("rag")
@qa_data_option("QA jsonl (nq_dev.jsonl).")
@click.option(
    "--configs",
    "configs_spec",
    default="all",
    help="all, or comma-separated: full, retrieval, <method>@<N>x (e.g. full,coarse-to-fine@4x,retrieval).",
)
@click.option("--limit", default=None, type=click.IntRange(min=1), help="first N valid questions")
@click.option("--model", default=None, help="model to serve (default: the server's default)")
@click.option("--max-tokens", default=32, type=click.IntRange(min=1), help="tokens per answer (greedy)")
@click.option(
    "--order",
    default="original",
    type=click.Choice(["original", "edges"]),
    help="order of the documents a compressor keeps (edges: the most relevant first and last)",
)
@click.option("--top-k", default=5, type=click.IntRange(1, 100), help="passages retrieved by `retrieval`")
@click.option(
    "--system-prompt", default=None, help="system prompt (default: Lost in the Middle's instruction)"
)
@click.option("--threads", default=None, type=click.IntRange(min=1), help="engine threads (default: torch's)")
@click.option("--resamples", default=2000, type=click.IntRange(min=100), help="bootstrap resamples")
@seed_option(help="bootstrap seed")
@click.option(
    "--set", "assignments", multiple=True, help="extra `ragspeed serve` setting KEY=VALUE (repeatable)"
)
@click.option(
    "--teacher-forced/--no-teacher-forced",
    default=True,
    show_default=True,
    help="kv-* configurations: top-1 agreement and KL along full's answer (more engine time)",
)
@json_option
@click.option(
    "--html",
    "html_path",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    help="write the HTML page here",
)
def rag_command(
    data: Path,
    configs_spec: str,
    limit: int | None,
    model: str | None,
    max_tokens: int,
    order: str,
    top_k: int,
    system_prompt: str | None,
    threads: int | None,
    resamples: int,
    seed: int,
    assignments: tuple[str, ...],
    teacher_forced: bool,
    json_path: str | None,
    html_path: Path | None,
) -> None:
    """Accuracy, EM, F1, TTFT and e2e per configuration, through the gateway and engine in-process;
    fidelity against full: identical answers, and teacher-forced top-1 agreement and KL."""
    from ragspeed.evals.rag import DEFAULT_SYSTEM_PROMPT, load_examples, parse_configs, run_rag_eval
    from ragspeed.evals.rag_gateway import GatewayStartError

    if not data.is_file():
        raise click.BadParameter(f"{data} is not a file", param_hint="--data")
    try:
        configs = parse_configs(configs_spec, top_k=top_k)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--configs") from exc
    values = _rag_settings(assignments, order, model, threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    examples, _ = load_examples(data)  # for the progress bar's length; the run reads it again
    num_valid = len(examples) if limit is None else min(limit, len(examples))
    total = len(configs) * (num_valid + 1)  # a warm-up per configuration
    try:
        with Progress(total, "eval rag") as progress:
            report = run_rag_eval(
                data,
                configs,
                limit=limit,
                settings_values=values,
                system_prompt=system_prompt or DEFAULT_SYSTEM_PROMPT,
                max_tokens=max_tokens,
                on_done=progress.step,
                num_resamples=resamples,
                seed=seed,
                teacher_forced=teacher_forced,
            )
    except (ValueError, GatewayStartError) as exc:
        raise click.ClickException(str(exc)) from exc
    _report_rag(report, data, max_tokens, threads, json_path, html_path)


def _rag_settings(
    assignments: tuple[str, ...], order: str, model: str | None, threads: int | None
) -> dict[str, Any]:
    """The gateway's settings: the `--set` ones, then the flags that name settings."""
    values = parse_settings(assignments)
    values["compression_order"] = order
    if model is not None:
        values["model"] = model
    if threads is not None:
        values["num_threads"] = threads
    return values


def _report_rag(
    report: dict[str, Any],
    data: Path,
    max_tokens: int,
    threads: int | None,
    json_path: str | None,
    html_path: Path | None,
) -> None:
    """Print the machine, the setup and the table; write the JSON and the HTML page."""
    import torch

    from ragspeed.evals.rag import format_text

    machine = machine_line(threads or torch.get_num_threads())
    report["machine"] = machine
    click.echo(machine)
    setup = report["setup"]
    click.echo(
        f"{setup['num_examples']} questions from {data}, model {setup['model']}, order {setup['compression_order']}, "
        f"max_tokens {max_tokens}; gateway started in {setup['gateway_start_s']:.1f} s, run {setup['run_s']:.1f} s"
    )
    click.echo(format_text(report))
    write_json(json_path, report)
    if json_path is not None:
        click.echo(f"wrote {json_path}")
    if html_path is not None:
        from ragspeed.evals.rag_report import render_html

        html_path.parent.mkdir(parents=True, exist_ok=True)
        html_path.write_text(render_html(report, machine), encoding="utf-8")
        click.echo(f"wrote {html_path}")
