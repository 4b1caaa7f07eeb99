"""`ragspeed bench gateway`: what the gateway (`--engine openai`) adds in front of an upstream.

One run starts an upstream and a gateway in front of it, and sends the same streamed chat
request to each (with `--tools`, a tool-calling one), side by side:

- *concurrency 1*: one request at a time, direct to the upstream and through the gateway in
  turn (the order alternating), so that machine drift hits both alike. *Added latency* is the
  gateway's time minus the direct time of the same round (paired), from sending the request to
  the last byte of its stream; p50 and p99 of those differences.
- *concurrency 16*: 16 clients, each on its own keep-alive connection, send requests back to
  back for `--seconds`, direct and through the gateway in turn (direct, gateway, gateway,
  direct); *requests/s* of each, and their *ratio* (gateway / direct).

The default upstream answers at once (ragspeed.bench.instant_upstream, its own process), so
what is measured is the gateway's own cost, not a model computing on the same cores;
`--engine NAME` serves `--model` on that engine instead (contention included). The client is a
bare asyncio HTTP/1.1 client, lean beside what it measures, and it checks that every answer
through the gateway has the text of the direct one.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import click

from ragspeed.bench.common import json_option, machine_line, max_tokens_option, percentile, write_json
from ragspeed.bench.instant_upstream import event_loop_factory
from ragspeed.bench.launcher import ServerProcess
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME

INSTANT = "instant"
UPSTREAM_MODEL = "upstream"  # the name the upstream serves, and the gateway sends
QUESTION = "What is the capital of Australia?"
# The gateway forwards requests without documents: compression and retrieval are not on its
# path, so they are not loaded (a start in seconds, not a minute).
GATEWAY_ARGS = (
    "--compression-methods",
    "identity",
    "--compression-default-method",
    "identity",
    "--no-enable-retrieval",
)


@dataclass(frozen=True)
class GatewayBenchConfig:
    num_requests: int = 200  # paired rounds at concurrency 1
    num_warmup: int = 20
    max_tokens: int = 16
    concurrency: int = 16
    seconds: float = 3.0  # each of the 4 throughput phases
    engine: str = INSTANT  # the upstream: INSTANT, or an engine serving `model`
    model: str = DEFAULT_MODEL_NAME  # the gateway's tokenizer (and the model upstream's model)
    gateway_args: tuple[str, ...] = ()  # extra `ragspeed serve` flags for the gateway
    tools: bool = False  # a tool-calling request (TOOLS, a call forced)


@dataclass(frozen=True)
class Answer:
    status: int
    seconds: float  # from sending the request to the last byte of its response
    text: str  # the streamed content, joined


class HttpConnection:
    """One keep-alive HTTP/1.1 connection: a POST out, its whole response in (Content-Length
    or chunked), timed."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> HttpConnection:
        host, _, port = url.removeprefix("http://").rstrip("/").partition(":")
        reader, writer = await asyncio.open_connection(host, int(port or 80))
        return cls(reader, writer, f"{host}:{port}")

    def close(self) -> None:
        self.writer.close()

    async def post(self, path: str, payload: bytes) -> Answer:
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n"
        ).encode()
        t0 = time.perf_counter()
        self.writer.write(head + payload)
        status_line, _, header_block = (await self.reader.readuntil(b"\r\n\r\n")).partition(b"\r\n")
        headers = header_block.lower()
        if b"transfer-encoding: chunked" in headers:
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                data = await self.reader.readexactly(size + 2)  # the chunk and its CRLF
                if size == 0:
                    break
                parts.append(data[:-2])
            body = b"".join(parts)
        else:
            length = next(
                int(line.split(b":")[1])
                for line in headers.split(b"\r\n")
                if line.startswith(b"content-length:")
            )
            body = await self.reader.readexactly(length)
        seconds = time.perf_counter() - t0
        return Answer(int(status_line.split(b" ")[1]), seconds, streamed_text(body))


def streamed_text(body: bytes) -> str:
    """The content of a chat completion stream's chunks, joined ('' for anything else)."""
    parts = []
    for line in body.split(b"\n"):
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        for choice in chunk.get("choices") or ():
            parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


# `--tools`: a tool-calling request, as an agent framework sends one (three tools, a call forced);
# the gateway forwards them untouched, and the instant upstream answers as it always does.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"Look up {what} of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["metric", "imperial"]}},
                "required": ["city"],
            },
        },
    }
    for name, what in (
        ("get_weather", "the weather"),
        ("get_time", "the local time"),
        ("get_population", "the population"),
    )
]


def chat_payload(max_tokens: int, model: str | None, tools: bool = False) -> bytes:
    body: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": QUESTION},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    if tools:
        body["tools"], body["tool_choice"] = TOOLS, "required"
    return json.dumps(body).encode()


class BenchError(RuntimeError):
    pass


def _check(answer: Answer, name: str, expected: str | None) -> None:
    if answer.status != 200:
        raise BenchError(f"{name} answered {answer.status}")
    if expected is not None and answer.text != expected:
        raise BenchError(f"{name} streamed {answer.text!r}, the upstream {expected!r}")


async def paired_latency(
    targets: dict[str, tuple[str, bytes]], num_requests: int, num_warmup: int
) -> dict[str, list[float]]:
    """Milliseconds per request of each target, one request at a time, the order alternating."""
    connections = {name: await HttpConnection.open(url) for name, (url, _) in targets.items()}
    latencies: dict[str, list[float]] = {name: [] for name in targets}
    try:
        for i in range(num_warmup + num_requests):
            order = ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")
            answers = {}
            for name in order:
                answers[name] = await connections[name].post("/v1/chat/completions", targets[name][1])
            _check(answers["direct"], "the upstream", None)
            _check(answers["gateway"], "the gateway", answers["direct"].text)
            if i >= num_warmup:
                for name in order:
                    latencies[name].append(answers[name].seconds * 1000)
    finally:
        for connection in connections.values():
            connection.close()
    return latencies


async def throughput(url: str, payload: bytes, concurrency: int, seconds: float, expected: str) -> int:
    """Requests completed in `seconds` by `concurrency` clients sending back to back."""
    connections = [await HttpConnection.open(url) for _ in range(concurrency)]
    deadline = time.perf_counter() + seconds
    completed = 0

    async def client(connection: HttpConnection) -> None:
        nonlocal completed
        while time.perf_counter() < deadline:
            _check(await connection.post("/v1/chat/completions", payload), url, expected)
            completed += 1

    try:
        await asyncio.gather(*(client(c) for c in connections))
    finally:
        for connection in connections:
            connection.close()
    return completed


async def measure(config: GatewayBenchConfig, direct_url: str, gateway_url: str) -> dict[str, Any]:
    targets = {
        "direct": (direct_url, chat_payload(config.max_tokens, UPSTREAM_MODEL, config.tools)),
        "gateway": (gateway_url, chat_payload(config.max_tokens, None, config.tools)),
    }
    latencies = await paired_latency(targets, config.num_requests, config.num_warmup)
    probe = await HttpConnection.open(direct_url)
    expected = (await probe.post("/v1/chat/completions", targets["direct"][1])).text
    probe.close()
    completed = {"direct": 0, "gateway": 0}
    for name in ("direct", "gateway", "gateway", "direct"):  # ABBA: drift hits both alike
        url, payload = targets[name]
        completed[name] += await throughput(url, payload, config.concurrency, config.seconds, expected)
    direct_ms, gateway_ms = latencies["direct"], latencies["gateway"]
    added = [g - d for g, d in zip(gateway_ms, direct_ms)]
    direct_rps = completed["direct"] / (2 * config.seconds)
    gateway_rps = completed["gateway"] / (2 * config.seconds)
    return {
        "upstream": config.engine,
        "num_requests": config.num_requests,
        "max_tokens": config.max_tokens,
        "tools": config.tools,
        "streamed": True,
        "direct_p50_ms": statistics.median(direct_ms),
        "direct_p99_ms": percentile(direct_ms, 0.99),
        "gateway_p50_ms": statistics.median(gateway_ms),
        "gateway_p99_ms": percentile(gateway_ms, 0.99),
        "added_p50_ms": statistics.median(added),
        "added_p99_ms": percentile(added, 0.99),
        "concurrency": config.concurrency,
        "seconds": config.seconds,
        "direct_requests_per_s": direct_rps,
        "gateway_requests_per_s": gateway_rps,
        "throughput_ratio": gateway_rps / direct_rps,
    }


@contextmanager
def instant_upstream() -> Iterator[str]:
    """The instant upstream in a process of its own; yields its URL once it answers."""
    with ServerProcess([], command=("-m", "ragspeed.bench.instant_upstream"), ready_timeout_s=30) as server:
        yield server.url


@contextmanager
def model_upstream(engine: str, model: str) -> Iterator[str]:
    with ServerProcess(
        ["--engine", engine, "--model", model, "--served-model-name", UPSTREAM_MODEL]
    ) as server:
        yield server.url


def run_gateway_bench(config: GatewayBenchConfig) -> dict[str, Any]:
    upstream = instant_upstream() if config.engine == INSTANT else model_upstream(config.engine, config.model)
    with upstream as upstream_url:
        gateway_flags = ["--engine", "openai", "--model", config.model, "--upstream", upstream_url]
        gateway_flags += ["--upstream-model", UPSTREAM_MODEL, *GATEWAY_ARGS, *config.gateway_args]
        with ServerProcess(gateway_flags) as gateway:
            with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                return runner.run(measure(config, upstream_url, gateway.url))


def cpu_line() -> str:
    from ragspeed.engine.native.compute.cpu_features import read_cpu_features

    return "cpu: " + read_cpu_features().describe()


def report_lines(r: dict[str, Any]) -> list[str]:
    upstream = "instant (answers at once)" if r["upstream"] == INSTANT else f"engine {r['upstream']}"
    return [
        f"upstream: {upstream}; streamed chat{' with tools' if r.get('tools') else ''}, {r['max_tokens']} tokens a request",
        f"concurrency 1, {r['num_requests']} paired requests:",
        f"  {'':16} {'p50 ms':>9} {'p99 ms':>9}",
        f"  {'upstream alone':16} {r['direct_p50_ms']:9.3f} {r['direct_p99_ms']:9.3f}",
        f"  {'through gateway':16} {r['gateway_p50_ms']:9.3f} {r['gateway_p99_ms']:9.3f}",
        f"  {'added (paired)':16} {r['added_p50_ms']:9.3f} {r['added_p99_ms']:9.3f}",
        f"concurrency {r['concurrency']}, {r['seconds']:g} s x 2 each:",
        f"  {'upstream alone':16} {r['direct_requests_per_s']:9.1f} requests/s",
        f"  {'through gateway':16} {r['gateway_requests_per_s']:9.1f} requests/s",
        f"  {'ratio':16} {r['throughput_ratio']:9.3f}",
    ]


@click.command(name="gateway")
@click.option(
    "--engine",
    default=INSTANT,
    show_default=True,
    help="The upstream: 'instant' answers at once (the gateway's own cost); an engine name "
    "(transformers, native, ...) serves --model on these cores instead.",
)
@click.option("--model", default=DEFAULT_MODEL_NAME, show_default=True, help="The gateway's tokenizer.")
@click.option("--requests", "num_requests", type=click.IntRange(min=5), default=200, show_default=True)
@max_tokens_option(16)
@click.option("--concurrency", type=click.IntRange(min=1), default=16, show_default=True)
@click.option(
    "--seconds",
    type=click.FloatRange(min=0.1),
    default=3.0,
    show_default=True,
    help="Each throughput phase.",
)
@click.option(
    "--gateway-arg",
    "gateway_args",
    multiple=True,
    help="An extra `ragspeed serve` flag for the gateway (repeatable), e.g. --gateway-arg=--log-level=warning.",
)
@click.option("--tools", is_flag=True, help="Send a tool-calling request (three tools, a call forced).")
@json_option
def bench_gateway(
    engine: str,
    model: str,
    num_requests: int,
    max_tokens: int,
    concurrency: int,
    seconds: float,
    gateway_args: tuple[str, ...],
    tools: bool,
    json_path: str | None,
) -> None:
    """Latency and throughput the gateway adds in front of an OpenAI-compatible upstream."""
    config = GatewayBenchConfig(
        num_requests=num_requests,
        max_tokens=max_tokens,
        concurrency=concurrency,
        seconds=seconds,
        engine=engine,
        model=model,
        gateway_args=gateway_args,
        tools=tools,
    )
    try:
        result = run_gateway_bench(config)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(machine_line())
    click.echo(cpu_line())
    for line in report_lines(result):
        click.echo(line)
    write_json(json_path, result)
    click.echo(json.dumps(result))
