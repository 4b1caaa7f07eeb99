"""The bench commands share one declaration of each option they have in common."""

from __future__ import annotations

import click
import pytest

from ragspeed.bench.cache import bench_cache
from ragspeed.bench.documents import bench_documents
from ragspeed.bench.engine import bench_engine_command
from ragspeed.bench.quant import bench_quant

FLAGS = {
    bench_cache: ["--model", "--json", "--num-questions", "--num-cold", "--threads", "--system-prompt"],
    bench_documents: [
        "--model", "--json", "--data", "--num-trials", "--policy", "--glue", "--threads", "--hit-rate",
        "--bookkeeping", "--ram-bytes", "--disk-bytes",
    ],
    bench_engine_command: [
        "--model", "--json", "--repeats", "--threads", "--transformers-requests", "--attention-lens",
        "--transformers", "--llamacpp", "--llamacpp-gguf", "--llamacpp-requests", "--quantization",
        "--kv-cache-dtype", "--tpot-target-ms", "--steps", "--served",
    ],
    bench_quant: ["--model", "--json", "--repeats", "--threads", "--output-len", "--transformers", "--text"],
}  # fmt: skip


def _declaration(option: click.Parameter) -> tuple[object, ...]:
    assert isinstance(option, click.Option)
    return (
        tuple(option.opts),
        tuple(option.secondary_opts),
        option.name,
        option.default,
        repr(option.type),
        option.help,
    )


def _option(command: click.Command, flag: str) -> click.Parameter:
    return next(p for p in command.params if flag in p.opts)


@pytest.mark.parametrize("command", list(FLAGS), ids=lambda c: c.name)
def test_each_command_keeps_its_flags(command: click.Command) -> None:
    assert [p.opts[0] for p in command.params] == FLAGS[command]


@pytest.mark.parametrize(
    ("flag", "commands"),
    [
        ("--model", [bench_cache, bench_documents, bench_engine_command, bench_quant]),
        ("--json", [bench_cache, bench_documents, bench_engine_command, bench_quant]),
        ("--repeats", [bench_engine_command, bench_quant]),
        ("--threads", [bench_engine_command, bench_quant]),
        ("--transformers", [bench_engine_command, bench_quant]),
    ],
)
def test_shared_options_are_declared_alike(flag: str, commands: list[click.Command]) -> None:
    declarations = {_declaration(_option(command, flag)) for command in commands}
    assert len(declarations) == 1
