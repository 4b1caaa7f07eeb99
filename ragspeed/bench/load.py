"""`ragspeed bench load`: N concurrent streaming clients against a real server, on loopback.

Each client loops: pick a prompt (a question with 0 to 4 retrieved documents, so prompt lengths
mix), stream a chat completion, and with probability `disconnect_fraction` hang up after a
random number of chunks (the server must abort that request and free its KV blocks). A client
refused with 429 waits its `Retry-After`, as the openai SDK does, then goes on.

With `compression_every_s`, one more client sends a request of 20 documents compressed 4x
(`ragspeed.compression.rate` 0.25) at that interval: a few arrivals alone before the load,
then from the end of the warm-up on, beside the streams. The arrivals' TTFT both ways, and the
streams' inter-token gaps in the warm-up (`gap_alone_*`) against the steady state (`gap_*`),
show what a compressed arrival costs the streams in flight.

Terms: *TTFT* here is the client's view, from sending the request to the first SSE chunk (the
server primes a stream with its first token before it starts the response). The *steady state*
runs from the end of the warm-up (`warmup_fraction` of the run) to the end of the load;
`rss_growth` is (RSS at its end - RSS at its start) / RSS at its start, the server's resident
memory read from /proc. `blocks_in_use_at_end` is the engine's `num_blocks_used` gauge once every
client has stopped and the server has gone idle (None for engines without a paged KV cache).
*Goodput* is the requests whose TTFT met `deadline_ms` a minute of the run; a *refusal* is a
429, timed from sending to its answer (`refusal_server`: from its arrival in the server to the
answer, as the server reports it); an *inter-token gap* is the time between two content
chunks of one stream; `gap_*` are the steady state's.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx

from ragspeed.bench.common import machine_line, max_tokens_option, percentile, seed_option, write_json
from ragspeed.bench.launcher import ServerProcess
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME

_DOC_CHARS = 500  # each document is cut to this many characters
_DOC_COUNTS = (0, 1, 2, 4)  # documents per request: the prompt length mix
_ARRIVAL_DOCS = 20  # documents of a compressed arrival
_ARRIVALS_ALONE = 4  # compressed arrivals sent before the load starts, for their TTFT alone
_ARRIVAL_ROWS = 300  # distinct arrivals: none repeats (and hits the prefix cache) in a run of minutes
_MAX_RETRY_AFTER_S = 30.0


@dataclass(frozen=True)
class LoadConfig:
    clients: int = 8
    duration_s: float = 60.0
    warmup_fraction: float = 0.2
    disconnect_fraction: float = 0.2
    min_tokens: int = 4
    max_tokens: int = 48
    seed: int = 0
    max_requests: int | None = None  # stop sending once this many have started (None: by time only)
    deadline_ms: float = 10_000.0  # the TTFT that counts toward goodput
    compression_every_s: float | None = None  # a compressed 20-document arrival this often


@dataclass
class LoadTally:
    """What the clients saw; one instance shared by all of them (one event loop, no locks)."""

    started: int = 0
    completed: int = 0
    disconnected: int = 0
    server_errors: int = 0
    client_errors: int = 0  # 4xx: 429 when the server sheds load, 400 for a prompt too long
    transport_errors: int = 0
    ttft_s: list[float] = field(default_factory=list)
    refusal_s: list[float] = field(default_factory=list)  # send to 429, per refusal
    refusal_server_s: list[float] = field(default_factory=list)  # arrival to 429, the server's own
    gaps_s: list[float] = field(default_factory=list)  # between content chunks of a stream
    arrivals_alone_ttft_s: list[float] = field(default_factory=list)
    arrivals_ttft_s: list[float] = field(default_factory=list)
    # The server's actual TTFT over its admission's prediction, per completed stream.
    prediction_ratios: list[float] = field(default_factory=list)
    status_counts: dict[int, int] = field(default_factory=dict)


def load_prompts(path: Path | None = None, limit: int = 64) -> list[tuple[str, list[str]]]:
    """(question, documents) pairs from an nq_dev.jsonl-style file, or synthetic ones without one."""
    prompts: list[tuple[str, list[str]]] = []
    if path is not None:
        if not path.is_file():
            raise FileNotFoundError(f"--data: {path} is not a file")
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                row = json.loads(line)
                prompts.append((row["question"], [d["text"][:_DOC_CHARS] for d in row["documents"][:4]]))
                if len(prompts) >= limit:
                    break
    if not prompts:
        words = "the a model cache token block prefix document answer question engine".split()
        rng = random.Random(0)
        for i in range(limit):
            docs = [" ".join(rng.choices(words, k=80)) for _ in range(4)]
            prompts.append((f"question {i}: which block holds the answer?", docs))
    return prompts


def load_arrival_documents(path: Path | None = None) -> list[tuple[str, list[str]]]:
    """(question, 20 documents) pairs for the compressed arrivals, or synthetic ones."""
    rows: list[tuple[str, list[str]]] = []
    if path is not None:
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                row = json.loads(line)
                if len(row["documents"]) >= _ARRIVAL_DOCS:
                    rows.append((row["question"], [d["text"] for d in row["documents"][:_ARRIVAL_DOCS]]))
                if len(rows) >= _ARRIVAL_ROWS:
                    break
    if not rows:
        words = "the a model cache token block prefix document answer question engine river city".split()
        rng = random.Random(1)
        for i in range(_ARRIVAL_ROWS):
            docs = [" ".join(rng.choices(words, k=100)) for _ in range(_ARRIVAL_DOCS)]
            rows.append((f"question {i}: which document names the city?", docs))
    return rows


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def read_gauge(metrics_text: str, name: str, **labels: str) -> float | None:
    """Sum of a Prometheus sample's values over its label sets that hold `labels`; None when
    it is absent."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if (line.startswith(name + "{") or line.startswith(name + " "))
        and all(label in line for label in wanted)
    ]
    return sum(values) if values else None


async def _one_request(
    http: httpx.AsyncClient,
    model: str,
    rng: random.Random,
    config: LoadConfig,
    prompts: list[tuple[str, list[str]]],
    tally: LoadTally,
) -> None:
    question, documents = rng.choice(prompts)
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": True,
        "max_tokens": rng.randint(config.min_tokens, config.max_tokens),
        "messages": [
            {"role": "system", "content": "Answer from the documents."},
            {"role": "user", "content": question},
        ],
        "documents": documents[: rng.choice(_DOC_COUNTS)],
    }
    hang_up_after = rng.randint(1, 8) if rng.random() < config.disconnect_fraction else None
    await _stream(http, body, tally, tally.ttft_s, hang_up_after)


async def _stream(
    http: httpx.AsyncClient,
    body: dict[str, Any],
    tally: LoadTally,
    ttfts: list[float],
    hang_up_after: int | None = None,
) -> None:
    """One streamed request: its TTFT into `ttfts`, its gaps into the tally; a 429 sleeps
    its Retry-After."""
    tally.started += 1
    sent = time.perf_counter()
    retry_after_s = 0.0
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            tally.status_counts[response.status_code] = tally.status_counts.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                tally.server_errors += 1
                return
            if response.status_code == 429:
                tally.refusal_s.append(time.perf_counter() - sent)
                if "x-ragspeed-refused-after-ms" in response.headers:
                    tally.refusal_server_s.append(
                        float(response.headers["x-ragspeed-refused-after-ms"]) / 1000
                    )
                retry_after_s = min(float(response.headers.get("retry-after", "1")), _MAX_RETRY_AFTER_S)
            if response.status_code != 200:
                tally.client_errors += 1
            else:
                await _read_stream(response, tally, ttfts, sent, hang_up_after)
    except httpx.HTTPError:
        tally.transport_errors += 1
    if retry_after_s:
        await asyncio.sleep(retry_after_s)


async def _read_stream(
    response: httpx.Response, tally: LoadTally, ttfts: list[float], sent: float, hang_up_after: int | None
) -> None:
    chunks = 0
    last: float | None = None  # the previous content chunk's arrival
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        now = time.perf_counter()
        if chunks == 0:
            ttfts.append(now - sent)
        if '"content":' in line and '"content":""' not in line:
            if last is not None:
                tally.gaps_s.append(now - last)
            last = now
        chunks += 1
        if '"ragspeed":' in line:
            figures = json.loads(line[len("data:") :])["ragspeed"]
            if figures.get("predicted_ttft_ms") and figures.get("ttft_ms"):
                tally.prediction_ratios.append(figures["ttft_ms"] / figures["predicted_ttft_ms"])
        if line.strip() == "data: [DONE]":
            tally.completed += 1
            return
        if hang_up_after is not None and chunks >= hang_up_after:
            tally.disconnected += 1
            return  # leaving the block closes the connection mid-stream
    tally.server_errors += 1  # the stream ended without [DONE]


def _arrival_body(model: str, question: str, documents: list[str]) -> dict[str, Any]:
    return {
        "model": model,
        "stream": True,
        "temperature": 0.0,
        "max_tokens": 16,
        "messages": [
            {"role": "system", "content": "Answer from the documents."},
            {"role": "user", "content": question},
        ],
        "documents": documents,
        "ragspeed": {"compression": {"rate": 0.25}},
    }


async def _arrivals(
    url: str,
    model: str,
    every_s: float,
    stop_at: float,
    rows: list[tuple[str, list[str]]],
    tally: LoadTally,
    ttfts: list[float],
    count: int | None = None,
) -> None:
    """A compressed 20-document request every `every_s` until `stop_at` (or `count` sent);
    each runs in its own task, so a slow one does not delay the next."""
    sent: list[asyncio.Task] = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0, connect=10.0)) as http:
        index = 0
        while time.perf_counter() < stop_at and (count is None or index < count):
            question, documents = rows[index % len(rows)]
            sent.append(
                asyncio.create_task(_stream(http, _arrival_body(model, question, documents), tally, ttfts))
            )
            index += 1
            await asyncio.sleep(every_s)
        await asyncio.gather(*sent)


async def _client(
    url: str,
    model: str,
    seed: int,
    config: LoadConfig,
    stop_at: float,
    prompts: list[tuple[str, list[str]]],
    tally: LoadTally,
) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0, connect=10.0)) as http:
        while time.perf_counter() < stop_at and (
            config.max_requests is None or tally.started < config.max_requests
        ):
            await _one_request(http, model, rng, config, prompts, tally)


async def _settle(http: httpx.AsyncClient, timeout_s: float = 30.0) -> str:
    """/metrics once no request is in flight and the engine holds no running request."""
    deadline = time.perf_counter() + timeout_s
    while True:
        text = (await http.get("/metrics")).text
        in_flight = read_gauge(text, "ragspeed_requests_in_flight") or 0.0
        running = read_gauge(text, "ragspeed_engine_num_requests_running") or 0.0
        waiting = read_gauge(text, "ragspeed_engine_num_requests_waiting") or 0.0
        if (in_flight == 0 and running == 0 and waiting == 0) or time.perf_counter() > deadline:
            return text
        await asyncio.sleep(0.2)


@dataclass(frozen=True)
class _LoadRun:
    """What the run measured besides the tally: its times, where the steady state began, the
    server's memory at its start and end, and /metrics once the server settled."""

    elapsed_s: float
    steady_s: float
    completed_at_start: int  # requests completed when the steady state began
    steady_first_ttft: int  # index of the steady state's first TTFT in tally.ttft_s
    gaps_alone: list[float]  # the gaps between tokens before the arrivals began
    rss_start: int | None
    rss_end: int | None
    metrics: str


async def run_load(
    url: str,
    config: LoadConfig,
    server_pid: int | None = None,
    prompts: list[tuple[str, list[str]]] | None = None,
    arrival_rows: list[tuple[str, list[str]]] | None = None,
) -> dict[str, Any]:
    """`config.clients` closed-loop clients (and the arrivals, with compression) against `url`
    for `config.duration_s`; the flat figures."""
    tally = LoadTally()
    run = await _measure_load(
        url, config, server_pid, prompts or load_prompts(), arrival_rows or load_arrival_documents(), tally
    )
    return _load_figures(config, tally, run)


async def _measure_load(
    url: str,
    config: LoadConfig,
    server_pid: int | None,
    prompts: list[tuple[str, list[str]]],
    rows: list[tuple[str, list[str]]],
    tally: LoadTally,
) -> _LoadRun:
    every_s = config.compression_every_s
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        if every_s is not None:  # alone first: the arrivals' TTFT with no stream in flight
            alone = asyncio.create_task(
                _arrivals(
                    url, model, every_s, math.inf, rows, tally, tally.arrivals_alone_ttft_s, _ARRIVALS_ALONE
                )
            )
            await alone
            tally.gaps_s.clear()
        t0 = time.perf_counter()
        stop_at = t0 + config.duration_s
        clients = [
            asyncio.create_task(_client(url, model, config.seed * 1_000 + i, config, stop_at, prompts, tally))
            for i in range(config.clients)
        ]
        await asyncio.wait(clients, timeout=config.duration_s * config.warmup_fraction)
        rss_start = rss_bytes(server_pid) if server_pid else None
        completed_at_start, steady_from = tally.completed, time.perf_counter()
        steady_first_ttft = len(tally.ttft_s)
        gaps_alone, tally.gaps_s = tally.gaps_s, []
        if every_s is not None:
            arrivals = rows[_ARRIVALS_ALONE:] or rows
            clients.append(
                asyncio.create_task(
                    _arrivals(url, model, every_s, stop_at, arrivals, tally, tally.arrivals_ttft_s)
                )
            )
        await asyncio.wait(clients, timeout=max(0.0, stop_at - time.perf_counter()))
        rss_end = rss_bytes(server_pid) if server_pid else None
        steady_s = time.perf_counter() - steady_from
        await asyncio.gather(*clients)  # each finishes the request it is in
        elapsed = time.perf_counter() - t0
        metrics = await _settle(http)
    return _LoadRun(
        elapsed, steady_s, completed_at_start, steady_first_ttft, gaps_alone, rss_start, rss_end, metrics
    )


def _load_figures(config: LoadConfig, tally: LoadTally, run: _LoadRun) -> dict[str, Any]:
    ttft_ms = sorted(t * 1000 for t in tally.ttft_s)
    met = sum(t * 1000 <= config.deadline_ms for t in tally.ttft_s + tally.arrivals_ttft_s)
    return {
        "clients": config.clients,
        "duration_s": round(run.elapsed_s, 2),
        "requests_started": tally.started,
        "requests_completed": tally.completed,
        "requests_disconnected": tally.disconnected,
        "requests_per_s_steady": round((tally.completed - run.completed_at_start) / run.steady_s, 3)
        if run.steady_s
        else None,
        "server_errors": tally.server_errors,
        "client_errors": tally.client_errors,
        "transport_errors": tally.transport_errors,
        **{f"status_{code}": n for code, n in sorted(tally.status_counts.items())},
        "ttft_p50_ms": round(statistics.median(ttft_ms), 1) if ttft_ms else None,
        "ttft_p99_ms": round(percentile(ttft_ms, 0.99), 1) if ttft_ms else None,
        **_spread("ttft_steady", tally.ttft_s[run.steady_first_ttft :], (0.99,)),
        "deadline_ms": config.deadline_ms,
        "goodput_per_min": round(met / (run.elapsed_s / 60), 2),
        "refused": len(tally.refusal_s),
        **_spread("refusal", tally.refusal_s, (0.5, 0.99, 1.0)),
        **_spread("refusal_server", tally.refusal_server_s, (0.5, 0.99, 1.0)),
        **_spread("gap_alone", run.gaps_alone, (0.5, 0.99)),
        **_spread("gap", tally.gaps_s, (0.5, 0.9, 0.99)),
        **_prediction_figures(tally.prediction_ratios),
        **(
            {
                **_spread("arrival_alone_ttft", tally.arrivals_alone_ttft_s, (0.5,)),
                **_spread("arrival_ttft", tally.arrivals_ttft_s, (0.5, 0.99)),
            }
            if config.compression_every_s is not None
            else {}
        ),
        **_server_figures(run),
    }


def _prediction_figures(ratios: list[float]) -> dict[str, float | None]:
    """Quantiles of TTFT over the TTFT the server predicted."""
    return {
        f"ttft_over_predicted_p{round(q * 100)}": round(percentile(ratios, q), 3) if ratios else None
        for q in (0.1, 0.5, 0.9, 0.99)
    }


def _server_figures(run: _LoadRun) -> dict[str, Any]:
    """The server's memory growth over the steady state and its KV blocks at the end."""
    rss_start, rss_end = run.rss_start, run.rss_end
    blocks_used = read_gauge(run.metrics, "ragspeed_engine_num_blocks_used")
    return {
        "rss_start_mb": round(rss_start / 2**20, 1) if rss_start else None,
        "rss_end_mb": round(rss_end / 2**20, 1) if rss_end else None,
        "rss_growth": round((rss_end - rss_start) / rss_start, 4) if rss_start and rss_end else None,
        "blocks_in_use_at_end": int(blocks_used) if blocks_used is not None else None,
        "blocks_total": _int_or_none(read_gauge(run.metrics, "ragspeed_engine_num_blocks_total")),
        # 429s that came after the request's preparation (its compression) had run.
        "refused_after_preparation": _int_or_none(
            read_gauge(run.metrics, "ragspeed_ttft_refused_requests_total", stage="admission")
        ),
    }


def _spread(name: str, seconds: list[float], quantiles: tuple[float, ...]) -> dict[str, float | None]:
    """`{name}_p50_ms`... (`p100` is the largest) over `seconds`; None when there are none."""
    ms = sorted(s * 1000 for s in seconds)
    return {f"{name}_p{round(q * 100)}_ms": round(percentile(ms, q), 1) if ms else None for q in quantiles}


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def bench_load_run(
    *,
    clients: int,
    duration_s: float,
    engine: str,
    model: str,
    server_args: tuple[str, ...] = (),
    url: str | None = None,
    disconnect_fraction: float = 0.2,
    max_tokens: int = 48,
    seed: int = 0,
    data: Path | None = None,
    deadline_ms: float = 10_000.0,
    compression_every_s: float | None = None,
) -> dict[str, Any]:
    """Start a server (unless `url` is given) and run the load; returns the flat figures.
    `data`: an nq_dev.jsonl-style file of questions and documents (None: synthetic prompts)."""
    prompts = load_prompts(data)
    rows = load_arrival_documents(data) if compression_every_s is not None else None
    config = LoadConfig(
        clients=clients,
        duration_s=duration_s,
        disconnect_fraction=disconnect_fraction,
        max_tokens=max_tokens,
        min_tokens=min(4, max_tokens),
        seed=seed,
        deadline_ms=deadline_ms,
        compression_every_s=compression_every_s,
    )
    if url is not None:
        figures = asyncio.run(run_load(url, config, prompts=prompts, arrival_rows=rows))
        return {"engine": engine, "model": model, **figures}
    args = [
        "--engine",
        engine,
        "--model",
        model,
        "--log-level",
        "warning",
        "--max-concurrent-requests",
        str(max(64, clients)),
        *server_args,
    ]
    with ServerProcess(args) as server:
        assert server.process is not None  # started by `with`
        figures = asyncio.run(
            run_load(server.url, config, server_pid=server.process.pid, prompts=prompts, arrival_rows=rows)
        )
    return {"engine": engine, "model": model, **figures}


_TABLE_KEYS = (
    "clients",
    "duration_s",
    "requests_completed",
    "requests_disconnected",
    "requests_per_s_steady",
    "server_errors",
    "client_errors",
    "transport_errors",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "ttft_steady_p99_ms",
    "goodput_per_min",
    "refused",
    "refusal_p99_ms",
    "refusal_p100_ms",
    "refusal_server_p99_ms",
    "refusal_server_p100_ms",
    "refused_after_preparation",
    "gap_p50_ms",
    "gap_p90_ms",
    "gap_p99_ms",
    "ttft_over_predicted_p10",
    "ttft_over_predicted_p50",
    "ttft_over_predicted_p90",
    "ttft_over_predicted_p99",
    "rss_start_mb",
    "rss_end_mb",
    "rss_growth",
    "blocks_in_use_at_end",
    "blocks_total",
)


@click.command(name="load")
@click.option(
    "--clients",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Concurrent streaming clients.",
)
@click.option(
    "--minutes", type=click.FloatRange(min=0, min_open=True), default=None, help="Run length in minutes."
)
@click.option(
    "--seconds",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Run length in seconds (default 60).",
)
@click.option(
    "--engine", default="native", show_default=True, help="Engine of the server started for the run."
)
@click.option(
    "--model", default=DEFAULT_MODEL_NAME, show_default=True, help="Model of the server started for the run."
)
@click.option(
    "--server-arg", "server_args", multiple=True, help="Extra `ragspeed serve` argument (repeatable)."
)
@click.option("--url", default=None, help="Load an already running server instead (no RSS figures).")
@click.option(
    "--disconnect-fraction",
    type=click.FloatRange(0, 1),
    default=0.2,
    show_default=True,
    help="Share of requests whose client hangs up mid-stream.",
)
@max_tokens_option(48, help="Most tokens per request.")
@seed_option()
@click.option(
    "--data",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="nq_dev.jsonl-style questions with documents (default: synthetic prompts).",
)
@click.option(
    "--deadline-ms",
    type=click.FloatRange(min=0, min_open=True),
    default=10_000.0,
    show_default=True,
    help="TTFT that counts toward goodput (the server's own deadline is its --ttft-deadline-ms).",
)
@click.option(
    "--compression",
    is_flag=True,
    help="Also send a 20-document request compressed 4x every --compression-every-s, alone first, "
    "then beside the load: its TTFT both ways and the streams' inter-token gaps.",
)
@click.option(
    "--compression-every-s",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    show_default=True,
    help="Interval of the compressed arrivals.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the figures as flat JSON.",
)
def bench_load(
    clients: int,
    minutes: float | None,
    seconds: float | None,
    engine: str,
    model: str,
    server_args: tuple[str, ...],
    url: str | None,
    disconnect_fraction: float,
    max_tokens: int,
    seed: int,
    data: Path | None,
    deadline_ms: float,
    compression: bool,
    compression_every_s: float,
    json_path: str | None,
) -> None:
    """Load and soak: concurrent streaming clients, some hanging up; errors, TTFT, RSS, KV blocks."""
    if minutes is not None and seconds is not None:
        raise click.BadParameter("give --minutes or --seconds, not both", param_hint="--minutes")
    duration_s = minutes * 60 if minutes is not None else (seconds if seconds is not None else 60.0)
    figures = bench_load_run(
        clients=clients,
        duration_s=duration_s,
        engine=engine,
        model=model,
        server_args=server_args,
        url=url,
        disconnect_fraction=disconnect_fraction,
        max_tokens=max_tokens,
        seed=seed,
        data=data,
        deadline_ms=deadline_ms,
        compression_every_s=compression_every_s if compression else None,
    )
    click.echo(machine_line())
    click.echo(f"ragspeed bench load: {figures['engine']} / {figures['model']}")
    arrivals = (
        "arrival_alone_ttft_p50_ms",
        "arrival_ttft_p50_ms",
        "arrival_ttft_p99_ms",
        "gap_alone_p50_ms",
        "gap_alone_p99_ms",
    )
    for key in _TABLE_KEYS + (arrivals if compression else ()):
        click.echo(f"  {key:<24} {figures[key]}")
    for key in sorted(k for k in figures if k.startswith("status_")):
        click.echo(f"  {key:<24} {figures[key]}")
    write_json(json_path, figures)
