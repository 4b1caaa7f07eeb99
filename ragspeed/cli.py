"""The `ragspeed` command: one click application.

`serve` takes every option of `gateway.settings.Settings` as a flag, generated from the settings'
options (`OPTIONS`: each by its flat name, whatever section holds it) so that `--help`, the config file and the environment variables never disagree. The other
commands live beside the code they drive and load only when invoked (`ragspeed serve` never
imports a benchmark, and `ragspeed --help` stays cheap where it can).
"""

from __future__ import annotations

import gc
import importlib
import logging
import types
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import click

from ragspeed import environment
from ragspeed.gateway.settings import OPTIONS, ConfigError, Settings, load_settings, takes_none_number

_FLAG_NAMES = {"upstreams": "upstream"}  # list options read better in the singular


def _version() -> str:
    try:
        return version("ragspeed")
    except PackageNotFoundError:
        return "0+unknown"


def _base_type(annotation: Any) -> Any:
    if get_origin(annotation) in (types.UnionType, Union):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    return annotation


class NumberOrNone(click.ParamType):
    """A number option that takes None: its number, or `none` (passed on as the text, which the
    settings read as None, so that it overrides the lower layers as a value does)."""

    def __init__(self, base: type) -> None:
        self.base = click.INT if base is int else click.FLOAT
        self.name = f"{self.base.name}|none"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.strip().lower() == "none":
            return "none"
        return self.base.convert(value, param, ctx)


def settings_options(command):
    """Add one flag per option; unset flags stay None so lower layers show through."""
    for name, option in OPTIONS.items():
        info = option.info
        flag = _FLAG_NAMES.get(name, name).replace("_", "-")
        base = _base_type(info.annotation)
        default = info.get_default(call_default_factory=True)
        help_text = f"{info.description} [env {option.env}; default {default!r}]"
        if get_origin(base) is Literal:
            choices = [str(choice) for choice in get_args(base)]
            option = click.Option(
                [f"--{flag}", name], type=click.Choice(choices), default=None, help=help_text
            )
        elif base is bool:
            option = click.Option([f"--{flag}/--no-{flag}", name], default=None, help=help_text)
        elif get_origin(base) is list:
            option = click.Option(
                [f"--{flag}", name], multiple=True, default=None, help=help_text + " (repeatable)"
            )
        elif takes_none_number(info.annotation):
            option = click.Option([f"--{flag}", name], type=NumberOrNone(base), default=None, help=help_text)
        else:
            option = click.Option([f"--{flag}", name], type=base, default=None, help=help_text)
        command.params.append(option)
    return command


def serve_settings(config_file: str | None, flags: dict[str, Any]) -> Settings:
    """The settings `serve` runs with: its parsed flags over the lower layers."""
    flags = {k: (list(v) if isinstance(v, tuple) else v) for k, v in flags.items()}
    flags = {k: v for k, v in flags.items() if v not in (None, [])}
    try:
        return load_settings(config_file, **flags)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc


class LazyGroup(click.Group):
    """A group whose sub-commands are imported when first asked for: name -> "module:attribute"."""

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            module_name, attribute = self.lazy[cmd_name].split(":")
            command = getattr(importlib.import_module(module_name), attribute)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
    lazy={
        "ab": "ragspeed.ab.cli:ab",
        "eval": "ragspeed.evals.cli:eval_group",
        "index": "ragspeed.retrieval.cli:index_group",
        "keys": "ragspeed.gateway.security:keys",
        "models": "ragspeed.bench.models:models_group",
        "train-demo": "ragspeed.training.cli:train_demo",
        "train-draft": "ragspeed.training.cli:train_draft",
        "train-rag": "ragspeed.training.cli:train_rag",
    },
)
@click.version_option(_version(), prog_name="ragspeed")
def cli() -> None:
    """ragspeed: a RAG-aware latency middleware with an OpenAI-compatible API."""
    environment.configure()


def keep_startup_heap() -> None:
    """What start-up built (models, tokenizers, indexes) lives as long as the server: kept out of
    the garbage collector's scans. A full collection over it took 120-280 ms every 10-60 s
    under load, and held the event loop for as long."""
    gc.collect()
    gc.freeze()


@settings_options
@cli.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="YAML or TOML file of settings (keys as the flags, with underscores).",
)
def serve(config_file: str | None, **flags: Any) -> None:
    """Serve the OpenAI-compatible RAG gateway (default: SmolLM2-135M-Instruct, native engine)."""
    import uvicorn

    from ragspeed.gateway.app import create_app

    settings = serve_settings(config_file, flags)
    server_settings = settings.server
    logging.basicConfig(
        level=server_settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    failures: list[str] = []

    def failed(error: str) -> None:  # the engine could not start: stop serving
        failures.append(error)
        server.should_exit = True

    try:
        app = create_app(settings, on_start_failure=failed, on_ready=keep_startup_heap)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=server_settings.host,
            port=server_settings.port,
            log_level=server_settings.log_level,
            access_log=server_settings.access_log,
            # uvicorn annotates int seconds but hands the value to asyncio.timeout, which takes
            # the float the setting is.
            timeout_graceful_shutdown=server_settings.shutdown_drain_s,  # type: ignore[arg-type]
        )
    )
    server.run()
    if failures:  # the engine could not start: exit non-zero, the error on one line
        raise click.ClickException(f"the engine failed to start: {failures[0]}")


@cli.command()
@click.argument("question")
@click.option(
    "--doc",
    "docs",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="A file whose text is one retrieved document (repeatable).",
)
@click.option("--system", default=None, help="Static system prompt.")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="ragspeed server.")
@click.option("--api-key", envvar="RAGSPEED_API_KEY", default=None, help="Bearer key.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(0, 2), default=0.0, show_default=True)
@click.option(
    "--compression-rate",
    type=click.FloatRange(0, 1, min_open=True),
    default=None,
    help="Keep this share of the documents' tokens.",
)
@click.option("--stream/--no-stream", default=True, show_default=True)
def chat(
    question: str,
    docs: tuple[str, ...],
    system: str | None,
    url: str,
    api_key: str | None,
    max_tokens: int,
    temperature: float,
    compression_rate: float | None,
    stream: bool,
) -> None:
    """Send one chat request to a running server and print the answer and its figures."""
    from ragspeed.gateway.client import RagspeedClient, RagspeedError

    documents = [
        {"title": Path(p).name, "text": Path(p).read_text(encoding="utf-8", errors="replace")} for p in docs
    ]
    kwargs: dict[str, Any] = {
        "documents": documents or None,
        "system": system,
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    if compression_rate is not None:
        kwargs["compression"] = {"rate": compression_rate}
    try:
        with RagspeedClient(url, api_key=api_key) as client:
            if stream:
                result = None
                for piece in client.chat_stream(question, **kwargs):
                    click.echo(piece.text, nl=False)
                    result = piece.result or result
                click.echo()
                assert result is not None  # chat_stream's last chunk carries the result
            else:
                result = client.chat(question, **kwargs)
                click.echo(result.text)
    except RagspeedError as exc:
        raise click.ClickException(str(exc)) from exc
    except Exception as exc:  # connection refused and friends
        raise click.ClickException(f"cannot reach {url}: {exc}") from exc
    usage = result.usage
    click.echo(
        f"[{usage.prompt_tokens} prompt tokens ({usage.cached_tokens} cached), "
        f"{usage.completion_tokens} completion tokens, TTFT {result.ttft_ms} ms, "
        f"total {result.e2e_ms} ms]",
        err=True,
    )


@click.group(
    cls=LazyGroup,
    lazy={
        "cache": "ragspeed.bench.cache:bench_cache",
        "cache-manager": "ragspeed.bench.cache_manager:bench_cache_manager",
        "documents": "ragspeed.bench.documents:bench_documents",
        "engine": "ragspeed.bench.engine:bench_engine_command",
        "fidelity": "ragspeed.bench.fidelity:bench_fidelity",
        "gateway": "ragspeed.bench.gateway:bench_gateway",
        "kquant": "ragspeed.bench.kquant:bench_kquant",
        "grammar": "ragspeed.bench.grammar:bench_grammar",
        "load": "ragspeed.bench.load:bench_load",
        "prefill": "ragspeed.bench.prefill_paths:bench_prefill",
        "quant": "ragspeed.bench.quant:bench_quant",
        "restarts": "ragspeed.bench.restarts:bench_restarts",
        "spec": "ragspeed.bench.spec:bench_spec",
    },
)
def bench() -> None:
    """Benchmarks: contenders side by side in one run, printed as a table and written as JSON."""


cli.add_command(bench)


def main() -> None:
    cli(prog_name="ragspeed")


if __name__ == "__main__":
    main()
