"""`ragspeed models ...` (the model zoo), `ragspeed train-demo` and `ragspeed train-draft`;
mounted by gateway/cli.py.

Command logic lives in plain functions returning dicts (`build_model`, `list_zoo`,
`run_train_demo`, `run_train_draft`); the typer commands print them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer

from ragspeed.engine.model_zoo import BENCH_MODELS, ZOO_NAMES, build_bench_model, list_models

models_app = typer.Typer(help=f"The model zoo: {', '.join(ZOO_NAMES)}.", no_args_is_help=True)


def _folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build_model(name: str, out: Path | None = None, cache_dir: Path | None = None) -> dict[str, Any]:
    if name not in BENCH_MODELS:
        raise ValueError(f"name: {name!r} is not a bench model; choose one of {', '.join(BENCH_MODELS)}")
    started = time.perf_counter()
    out_dir = build_bench_model(name, out, cache_dir=cache_dir)
    return {
        "name": name,
        "path": str(out_dir),
        "build_seconds": round(time.perf_counter() - started, 2),
        "size_bytes": _folder_size(out_dir),
    }


def list_zoo(cache_dir: Path | None = None) -> list[dict[str, Any]]:
    return list_models(cache_dir)


@models_app.command("build")
def build_command(
    name: str = typer.Argument(..., help=f"A bench model: {', '.join(BENCH_MODELS)}."),
    out: Optional[Path] = typer.Option(None, help="Folder to write (default: $RAGSPEED_CACHE_DIR/<name> or ~/.cache/ragspeed/models/<name>)."),
) -> None:
    """Build a benchmark model (real architecture, seeded random weights) in HF format."""
    try:
        result = build_model(name, out)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="NAME") from error
    typer.echo(f"{result['name']}: {result['path']} ({result['size_bytes'] / 1e6:.1f} MB, {result['build_seconds']:.1f} s)")


@models_app.command("list")
def list_command(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List the zoo's models, where they live and whether they are built."""
    rows = list_zoo()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        state = f"{row['size_bytes'] / 1e6:.1f} MB" if row["available"] else "not built"
        typer.echo(f"{row['name']:<14} {row['kind']:<8} {state:<10} {row['path']}\n{'':<24}{row['description']}")


def run_train_demo(
    out: Path, data_dir: Path, minutes: float, seed: int, max_steps: int | None, threads: int | None,
    stage: str = "base", init: Path | None = None,
) -> dict[str, Any]:
    from ragspeed.engine.training.demo import train_demo  # torch and transformers load only when training

    return train_demo(out, data_dir=data_dir, minutes=minutes, seed=seed, max_steps=max_steps, num_threads=threads,
                      stage=stage, init=init)


def train_demo(
    out: Optional[Path] = typer.Option(None, help="Output folder (default: engine/assets/ragspeed-demo, replaced)."),
    data_dir: Optional[Path] = typer.Option(None, help="Folder with wiki_passages.txt and wikitext2_raw_test.txt (default: ../shared/data)."),
    minutes: float = typer.Option(20.0, min=0.1, help="Training time budget in minutes (the learning-rate schedule spans it)."),
    seed: int = typer.Option(0, help="Seed of the data split, examples, and weights."),
    max_steps: Optional[int] = typer.Option(None, min=1, help="Stop after this many steps, if sooner than the budget."),
    threads: Optional[int] = typer.Option(None, min=1, help="torch threads (default: 1 for the base stage, fastest on a shared CPU; 2 for the others)."),
    stage: str = typer.Option("base", help="base: from scratch; copy: induction (repeated patterns and passages) with language modelling kept; finetune: copying in chat (passage quotes), patterns kept; anneal: the finetune rows, more chat, the learning rate decaying to ~0 (the last three go on from --init)."),
    init: Optional[Path] = typer.Option(None, help="The saved model the later stages (copy, finetune, anneal) go on training (its tokenizer is kept)."),
) -> None:
    """Train the bundled demo model (tokenizer, tiny Llama, model card) from ../shared/data, in
    stages: base, copy, finetune, anneal."""
    from ragspeed.engine.training.demo import DEFAULT_DATA_DIR, DEMO_MODEL_DIR, check_stage

    try:
        check_stage(stage, init)
    except ValueError as error:
        option, message = str(error).split(": ", 1)
        raise typer.BadParameter(message, param_hint=f"--{option}") from error
    figures = run_train_demo(out or DEMO_MODEL_DIR, data_dir or DEFAULT_DATA_DIR, minutes, seed, max_steps, threads, stage, init)
    figures.pop("losses", None)
    typer.echo(json.dumps(figures, indent=2))


def run_train_draft(
    target: Path, out: Path, data_dir: Path, minutes: float, seed: int, max_steps: int | None,
    threads: int | None, num_layers: int = 2, command: str | None = None,
) -> dict[str, Any]:
    from ragspeed.engine.training.distill import DistillRecipe, distill_draft  # torch loads only here

    return distill_draft(
        target, out, data_dir=data_dir, minutes=minutes, seed=seed, max_steps=max_steps,
        num_threads=threads, recipe=DistillRecipe(num_hidden_layers=num_layers), command=command,
    )


def train_draft(
    target: Optional[Path] = typer.Option(None, help="Target model folder (default: engine/assets/ragspeed-demo)."),
    out: Optional[Path] = typer.Option(None, help="Output folder (default: engine/assets/ragspeed-demo-draft, replaced)."),
    data_dir: Optional[Path] = typer.Option(None, help="Folder with wiki_passages.txt and wikitext2_raw_test.txt (default: ../shared/data)."),
    minutes: float = typer.Option(12.0, min=0.1, help="Time budget in minutes for the target's continuations and the distillation."),
    seed: int = typer.Option(0, help="Seed of the prompts, sampling, data order and weights."),
    max_steps: Optional[int] = typer.Option(None, min=1, help="Stop after this many steps, if sooner than the budget."),
    threads: Optional[int] = typer.Option(None, min=1, help="torch threads (default 1: fastest on a shared CPU)."),
    num_layers: int = typer.Option(2, min=1, max=4, help="Draft layers (initialised from the target's first and last)."),
) -> None:
    """Distil a small draft model from the demo model (knowledge distillation), with a model card."""
    from ragspeed.engine.training.demo import DEFAULT_DATA_DIR, DEMO_MODEL_DIR
    from ragspeed.engine.training.distill import DRAFT_MODEL_DIR

    options = {
        "--target": target, "--out": out, "--data-dir": data_dir, "--max-steps": max_steps,
        "--threads": threads, "--num-layers": num_layers if num_layers != 2 else None,
    }
    command = f"ragspeed train-draft --minutes {minutes:g} --seed {seed}" + "".join(
        f" {name} {value}" for name, value in options.items() if value is not None
    )
    figures = run_train_draft(
        target or DEMO_MODEL_DIR, out or DRAFT_MODEL_DIR, data_dir or DEFAULT_DATA_DIR, minutes,
        seed, max_steps, threads, num_layers, command,
    )
    figures.pop("losses", None)
    typer.echo(json.dumps(figures, indent=2))
