"""`ragspeed train-demo`, `train-draft` and `train-rag`: the tools that write the bundled models.

Each writes only where `--out` says (never into the installed package; `train-draft` of a zoo
model with a trained draft in the zoo writes, by default, that draft's cache folder) and reads
its data only from `--data-dir`, by default the data shipped in ragspeed/data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME
from ragspeed.shipped_data import DATA_DIR

_DATA_DIR_HELP = "Folder with wiki_passages.txt and wikitext2_raw_test.txt."

# The step cap every training command takes, and the thread count of the two whose default
# (None: the recipe's one thread) suits a shared CPU.
max_steps_option = click.option(
    "--max-steps",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after this many steps, if sooner than the budget.",
)
shared_cpu_threads_option = click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="torch threads (default 1: fastest on a shared CPU).",
)


def _check_data_dir(data_dir: Path) -> None:
    from ragspeed.training.corpus import PASSAGES_FILE, WIKITEXT_FILE

    missing = [name for name in (PASSAGES_FILE, WIKITEXT_FILE) if not (data_dir / name).is_file()]
    if missing:
        raise click.BadParameter(f"{data_dir} has no {' and no '.join(missing)}", param_hint="--data-dir")


def run_train_demo(
    out: Path,
    data_dir: Path,
    minutes: float,
    seed: int,
    max_steps: int | None,
    threads: int | None,
) -> dict[str, Any]:
    from ragspeed.training.demo import train_demo  # torch and transformers load only when training

    return train_demo(
        out, data_dir=data_dir, minutes=minutes, seed=seed, max_steps=max_steps, num_threads=threads
    )


@click.command("train-demo")
@click.option(
    "--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Output folder (replaced)."
)
@click.option(
    "--data-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=DATA_DIR,
    show_default="the shipped data",
    help=_DATA_DIR_HELP,
)
@click.option(
    "--minutes",
    type=click.FloatRange(min=0.1),
    default=20.0,
    help="Training time budget in minutes (the learning-rate schedule spans it).",
)
@click.option("--seed", type=int, default=0, help="Seed of the data split, examples, and weights.")
@max_steps_option
@shared_cpu_threads_option
def train_demo(
    out: Path, data_dir: Path, minutes: float, seed: int, max_steps: int | None, threads: int | None
) -> None:
    """Train the demo model (tokenizer, tiny Llama, model card) from the passages and WikiText."""
    _check_data_dir(data_dir)
    figures = run_train_demo(out, data_dir, minutes, seed, max_steps, threads)
    figures.pop("losses", None)
    click.echo(json.dumps(figures, indent=2))


def run_train_draft(
    target: Path,
    out: Path,
    data_dir: Path,
    minutes: float,
    seed: int,
    max_steps: int | None,
    threads: int | None,
    num_layers: int = 2,
    command: str | None = None,
    draft_vocab_size: int | None = 4096,
) -> dict[str, Any]:
    from ragspeed.training.distill import DistillRecipe, distill_draft  # torch loads only here

    return distill_draft(
        target,
        out,
        data_dir=data_dir,
        minutes=minutes,
        seed=seed,
        max_steps=max_steps,
        num_threads=threads,
        recipe=DistillRecipe(num_hidden_layers=num_layers, draft_vocab_size=draft_vocab_size),
        command=command,
    )


@click.command("train-draft")
@click.option(
    "--target",
    default=DEFAULT_MODEL_NAME,
    show_default=True,
    help="Target model: a model-zoo name or a local folder.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Output folder (replaced). Default, for a zoo model with a trained draft in the zoo"
    " (smollm2-135m-instruct): that draft's cache folder, where --speculative draft finds it.",
)
@click.option(
    "--data-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=DATA_DIR,
    show_default="the shipped data",
    help=_DATA_DIR_HELP,
)
@click.option(
    "--minutes",
    type=click.FloatRange(min=0.1),
    default=55.0,
    show_default=True,
    help="Time budget in minutes for the target's continuations and the distillation (the"
    " default is the shipped draft's recipe, within an hour).",
)
@click.option("--seed", type=int, default=0, help="Seed of the prompts, sampling, data order and weights.")
@max_steps_option
@shared_cpu_threads_option
@click.option(
    "--num-layers",
    type=click.IntRange(1, 4),
    default=2,
    help="Draft layers (initialised from the target's first ones).",
)
@click.option(
    "--draft-vocab",
    type=click.IntRange(min=0),
    default=4096,
    show_default=True,
    help="Rows of the draft's LM head: the target's most frequent tokens (0, or at least the"
    " target's vocabulary: a full head tied to the embedding).",
)
def train_draft(
    target: str,
    out: Path,
    data_dir: Path,
    minutes: float,
    seed: int,
    max_steps: int | None,
    threads: int | None,
    num_layers: int,
    draft_vocab: int,
) -> None:
    """Distil a small draft model from a target (knowledge distillation), with a model card."""
    from ragspeed.engine.native.loading.model_zoo import (
        ZOO,
        ZOO_DRAFTS,
        TrainedDraftModel,
        default_cache_dir,
        resolve_model,
    )

    _check_data_dir(data_dir)
    try:
        target_dir = Path(resolve_model(target))
    except (ValueError, FileNotFoundError) as error:
        raise click.BadParameter(str(error), param_hint="--target") from error
    if not (target_dir / "config.json").is_file():
        raise click.BadParameter(f"no model in {target_dir} (no config.json)", param_hint="--target")
    zoo_draft = ZOO.get(ZOO_DRAFTS.get(target, ""))
    default_out = out is None
    if out is None:
        if not isinstance(zoo_draft, TrainedDraftModel):
            raise click.BadParameter(
                f"the zoo has no trained draft for {target!r} to write: pass --out DIR", param_hint="--out"
            )
        out = zoo_draft.local_dir(default_cache_dir())
    options = {
        "--target": target if target != DEFAULT_MODEL_NAME else None,
        "--out": None if default_out else out,
        "--data-dir": data_dir,
        "--max-steps": max_steps,
        "--threads": threads,
        "--num-layers": num_layers if num_layers != 2 else None,
        "--draft-vocab": draft_vocab if draft_vocab != 4096 else None,
    }
    command = f"ragspeed train-draft --minutes {minutes:g} --seed {seed}" + "".join(
        f" {name} {value}" for name, value in options.items() if value is not None
    )
    figures = run_train_draft(
        target_dir, out, data_dir, minutes, seed, max_steps, threads, num_layers, command, draft_vocab or None
    )
    figures.pop("losses", None)
    click.echo(json.dumps(figures, indent=2))


@click.command("train-rag")
@click.option(
    "--base",
    default=DEFAULT_MODEL_NAME,
    show_default=True,
    help="Base model: a model-zoo name or a local folder.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Output folder: adapter.safetensors, README.md (the card) and figures.json.",
)
@click.option(
    "--data-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=DATA_DIR,
    show_default="the shipped data: 100 HotpotQA questions train, 20 NQ held out",
    help="Folder with nq_dev.jsonl (300 NQ questions: lines 201-280 train, 281-300 held out) and"
    " hotpot_dev100.jsonl (100 HotpotQA questions, all train); without nq_dev.jsonl, the shipped"
    " nq_dev100.jsonl's last 20 questions are held out.",
)
@click.option(
    "--minutes",
    type=click.FloatRange(min=0.1),
    default=65.0,
    show_default=True,
    help="Training time budget (the learning-rate schedule spans it; the shipped adapter's recipe).",
)
@click.option("--seed", type=int, default=0, help="Seed of the prompts, data order and adapter weights.")
@max_steps_option
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="torch threads.")
def train_rag(
    base: str, out: Path, data_dir: Path, minutes: float, seed: int, max_steps: int | None, threads: int
) -> None:
    """Train a LoRA adapter that fits the base model to documents prefilled on their own."""
    from ragspeed.training.block_attention import Recipe, rag_data, train_rag_adapter

    try:
        rag_data(data_dir)
    except FileNotFoundError as error:
        raise click.BadParameter(str(error), param_hint="--data-dir") from error
    try:
        figures = train_rag_adapter(
            out,
            data_dir,
            base=base,
            minutes=minutes,
            max_steps=max_steps,
            threads=threads,
            recipe=Recipe(seed=seed),
            log=lambda line: click.echo(line, err=True),
        )
    except (ValueError, FileNotFoundError) as error:
        raise click.BadParameter(str(error), param_hint="--base") from error
    figures.pop("losses", None)
    click.echo(json.dumps(figures, indent=2))
