"""What every benchmark shares: the machine line, percentiles, and the flat JSON file."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME
from ragspeed.shipped_data import NQ_QUESTIONS


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(threads: int | None = None) -> str:
    """One line naming the machine a figure was measured on: CPU, cores, torch threads, load."""
    parts = [cpu_name(), f"{os.cpu_count()} cores"]
    if threads is not None:
        parts.append(f"{threads} torch threads")
    parts.append(f"load {os.getloadavg()[0]:.1f}")
    return "machine: " + ", ".join(parts)


def prefill_line(engine: Any) -> str:
    """One line naming the prefill path a native engine (`LLMEngine`) chose at start-up and the
    CPU's capabilities (engine.native.core.precision), for every bench that runs one."""
    choice = getattr(engine, "prefill_choice", None)
    return "prefill: " + ("one dtype for every product (not a CPU)" if choice is None else choice.describe())


def require_positive(**values: int) -> None:
    """Raise ValueError naming the first count below 1."""
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of `values`, which need not be sorted."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    rank = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return ordered[rank]


def median_gap(arrivals: Sequence[float]) -> float:
    """The median time between consecutive token arrivals: a time per output token."""
    if len(arrivals) < 2:
        raise ValueError(f"a time per output token needs 2 or more tokens, got {len(arrivals)}")
    return statistics.median(b - a for a, b in zip(arrivals, arrivals[1:]))


class TokenTimes:
    """A bench contender's TPOT and TTFT of one request alone, from `arrivals(prompt, n)`: the
    times (from its start) at which its n tokens arrived."""

    def arrivals(self, prompt: tuple[int, ...], max_tokens: int) -> list[float]:
        raise NotImplementedError

    def tpot(self, prompt: tuple[int, ...], max_tokens: int) -> float:
        return median_gap(self.arrivals(prompt, max_tokens))

    def ttft(self, prompt: tuple[int, ...]) -> float:
        return self.arrivals(prompt, 1)[0]


def print_rows(rows: Iterable[tuple[str, Any]], echo=print) -> None:
    """`key  value` rows, the keys padded to one width."""
    rows = list(rows)
    width = max((len(key) for key, _ in rows), default=0)
    for key, value in rows:
        echo(f"{key:<{width}}  {value}")


# The `--json PATH` option every bench command takes; `write_json` writes the file.
json_option = click.option(
    "--json",
    "json_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="write the flat JSON figures here",
)


# `--model`, `--repeats` and `--threads` as the engine benches take them.
model_option = click.option(
    "--model", default=DEFAULT_MODEL_NAME, help="model-zoo name, local folder or hub id"
)
repeats_option = click.option(
    "--repeats", default=3, type=int, help="runs per figure; the median is reported"
)
threads_option = click.option("--threads", default=2, type=int, help="torch CPU threads")
# `--transformers/--no-transformers`: the transformers baseline beside the native engine.
transformers_option = click.option(
    "--transformers/--no-transformers", "with_transformers", default=True, help="run the baseline beside"
)


def max_tokens_option(
    default: int, help: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--max-tokens N` (at least 1) of the commands that send requests to a server."""
    return click.option(
        "--max-tokens", type=click.IntRange(min=1), default=default, show_default=True, help=help
    )


def quantization_option(help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--quantization auto|gguf|int8|none`, serve's choices and default ("none": EngineConfig
    reads it as off)."""
    return click.option(
        "--quantization",
        type=click.Choice(["auto", "gguf", "int8", "none"]),
        default="auto",
        show_default=True,
        help=help,
    )


def seed_option(help: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--seed N`, 0 by default."""
    return click.option("--seed", type=int, default=0, show_default=True, help=help)


def qa_data_option(
    help: str, *names: str, **kwargs: Any
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--data` (`names`: its parameter's name): an NQ-style QA file, by default the 100
    questions shipped in ragspeed/data."""
    kwargs.setdefault("type", click.Path(path_type=Path))
    return click.option(
        "--data",
        *names,
        default=NQ_QUESTIONS,
        show_default="the shipped 100 NQ questions",
        help=help,
        **kwargs,
    )


def write_json(path: str | Path | None, figures: Mapping[str, Any]) -> None:
    """Write the flat figures as indented JSON (nothing when `path` is None)."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
