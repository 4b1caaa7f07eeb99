"""`ragspeed eval compression`: every method side by side with the baselines, in one run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import typer

from ragspeed.compression.evaluation import FACTORS, evaluate, flatten, format_table, load_examples

eval_app = typer.Typer(help="Quality and latency evaluations.", no_args_is_help=True)

DEFAULT_METHODS = "first-docs,bm25,fast,coarse-to-fine"


@eval_app.callback()
def _group() -> None:
    """Keeps `compression` a subcommand (`ragspeed eval compression`) even while it is the only one."""


def load_tokenizer(name_or_path: str | None):
    """A tokenizer by local path or name; default: the bundled MiniLM's."""
    from transformers import AutoTokenizer

    from ragspeed.compression.scoring.static_encoder import minilm_path

    try:
        return AutoTokenizer.from_pretrained(name_or_path or minilm_path())
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(f"cannot load tokenizer {name_or_path!r}: {exc}", param_hint="--tokenizer") from exc


def run_compression_eval(
    data: str,
    *,
    limit: int | None = None,
    methods: str = DEFAULT_METHODS,
    factors: tuple[int, ...] = FACTORS,
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
    tok = load_tokenizer(tokenizer)
    names = [m.strip() for m in methods.split(",") if m.strip()]
    if llmlingua2_model and "llmlingua2" not in names:
        names.append("llmlingua2")
    import torch

    setup: dict = {
        "num_examples": len(examples),
        "cpu_load_1min": os.getloadavg()[0],
        "tokenizer": tokenizer or "minilm",
        "torch_threads": torch.get_num_threads(),
    }
    if {"fast", "coarse-to-fine"} & set(names):
        _, setup["static_distill_s"] = ensure_static_model()
    compressors = {}
    for name in names:
        start = time.perf_counter()
        if name in ("fast", "coarse-to-fine"):
            compressors[name] = build_compressor(name, cache=EmbeddingCache(100_000), order=order)
        elif name == "llmlingua2":
            compressors[name] = build_compressor(name, model_path=llmlingua2_model)
        else:
            compressors[name] = build_compressor(name)
        setup[f"{name}_load_s"] = round(time.perf_counter() - start, 2)
    results = evaluate(examples, compressors, tok, factors=factors, cold_every_factor=cold_every_factor)
    setup["cpu_load_1min_after"] = os.getloadavg()[0]
    return {"flat": flatten(results), "results": results, "setup": setup}


@eval_app.command("compression")
def compression_command(
    data: Path = typer.Option(..., "--data", help="QA jsonl (nq_dev.jsonl, hotpot_dev100.jsonl)"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="write the flat figures here"),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="first N examples"),
    methods: str = typer.Option(DEFAULT_METHODS, "--methods", help="comma-separated method names"),
    rates: str = typer.Option("4,8,16,32", "--rates", help="compression factors (4 = keep 1/4)"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="target tokenizer: local path or name"),
    llmlingua2_model: Optional[str] = typer.Option(None, "--llmlingua2-model", help="local LLMLingua-2 folder"),
    order: str = typer.Option("original", "--order", help="original | edges"),
    cold_every_factor: bool = typer.Option(False, "--cold-every-rate", help="cold latency at every rate, not only the first"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch threads for this run (default: torch's)"),
) -> None:
    """Answer retention, achieved ratio and cold/warm latency, per method and rate."""
    try:
        factors = tuple(int(r) for r in rates.split(","))
    except ValueError as exc:
        raise typer.BadParameter(f"expected integers like 4,8,16,32, got {rates!r}", param_hint="--rates") from exc
    if any(f < 1 for f in factors):
        raise typer.BadParameter("factors must be >= 1", param_hint="--rates")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    out = run_compression_eval(
        str(data), limit=limit, methods=methods, factors=factors, tokenizer=tokenizer,
        llmlingua2_model=llmlingua2_model, order=order, cold_every_factor=cold_every_factor,
    )
    setup = out["setup"]
    typer.echo(
        f"{setup['num_examples']} examples from {data}; static model distilled in "
        f"{setup.get('static_distill_s', 0.0):.1f} s (0 = cached on disk); CPU load "
        f"{setup['cpu_load_1min']:.1f} -> {setup['cpu_load_1min_after']:.1f} on {os.cpu_count()} cores, "
        f"{setup['torch_threads']} torch threads"
    )
    typer.echo(format_table(out["results"]))
    if json_path is not None:
        json_path.write_text(json.dumps({**out["flat"], **{f"setup_{k}": v for k, v in setup.items()}}, indent=1))
        typer.echo(f"wrote {json_path}")
