"""Limits: admission queue and circuit breaker on literal values, upstream retries against a real
server, and graceful shutdown under SIGTERM of a real server. The limits a request meets over
HTTP (body size, documents, prompt tokens, concurrency, deadline) are tested in-process:
test_inprocess_limits.py."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from ragspeed.bench.launcher import ServerProcess, free_port
from ragspeed.engine.backends.remote.openai_backend import CircuitBreaker, OpenAIEngine
from ragspeed.engine.config import EngineConfig, UpstreamConfig
from ragspeed.engine.protocol import GenerationRequest, SamplingParams, UpstreamError
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.limits import AdmissionQueue


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def until(condition, max_steps: int = 100) -> None:
    """Let other tasks run until `condition()` holds (nothing here waits on I/O or a clock)."""
    for _ in range(max_steps):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def test_admission_queue_is_fifo_and_bounded():
    async def scenario() -> list[str]:
        queue = AdmissionQueue(max_active=1, max_waiting=2, max_wait_s=5.0)
        events: list[str] = []
        await queue.enter()

        async def waiter(name: str) -> None:
            await queue.enter()
            events.append(f"{name} in")
            await asyncio.sleep(0)
            queue.leave()

        a = asyncio.create_task(waiter("a"))
        b = asyncio.create_task(waiter("b"))
        await until(lambda: queue.waiting == 2)
        assert (queue.active, queue.waiting) == (1, 2)
        with pytest.raises(APIError) as full:
            await queue.enter()
        assert (full.value.status_code, full.value.code, full.value.headers) == (
            429,
            "queue_full",
            {"Retry-After": "1"},
        )
        queue.leave()  # hands the slot to "a", then "a" hands it to "b"
        await asyncio.gather(a, b)
        events.append(f"active={queue.active} waiting={queue.waiting}")
        return events

    assert asyncio.run(scenario()) == ["a in", "b in", "active=0 waiting=0"]


def test_admission_queue_wait_times_out_and_cancelled_waiters_leave():
    async def scenario() -> None:
        queue = AdmissionQueue(max_active=1, max_waiting=4, max_wait_s=0.05)
        await queue.enter()
        with pytest.raises(APIError) as late:
            await queue.enter()
        assert (late.value.status_code, late.value.code, late.value.headers) == (
            429,
            "queue_timeout",
            {"Retry-After": "1"},
        )
        assert queue.waiting == 0
        queue.max_wait_s = 5.0
        gone = asyncio.create_task(queue.enter())
        await until(lambda: queue.waiting == 1)
        gone.cancel()  # a client that went away while queued
        await asyncio.gather(gone, return_exceptions=True)
        assert (queue.active, queue.waiting) == (1, 0)
        queue.leave()
        assert queue.active == 0

    asyncio.run(scenario())


def test_circuit_breaker_literal_transitions():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=3, reset_s=10.0, clock=clock)
    for _ in range(2):
        breaker.record_failure()
    assert (breaker.state, breaker.allow()) == ("closed", True)
    breaker.record_failure()
    assert (breaker.state, breaker.allow()) == ("open", False)
    clock.now = 9.9
    assert breaker.allow() is False
    clock.now = 10.0
    assert (breaker.allow(), breaker.state) == (True, "half_open")  # one trial
    assert breaker.allow() is False  # the trial is in flight
    breaker.record_failure()
    assert breaker.state == "open"
    clock.now = 20.0
    assert breaker.allow() is True
    breaker.record_success()
    assert (breaker.state, breaker.num_failures, breaker.allow()) == ("closed", 0, True)


def _dead_upstream() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there: connect is refused


def test_upstream_connect_errors_retry_and_open_the_circuit(tiny_model, transformers_server):
    async def scenario() -> None:
        request = GenerationRequest(
            "r1", (1, 2, 3), SamplingParams(max_tokens=2, temperature=0.0), prompt="Hello"
        )
        # A dead upstream first, a live one second: the refused connect is retried on the live one.
        engine = OpenAIEngine(
            EngineConfig(backend="openai", model=str(tiny_model)),
            UpstreamConfig(
                urls=(_dead_upstream(), transformers_server.url), model="tiny", circuit_failures=1
            ),
        )
        await engine.start()
        deltas = [d async for d in engine.generate(request)]
        assert deltas[-1].finish_reason in ("length", "stop")
        assert engine.stats() == {
            "requests_total": 1.0,
            "upstream_errors_total": 1.0,
            "upstream_retries_total": 1.0,
            "upstream_circuits_open": 1.0,
        }
        deltas = [d async for d in engine.generate(request)]  # the open circuit is skipped: no retry
        assert engine.stats()["upstream_retries_total"] == 1.0
        await engine.shutdown()

        # Only dead upstreams: 3 attempts, then the error; at 5 failures the circuit opens (503).
        engine = OpenAIEngine(
            EngineConfig(backend="openai", model=str(tiny_model)),
            UpstreamConfig(urls=(_dead_upstream(),), max_retries=2, circuit_failures=5),
        )
        await engine.start()
        with pytest.raises(UpstreamError) as first:
            [d async for d in engine.generate(request)]
        assert first.value.status_code == 502 and "after 3 attempts" in first.value.message
        with pytest.raises(UpstreamError) as second:
            [d async for d in engine.generate(request)]
        assert (second.value.status_code, second.value.code) == (503, "upstream_unavailable")
        assert engine.stats() == {
            "requests_total": 2.0,
            "upstream_errors_total": 5.0,
            "upstream_retries_total": 4.0,
            "upstream_circuits_open": 1.0,
        }
        await engine.shutdown()

    asyncio.run(scenario())


# 4,000 tokens take the tiny model ~4 s or more on a 2-core machine: far past the drain deadline below.
LONG = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}


# ---------------------------------------------------------------------- graceful shutdown


def _refuses_connections(server: ServerProcess, timeout_s: float) -> bool:
    """Poll /healthz until the server refuses the connection; False if it still answers after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{server.url}/healthz", timeout=2)
        except httpx.TransportError:
            return True
        time.sleep(0.02)
    return False


def _stream_through_sigterm(server: ServerProcess, max_tokens: int) -> tuple[list[str], float]:
    """Start a stream, SIGTERM the server after its first chunk, read what arrives; returns the
    data lines and the seconds from the signal to the server's exit."""
    body = {
        "model": "tiny",
        "prompt": "Once",
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    lines: list[str] = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as stream:
        iterator = stream.iter_lines()
        lines.append(next(iterator))
        server.process.send_signal(signal.SIGTERM)
        signalled = time.perf_counter()
        assert _refuses_connections(server, timeout_s=10)  # no new connections while draining
        try:
            lines.extend(iterator)
        except httpx.TransportError:
            pass  # cut at the drain deadline
    server.process.wait(30)
    return [line for line in lines if line.startswith("data:")], time.perf_counter() - signalled


def _assert_clean_exit(server: ServerProcess) -> None:
    # uvicorn re-raises the SIGTERM it caught once it has shut down: -15 is the clean exit.
    assert server.process.returncode in (0, -signal.SIGTERM)
    log = server.log_tail()
    assert "Application shutdown complete" in log and "Traceback" not in log


def test_sigterm_drains_a_stream_in_flight(tiny_model):
    server = ServerProcess(
        [
            "--engine",
            "transformers",
            "--model",
            str(tiny_model),
            "--served-model-name",
            "tiny",
            "--shutdown-drain-s",
            "60",
        ]
    ).start()
    try:
        lines, _ = _stream_through_sigterm(server, max_tokens=200)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2].removeprefix("data:"))["choices"][0]["finish_reason"] == "length"
        _assert_clean_exit(server)
    finally:
        server.stop()


def test_sigterm_aborts_streams_past_the_drain_deadline(tiny_model):
    server = ServerProcess(
        [
            "--engine",
            "transformers",
            "--model",
            str(tiny_model),
            "--served-model-name",
            "tiny",
            "--shutdown-drain-s",
            "0.5",
            "--request-timeout-s",
            "600",
        ]
    ).start()
    try:
        lines, exit_s = _stream_through_sigterm(server, max_tokens=LONG["max_tokens"])
        assert "data: [DONE]" not in lines  # cut, not finished
        assert exit_s < 15
        _assert_clean_exit(server)
        assert "timeout graceful shutdown exceeded" in server.log_tail()
    finally:
        server.stop()
