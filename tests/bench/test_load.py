"""`ragspeed bench load`, short: concurrent streaming clients, some hanging up mid-stream, against
a real server; no 5xx, and every KV block free once the load stops."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from click.testing import CliRunner

from ragspeed.bench.common import percentile
from ragspeed.bench.launcher import ServerProcess
from ragspeed.bench.load import LoadConfig, bench_load, bench_load_run, read_gauge, run_load


def test_percentile_and_gauge_parsing():
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile(list(map(float, range(1, 101))), 0.99) == 99.0
    text = (
        '# HELP x\nragspeed_engine_num_blocks_used{model="m"} 3.0\n'
        'ragspeed_requests_in_flight{arm="a",model="m"} 1.0\nragspeed_requests_in_flight{arm="b",model="m"} 2.0\n'
    )
    assert read_gauge(text, "ragspeed_engine_num_blocks_used") == 3.0
    assert read_gauge(text, "ragspeed_requests_in_flight") == 3.0
    assert read_gauge(text, "ragspeed_requests_in_flight", arm="b") == 2.0
    assert read_gauge(text, "ragspeed_requests_in_flight", arm="c") is None
    assert read_gauge(text, "ragspeed_engine_num_blocks_total") is None


def test_short_load_transformers(tiny_model):
    figures = bench_load_run(
        clients=4,
        duration_s=6.0,
        engine="transformers",
        model=str(tiny_model),
        disconnect_fraction=0.5,
        max_tokens=16,
    )
    assert figures["server_errors"] == 0 and figures["transport_errors"] == 0
    assert figures["requests_completed"] >= 1 and figures["requests_disconnected"] >= 1
    assert figures["ttft_p50_ms"] <= figures["ttft_p99_ms"]
    assert figures["rss_start_mb"] > 0 and figures["rss_growth"] is not None
    assert figures["blocks_in_use_at_end"] is None  # the transformers baseline has no paged KV cache


def test_bench_load_command_writes_flat_json(tmp_path, tiny_model):
    out = tmp_path / "load.json"
    result = CliRunner().invoke(
        bench_load,
        [
            "--clients",
            "2",
            "--seconds",
            "3",
            "--engine",
            "transformers",
            "--model",
            str(tiny_model),
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "ttft_p99_ms" in result.output
    figures = json.loads(out.read_text())
    assert {"server_errors", "ttft_p99_ms", "rss_growth", "blocks_in_use_at_end"} <= set(figures)
    assert all(not isinstance(v, (dict, list)) for v in figures.values())  # flat
    assert figures["server_errors"] == 0


# ---------------------------------------------------------------------- the native engine

NUM_KV_TOKENS, BLOCK_SIZE = 8192, 16


@pytest.fixture(scope="module")
def native_server(tiny_model):
    with ServerProcess(
        [
            "--engine",
            "native",
            "--model",
            str(tiny_model),
            "--served-model-name",
            "tiny",
            "--num-kv-cache-tokens",
            str(NUM_KV_TOKENS),
            "--block-size",
            str(BLOCK_SIZE),
            "--log-level",
            "warning",
        ]
    ) as server:
        yield server


def _engine_gauge(server, name: str) -> float | None:
    return read_gauge(httpx.get(f"{server.url}/metrics", timeout=10).text, f"ragspeed_engine_{name}")


def test_short_load_native_frees_every_block(native_server):
    config = LoadConfig(clients=4, duration_s=6.0, disconnect_fraction=0.3, max_tokens=32)
    figures = asyncio.run(run_load(native_server.url, config, server_pid=native_server.process.pid))
    assert (
        figures["server_errors"] == 0 and figures["transport_errors"] == 0 and figures["client_errors"] == 0
    )
    assert figures["requests_completed"] >= 1 and figures["requests_disconnected"] >= 1
    assert figures["blocks_in_use_at_end"] == 0
    assert figures["blocks_total"] == NUM_KV_TOKENS // BLOCK_SIZE


def test_a_client_hanging_up_aborts_its_generation(native_server):
    before = _engine_gauge(native_server, "generation_tokens_total")
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "stream": True,
        "max_tokens": 3000,
        "ignore_eos": True,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{native_server.url}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        for _ in range(3):
            next(lines)
    # Hung up: the engine drops the request within a step or so, and frees its blocks.
    deadline = time.monotonic() + 10
    while _engine_gauge(native_server, "num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _engine_gauge(native_server, "num_requests_running") == 0
    assert _engine_gauge(native_server, "num_blocks_used") == 0
    generated = _engine_gauge(native_server, "generation_tokens_total") - before
    assert 3 <= generated < 3000


@pytest.mark.slow
def test_thousand_aborted_streams_leave_every_block_free_and_memory_flat(native_server):
    warm = LoadConfig(clients=8, duration_s=10.0, disconnect_fraction=0.5, max_tokens=64, seed=1)
    asyncio.run(run_load(native_server.url, warm, server_pid=native_server.process.pid))
    aborted = LoadConfig(
        clients=8,
        duration_s=900.0,
        warmup_fraction=0.0,
        disconnect_fraction=1.0,
        max_tokens=256,
        seed=2,
        max_requests=1000,
    )
    figures = asyncio.run(run_load(native_server.url, aborted, server_pid=native_server.process.pid))
    assert figures["requests_started"] == 1000 and figures["requests_disconnected"] >= 990
    assert figures["server_errors"] == 0 and figures["transport_errors"] == 0
    assert figures["blocks_in_use_at_end"] == 0
    assert figures["rss_growth"] <= 0.05


def test_compressed_arrivals_are_timed_alone_and_beside_the_streams(native_server):
    config = LoadConfig(
        clients=2, duration_s=4.0, max_tokens=24, disconnect_fraction=0.0, compression_every_s=1.0
    )
    figures = asyncio.run(run_load(native_server.url, config, server_pid=native_server.process.pid))
    assert figures["server_errors"] == 0 and figures["transport_errors"] == 0
    assert figures["arrival_alone_ttft_p50_ms"] > 0 and figures["arrival_ttft_p50_ms"] > 0
    # Chunks that reach the client in one read are 0 ms apart: a busy machine can make most
    # gaps 0, so only the slowest must be positive.
    assert (
        0 <= figures["gap_p50_ms"] <= figures["gap_p90_ms"] <= figures["gap_p99_ms"]
        and figures["gap_p99_ms"] > 0
    )
    assert 0 <= figures["gap_alone_p50_ms"] <= figures["gap_alone_p99_ms"] and figures["gap_alone_p99_ms"] > 0
    assert figures["refused"] == 0 and figures["refusal_p99_ms"] is None
    assert figures["goodput_per_min"] > 0


def test_requests_that_miss_the_deadline_alone_are_served_and_refused_only_for_load(tiny_model):
    """A 1 ms TTFT deadline, which every request misses alone (they were once all refused, for
    their size): a request with nothing ahead of it is served; one behind another's prefill is
    answered 429 with Retry-After, quickly; nothing is left in the engine."""
    with ServerProcess(
        [
            "--engine",
            "native",
            "--model",
            str(tiny_model),
            "--ttft-deadline-ms",
            "1",
            "--log-level",
            "warning",
        ]
    ) as server:
        config = LoadConfig(clients=2, duration_s=2.5, max_tokens=8)
        figures = asyncio.run(run_load(server.url, config, server_pid=server.process.pid))
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert figures["server_errors"] == 0 and figures["transport_errors"] == 0
    assert figures["requests_completed"] >= 1 and figures["goodput_per_min"] > 0
    assert figures["refused"] == figures["status_429"]
    assert figures["refused"] == 0 or figures["refusal_p100_ms"] < 1000
    assert figures["blocks_in_use_at_end"] == 0
    assert (read_gauge(metrics, "ragspeed_ttft_refused_requests_total") or 0) == figures["refused"]
    # Each refusal is counted at one stage: at arrival, or after its preparation (a request
    # whose arrival finds no admitted request to size it by passes the first check).
    at_arrival = read_gauge(metrics, "ragspeed_ttft_refused_requests_total", stage="arrival") or 0
    after_preparation = figures["refused_after_preparation"] or 0
    assert at_arrival + after_preparation == figures["refused"]
    assert read_gauge(metrics, "ragspeed_admission_seconds_per_token") > 0
