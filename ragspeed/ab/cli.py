"""`ragspeed ab`: the offline A/B runner's command."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import sys
from pathlib import Path
from typing import Any

import click

from ragspeed.ab.arms import Arm, ArmError, load_all_arms, with_overrides
from ragspeed.ab.report import build_report, format_text, render_html, require_matplotlib
from ragspeed.ab.runner import LoadShape, Observation, arm_servers, replay
from ragspeed.ab.workload import Workload, load_workload
from ragspeed.bench.common import max_tokens_option, seed_option


def run_ab(
    arms: list[Arm],
    workload: Workload,
    shape: LoadShape,
    *,
    urls: dict[str, str] | None = None,
    progress: bool = False,
    num_resamples: int = 2000,
) -> dict[str, Any]:
    """Run the experiment (starting one server per arm unless `urls` names running ones)."""
    if not workload.items:
        raise ValueError(
            f"--data: no valid request in {workload.path} ({len(workload.skipped)} invalid line(s))"
        )

    def go(urls: dict[str, str]):
        total = len(workload.items) * len(arms)
        if not progress:
            return asyncio.run(replay(arms, urls, workload.items, shape))
        with click.progressbar(
            length=total,
            label="A/B requests",
            file=sys.stderr,
            show_pos=True,
            show_eta=True,
        ) as bar:

            def on_done(obs: Observation) -> None:
                bar.update(1)

            return asyncio.run(replay(arms, urls, workload.items, shape, on_done=on_done))

    if urls is not None:
        result = go(urls)
    else:
        with arm_servers(arms) as started:
            result = go(started)
    return build_report(arms, workload, shape, result, num_resamples=num_resamples)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


@click.command(name="ab")
@click.option(
    "--arm",
    "arm_specs",
    multiple=True,
    required=True,
    metavar="FILE[:SECTION]",
    help="An arm: a YAML file of `ragspeed serve` settings, or FILE:SECTION of a file "
    "with an `arms:` mapping (repeatable; the first is the control).",
)
@click.option(
    "--set",
    "assignments",
    multiple=True,
    metavar="KEY=VALUE",
    help="A `ragspeed serve` setting applied to every arm, e.g. --set model=bench-135m (repeatable).",
)
@click.option(
    "--data",
    "data_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Workload JSONL: RAG QA records (question, answers, documents) or chat request bodies.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Use the first N valid lines.")
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=None,
    help="Closed loop with this many concurrent clients (default 1).",
)
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Open loop: Poisson arrivals at this many requests/s (instead of --concurrency).",
)
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=None,
    help="Requests per interleaved block (default: 4 x concurrency, or 8 open loop).",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Unrecorded requests per arm before measuring.",
)
@max_tokens_option(16, help="max_tokens of RAG QA requests.")
@click.option(
    "--documents",
    "num_documents",
    type=click.IntRange(min=1),
    default=None,
    help="RAG QA records: keep at most N documents, the gold ones always among them.",
)
@click.option(
    "--system-prompt-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Static system prompt placed before every RAG QA request.",
)
@seed_option(help="Seeds the Poisson arrival times.")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the JSON report."
)
@click.option(
    "--html", "html_path", type=click.Path(dir_okay=False), default=None, help="Write the HTML report."
)
def ab(
    arm_specs: tuple[str, ...],
    assignments: tuple[str, ...],
    data_path: str,
    limit: int | None,
    concurrency: int | None,
    rate: float | None,
    block_size: int | None,
    warmup: int,
    max_tokens: int,
    num_documents: int | None,
    system_prompt_file: str | None,
    seed: int,
    json_path: str | None,
    html_path: str | None,
) -> None:
    """Latency A/B experiment: one real server per arm, the same workload replayed on each."""
    if concurrency is not None and rate is not None:
        raise click.UsageError("give --concurrency (closed loop) or --rate (open loop), not both")
    if html_path:
        try:
            require_matplotlib()
        except RuntimeError as exc:
            raise click.UsageError(f"--html: {exc}") from exc
    try:
        arms = with_overrides(load_all_arms(list(arm_specs)), list(assignments))
    except ArmError as exc:
        raise click.UsageError(str(exc)) from exc
    workload = _workload(data_path, limit, system_prompt_file, max_tokens, num_documents)
    shape = LoadShape(
        concurrency=concurrency or 1,
        rate=rate,
        block_size=block_size or (8 if rate else 4 * (concurrency or 1)),
        warmup=warmup,
        seed=seed,
    )
    # A SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the arms' servers are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        report = run_ab(arms, workload, shape, progress=True)
    except (ValueError, RuntimeError, TimeoutError) as exc:
        raise click.ClickException(str(exc)) from exc
    report = _json_safe(report)
    click.echo(format_text(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2), encoding="utf-8")
    if html_path:
        Path(html_path).write_text(render_html(report), encoding="utf-8")
        click.echo(f"HTML report: {html_path}", err=True)


def _workload(
    data_path: str,
    limit: int | None,
    system_prompt_file: str | None,
    max_tokens: int,
    num_documents: int | None,
) -> Workload:
    """The requests every arm replays, the skipped lines of the QA file named on stderr."""
    system_prompt = (
        Path(system_prompt_file).read_text(encoding="utf-8").strip() if system_prompt_file else None
    )
    try:
        workload = load_workload(
            data_path,
            limit=limit,
            system_prompt=system_prompt,
            max_tokens=max_tokens,
            num_documents=num_documents,
        )
    except FileNotFoundError as exc:
        raise click.UsageError(str(exc)) from exc
    for skipped in workload.skipped:
        click.echo(f"{data_path}:{skipped.line}: skipped: {skipped.reason}", err=True)
    return workload
