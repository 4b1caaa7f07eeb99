"""Limits: admission queue and circuit breaker on literal values, then a real server with small
limits (body size, documents, prompt tokens, concurrency, deadline), upstream retries, and
graceful shutdown under SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from ragspeed.bench.launcher import ServerProcess, free_port
from ragspeed.engine.backends.openai_backend import CircuitBreaker, OpenAIEngine
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.protocol import GenerationRequest, SamplingParams, UpstreamError
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.limits import AdmissionQueue


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


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
        await asyncio.sleep(0.01)
        assert (queue.active, queue.waiting) == (1, 2)
        with pytest.raises(APIError) as full:
            await queue.enter()
        assert (full.value.status_code, full.value.code, full.value.headers) == (429, "queue_full", {"Retry-After": "1"})
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
        assert (late.value.status_code, late.value.code, late.value.headers) == (429, "queue_timeout", {"Retry-After": "1"})
        assert queue.waiting == 0
        queue.max_wait_s = 5.0
        gone = asyncio.create_task(queue.enter())
        await asyncio.sleep(0.01)
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
        request = GenerationRequest("r1", (1, 2, 3), SamplingParams(max_tokens=2, temperature=0.0), prompt="Hello")
        # A dead upstream first, a live one second: the refused connect is retried on the live one.
        engine = OpenAIEngine(EngineConfig(backend="openai", model=str(tiny_model), upstream_model="tiny",
                                           upstreams=(_dead_upstream(), transformers_server.url),
                                           upstream_circuit_failures=1))
        await engine.start()
        deltas = [d async for d in engine.generate(request)]
        assert deltas[-1].finish_reason in ("length", "stop")
        assert engine.stats() == {"requests_total": 1.0, "upstream_errors_total": 1.0,
                                  "upstream_retries_total": 1.0, "upstream_circuits_open": 1.0}
        deltas = [d async for d in engine.generate(request)]  # the open circuit is skipped: no retry
        assert engine.stats()["upstream_retries_total"] == 1.0
        await engine.shutdown()

        # Only dead upstreams: 3 attempts, then the error; at 5 failures the circuit opens (503).
        engine = OpenAIEngine(EngineConfig(backend="openai", model=str(tiny_model), upstreams=(_dead_upstream(),),
                                           upstream_max_retries=2, upstream_circuit_failures=5))
        await engine.start()
        with pytest.raises(UpstreamError) as first:
            [d async for d in engine.generate(request)]
        assert first.value.status_code == 502 and "after 3 attempts" in first.value.message
        with pytest.raises(UpstreamError) as second:
            [d async for d in engine.generate(request)]
        assert (second.value.status_code, second.value.code) == (503, "upstream_unavailable")
        assert engine.stats() == {"requests_total": 2.0, "upstream_errors_total": 5.0,
                                  "upstream_retries_total": 4.0, "upstream_circuits_open": 1.0}
        await engine.shutdown()

    asyncio.run(scenario())


# ---------------------------------------------------------------------- a real server with small limits

# 4,000 tokens take the tiny model ~4 s or more on a 2-core machine: far past every deadline below.
LONG = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def limited_server(tiny_model):
    args = ["--engine", "transformers", "--model", str(tiny_model), "--served-model-name", "tiny",
            "--max-body-bytes", "2048", "--max-documents", "2", "--max-prompt-tokens", "200",
            "--max-concurrent-requests", "1", "--max-queued-requests", "1", "--queue-timeout-s", "30"]
    with ServerProcess(args) as server:
        yield server


@pytest.fixture(scope="module")
def deadline_server(tiny_model):
    args = ["--engine", "transformers", "--model", str(tiny_model), "--served-model-name", "tiny",
            "--request-timeout-s", "0.5"]
    with ServerProcess(args) as server:
        yield server


def _post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kwargs)


def test_body_size_is_413_by_content_length_and_by_streamed_body(limited_server):
    big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 3000}]}).encode()
    response = httpx.post(f"{limited_server.url}/v1/chat/completions", content=big,
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413
    assert response.json()["error"] == {
        "message": f"the request body is {len(big)} bytes; the limit is 2048 bytes "
                   f"(max_body_bytes)", "type": "invalid_request_error", "param": None, "code": "body_too_large"}

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}]}'

    response = httpx.post(f"{limited_server.url}/v1/chat/completions", content=chunked(),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413
    assert "larger than that; the limit is 2048 bytes (max_body_bytes)" in response.json()["error"]["message"]


def test_documents_and_prompt_tokens_are_400_naming_the_limit(limited_server):
    three = {"model": "tiny", "messages": [{"role": "user", "content": "q"}], "documents": ["a", "b", "c"], "max_tokens": 1}
    response = _post(limited_server, "/v1/chat/completions", three)
    assert response.status_code == 400
    assert response.json()["error"] == {"message": "the request has 3 documents; the limit is 2 (max_documents)",
                                        "type": "invalid_request_error", "param": "documents",
                                        "code": "too_many_documents"}
    wordy = {"model": "tiny", "prompt": "word " * 300, "max_tokens": 1}
    response = _post(limited_server, "/v1/completions", wordy)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "prompt_too_long")
    assert error["message"].endswith("tokens; the limit is 200 (max_prompt_tokens)")


def test_deadline_aborts_the_request(deadline_server):
    """Past request_timeout_s: 504 before any byte, finish_reason "abort" once streaming; the
    engine is free right after (the next request is served)."""
    body = {"model": "tiny", "prompt": "Once", **LONG}
    t0 = time.perf_counter()
    response = _post(deadline_server, "/v1/completions", body)
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert response.json()["error"]["type"] == "upstream_timeout"
    assert time.perf_counter() - t0 < 10
    with httpx.stream("POST", f"{deadline_server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    finals = [json.loads(e[5:])["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finals[-1] == "abort" and set(finals[:-1]) == {None}
    quick = _post(deadline_server, "/v1/completions", {"model": "tiny", "prompt": "Once", "max_tokens": 2})
    assert quick.status_code == 200


def test_concurrency_limit_queues_then_sheds_with_429(limited_server):
    """One slot and one queue place: a long stream runs, a second request waits, a third is 429;
    once the stream's client hangs up, the queued request is served."""
    url = f"{limited_server.url}/v1/completions"
    long_body = {"model": "tiny", "prompt": "Once", "stream": True, **LONG}
    results: dict[str, int] = {}

    def queued() -> None:
        results["queued"] = httpx.post(url, json={"model": "tiny", "prompt": "Once", "max_tokens": 2}, timeout=60).status_code

    with httpx.stream("POST", url, json=long_body, timeout=60) as holder:
        assert holder.status_code == 200
        lines = holder.iter_lines()
        next(lines)  # the stream holds the only slot until we hang up
        waiter = threading.Thread(target=queued)
        waiter.start()
        time.sleep(0.5)  # the second request is now in the queue
        shed = httpx.post(url, json={"model": "tiny", "prompt": "Once", "max_tokens": 2}, timeout=60)
        assert shed.status_code == 429 and shed.headers["retry-after"] == "1"
        assert shed.json()["error"]["code"] == "queue_full"
        assert "queued" not in results
    waiter.join(60)
    assert results == {"queued": 200}
    metrics = httpx.get(f"{limited_server.url}/metrics", timeout=10).text
    assert 'ragspeed_rejected_requests_total{reason="queue_full"} 1.0' in metrics


# ---------------------------------------------------------------------- graceful shutdown


def _stream_through_sigterm(server: ServerProcess, max_tokens: int) -> tuple[list[str], float]:
    """Start a stream, SIGTERM the server after its first chunk, read what arrives; returns the
    data lines and the seconds from the signal to the server's exit."""
    body = {"model": "tiny", "prompt": "Once", "stream": True, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    lines: list[str] = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as stream:
        iterator = stream.iter_lines()
        lines.append(next(iterator))
        server.process.send_signal(signal.SIGTERM)
        signalled = time.perf_counter()
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # no new connections while draining
            httpx.get(f"{server.url}/healthz", timeout=2)
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
    server = ServerProcess(["--engine", "transformers", "--model", str(tiny_model), "--served-model-name", "tiny",
                            "--shutdown-drain-s", "60"]).start()
    try:
        lines, _ = _stream_through_sigterm(server, max_tokens=200)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2].removeprefix("data:"))["choices"][0]["finish_reason"] == "length"
        _assert_clean_exit(server)
    finally:
        server.stop()


def test_sigterm_aborts_streams_past_the_drain_deadline(tiny_model):
    server = ServerProcess(["--engine", "transformers", "--model", str(tiny_model), "--served-model-name", "tiny",
                            "--shutdown-drain-s", "0.5", "--request-timeout-s", "600"]).start()
    try:
        lines, exit_s = _stream_through_sigterm(server, max_tokens=LONG["max_tokens"])
        assert "data: [DONE]" not in lines  # cut, not finished
        assert exit_s < 15
        _assert_clean_exit(server)
        assert "timeout graceful shutdown exceeded" in server.log_tail()
    finally:
        server.stop()
