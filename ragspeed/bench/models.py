"""`ragspeed models ...`: the model zoo's command, tooling beside the engine: build a benchmark
model (a real architecture with seeded random weights, engine.native.loading.model_zoo) ahead of its first use,
and list the zoo.

Command logic lives in plain functions returning dicts (`build_model`, `list_zoo`); the click
commands print them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from ragspeed.engine.native.loading.model_zoo import BENCH_MODELS, ZOO_NAMES, build_bench_model, list_models


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


@click.group(name="models", help=f"The model zoo: {', '.join(ZOO_NAMES)}.")
def models_group() -> None:
    pass


@models_group.command(
    "build",
    help="Build a benchmark model (real architecture, seeded random weights) in HF format.\n\n"
    f"NAME is a bench model: {', '.join(BENCH_MODELS)}.",
)
@click.argument("name")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder to write (default: $RAGSPEED_CACHE_DIR/<name> or ~/.cache/ragspeed/models/<name>).",
)
def build_command(name: str, out: Path | None) -> None:
    try:
        result = build_model(name, out)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="NAME") from error
    click.echo(
        f"{result['name']}: {result['path']} ({result['size_bytes'] / 1e6:.1f} MB, {result['build_seconds']:.1f} s)"
    )


@models_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_command(as_json: bool) -> None:
    """List the zoo's models, where they live and whether they are built."""
    rows = list_zoo()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        state = f"{row['size_bytes'] / 1e6:.1f} MB" if row["available"] else "not built"
        click.echo(
            f"{row['name']:<14} {row['kind']:<8} {state:<10} {row['path']}\n{'':<24}{row['description']}"
        )
