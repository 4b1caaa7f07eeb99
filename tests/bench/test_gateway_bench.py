"""`bench gateway`: the instant upstream's answers, the client's checks, and a short real run
(the instant upstream, a gateway in front of it) whose figures add up."""

from __future__ import annotations

import asyncio
import json

import pytest

from ragspeed.bench.gateway import (
    Answer,
    BenchError,
    GatewayBenchConfig,
    HttpConnection,
    _check,
    chat_payload,
    report_lines,
    run_gateway_bench,
    streamed_text,
)
from ragspeed.bench.instant_upstream import InstantUpstream, answer


def test_the_instant_upstream_streams_chat_and_text_with_usage():
    chat = answer("/v1/chat/completions", {"stream": True, "max_tokens": 3})
    assert streamed_text(chat.partition(b"\r\n\r\n")[2]) == " tok tok tok"
    text = answer(
        "/v1/completions", {"stream": True, "max_tokens": 2, "stream_options": {"include_usage": True}}
    )
    events = [line for line in text.split(b"\n") if line.startswith(b"data: {")]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:3]] == [" tok", " tok", ""]
    assert json.loads(events[-1][6:])["usage"]["completion_tokens"] == 2
    whole = answer("/v1/chat/completions", {"max_tokens": 2})
    assert json.loads(whole.partition(b"\r\n\r\n")[2])["choices"][0]["message"]["content"] == " tok tok"


def test_the_client_reads_keep_alive_answers_in_turn():
    async def run() -> list[Answer]:
        upstream = await InstantUpstream.start()
        connection = await HttpConnection.open(upstream.url)
        answers = [await connection.post("/v1/chat/completions", chat_payload(n, "m")) for n in (1, 4)]
        connection.close()
        await upstream.close()
        assert (upstream.num_connections, upstream.num_requests) == (1, 2)
        return answers

    first, second = asyncio.run(run())
    assert (first.status, first.text) == (200, " tok")
    assert (second.status, second.text) == (200, " tok tok tok tok")


def test_an_answer_that_differs_from_the_upstreams_fails_the_bench():
    _check(Answer(200, 0.001, "a"), "the gateway", "a")
    with pytest.raises(BenchError, match="answered 502"):
        _check(Answer(502, 0.001, ""), "the gateway", None)
    with pytest.raises(BenchError, match="streamed 'b', the upstream 'a'"):
        _check(Answer(200, 0.001, "b"), "the gateway", "a")


def test_a_short_run_against_the_instant_upstream(tiny_model):
    config = GatewayBenchConfig(
        num_requests=10, num_warmup=2, max_tokens=4, concurrency=4, seconds=0.3, model=str(tiny_model)
    )
    r = run_gateway_bench(config)
    assert (r["upstream"], r["num_requests"], r["concurrency"], r["streamed"]) == ("instant", 10, 4, True)
    assert 0 < r["direct_p50_ms"] <= r["direct_p99_ms"]
    assert 0 < r["gateway_p50_ms"] <= r["gateway_p99_ms"]
    assert r["added_p50_ms"] <= r["added_p99_ms"]
    assert r["direct_requests_per_s"] > 0 and r["gateway_requests_per_s"] > 0
    assert r["throughput_ratio"] == r["gateway_requests_per_s"] / r["direct_requests_per_s"]
    lines = report_lines(r)
    assert lines[0] == "upstream: instant (answers at once); streamed chat, 4 tokens a request"
    assert lines[-1].split() == ["ratio", f"{r['throughput_ratio']:.3f}"]
