"""`ragspeed bench gateway`: the latency the gateway adds in front of an OpenAI-compatible upstream.

One run starts two real servers: an upstream (`ragspeed serve` on an embedded engine) and a
gateway (`--engine openai`) in front of it. The same chat requests go to both, interleaved in
time so machine drift hits both alike; the added latency is gateway minus direct.
"""

from __future__ import annotations

import json
import statistics
import time

import click
import httpx

from ragspeed.bench.common import machine_line, percentile, write_json
from ragspeed.bench.launcher import ServerProcess
from ragspeed.engine.model_zoo import DEFAULT_MODEL_NAME

QUESTIONS = [
    "Who received the first Nobel Prize in Physics?",
    "When was the Eiffel Tower built?",
    "What is the capital of Australia?",
    "Who wrote the novel Moby-Dick?",
]


def run_gateway_bench(model: str, engine: str, num_requests: int, max_tokens: int) -> dict[str, float]:
    with (
        ServerProcess(["--engine", engine, "--model", model, "--served-model-name", "upstream"]) as upstream,
        ServerProcess(
            [
                "--engine",
                "openai",
                "--model",
                model,
                "--upstream",
                upstream.url,
                "--upstream-model",
                "upstream",
            ]
        ) as gateway,
        httpx.Client(timeout=120) as http,
    ):
        targets = {"direct": (upstream.url, "upstream"), "gateway": (gateway.url, None)}
        latencies: dict[str, list[float]] = {"direct": [], "gateway": []}
        for i in range(num_requests + 3):  # the first 3 rounds warm up
            question = QUESTIONS[i % len(QUESTIONS)]
            order = ("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")
            for name in order:
                url, model_name = targets[name]
                body = {
                    "messages": [
                        {"role": "system", "content": "Answer briefly."},
                        {"role": "user", "content": question},
                    ],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                if model_name:
                    body["model"] = model_name
                t0 = time.perf_counter()
                response = http.post(f"{url}/v1/chat/completions", json=body)
                elapsed = time.perf_counter() - t0
                response.raise_for_status()
                if i >= 3:
                    latencies[name].append(elapsed * 1000)
    paired = [g - d for g, d in zip(latencies["gateway"], latencies["direct"])]
    return {
        "num_requests": num_requests,
        "max_tokens": max_tokens,
        "direct_p50_ms": statistics.median(latencies["direct"]),
        "direct_p99_ms": percentile(latencies["direct"], 0.99),
        "gateway_p50_ms": statistics.median(latencies["gateway"]),
        "gateway_p99_ms": percentile(latencies["gateway"], 0.99),
        "added_p50_ms": statistics.median(latencies["gateway"]) - statistics.median(latencies["direct"]),
        "added_p99_ms": percentile(latencies["gateway"], 0.99) - percentile(latencies["direct"], 0.99),
        "added_paired_p50_ms": statistics.median(paired),
        "added_paired_p99_ms": percentile(paired, 0.99),
    }


@click.command(name="gateway")
@click.option("--model", default=DEFAULT_MODEL_NAME, show_default=True)
@click.option("--engine", default="transformers", show_default=True, help="The upstream's engine.")
@click.option("--requests", "num_requests", type=click.IntRange(min=5), default=100, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def bench_gateway(model: str, engine: str, num_requests: int, max_tokens: int, json_path: str | None) -> None:
    """Latency the gateway adds in front of an openai upstream (p50/p99, ms)."""
    result = run_gateway_bench(model, engine, num_requests, max_tokens)
    click.echo(machine_line())
    click.echo(f"{'':10} {'p50 ms':>10} {'p99 ms':>10}")
    for name in ("direct", "gateway", "added"):
        click.echo(f"{name:10} {result[f'{name}_p50_ms']:10.2f} {result[f'{name}_p99_ms']:10.2f}")
    click.echo(f"{'paired':10} {result['added_paired_p50_ms']:10.2f} {result['added_paired_p99_ms']:10.2f}")
    write_json(json_path, result)
    click.echo(json.dumps(result))
