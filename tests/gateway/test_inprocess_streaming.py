"""Streaming in-process, over the fake engine: SSE framing, `[DONE]`, usage in the last chunk,
an engine error after the status was sent, and a client hanging up (the engine request aborted,
its KV blocks freed)."""

from __future__ import annotations

import json

import pytest

from ragspeed.engine.protocol import EngineError, UpstreamError
from ragspeed.evals.asgi_post import post
from tests.gateway.fake_engine import Reply, Stall
from tests.gateway.inprocess import SERVED_MODEL, fake_settings, hang_up, metric, serve, sse_events

pytestmark = pytest.mark.anyio

MESSAGES = [{"role": "user", "content": "Who received the first Nobel Prize in Physics?"}]


def chunks_of(text: str) -> list[dict]:
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


async def test_chat_stream_framing_and_usage(fake):
    async with serve(fake_settings()) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={
                "messages": MESSAGES,
                "max_tokens": 8,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-ragspeed-arm"] == "default"
    # Every event is one `data:` line and a blank line.
    assert response.text.endswith("\n\ndata: [DONE]\n\n")
    assert all(frame.startswith("data: ") for frame in response.text.split("\n\n") if frame)
    chunks = chunks_of(response.text)
    request_id = response.headers["x-ragspeed-request-id"]
    assert {c["id"] for c in chunks} == {f"chatcmpl-{request_id}"}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {c["model"] for c in chunks} == {SERVED_MODEL}
    assert [c["choices"] for c in chunks[:6]] == [
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        *(
            [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]
            for piece in ("The", " answer", " is", " 42", ".")
        ),
    ]
    final, usage = chunks[6], chunks[7]
    assert final["choices"] == [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    assert final["ragspeed"]["request_id"] == request_id and final["ragspeed"]["ttft_ms"] > 0
    assert usage["choices"] == []
    prompt_tokens = len(fake.engine.requests[0].prompt_token_ids)
    assert usage["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert len(chunks) == 8


async def test_a_stream_writes_the_role_with_the_first_piece_and_the_last_with_the_ending(fake):
    async with serve(fake_settings()) as client:
        body = {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
        response = await post(client.app, "/v1/chat/completions", body)
    writes = [sse_events(chunk.decode()) for _, chunk in response.chunks]
    # The fake engine's last delta has the last piece and the finish reason.
    assert [len(events) for events in writes] == [2, 1, 1, 1, 4]
    assert [json.loads(event)["choices"][0]["delta"] for event in writes[0]] == [
        {"role": "assistant", "content": ""},
        {"content": "The"},
    ]
    last, final, usage, done = writes[4]
    assert json.loads(last)["choices"][0]["delta"] == {"content": "."}
    assert json.loads(final)["choices"][0]["finish_reason"] == "stop"
    assert (json.loads(usage)["usage"]["completion_tokens"], done) == (5, "[DONE]")


async def test_text_stream_without_usage(fake):
    async with serve(fake_settings()) as client:
        response = await client.post(
            "/v1/completions", json={"prompt": "Once", "max_tokens": 3, "stream": True}
        )
    chunks = chunks_of(response.text)
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert [c["choices"][0]["text"] for c in chunks] == ["The", " answer", " is", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all("usage" not in c for c in chunks)


async def test_engine_error_mid_stream_ends_with_an_error_event(fake):
    async with serve(fake_settings()) as client:
        fake.engine.script(Reply(error=UpstreamError("upstream 127.0.0.1:9 dropped the stream"), error_at=2))
        response = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
        metrics = (await client.get("/metrics")).text
    assert response.status_code == 200  # sent before the failure
    events = sse_events(response.text)
    assert [json.loads(e)["choices"][0]["delta"] for e in events[:3]] == [
        {"role": "assistant", "content": ""},
        {"content": "The"},
        {"content": " answer"},
    ]
    assert json.loads(events[3]) == {
        "error": {
            "message": "upstream 127.0.0.1:9 dropped the stream",
            "type": "upstream_error",
            "param": None,
            "code": None,
        }
    }
    assert events[4:] == ["[DONE]"]
    assert fake.engine.stats()["num_blocks_used"] == 0.0
    assert metric(metrics, "ragspeed_requests_total", outcome="error") == 1.0


async def test_engine_error_before_the_first_token_is_an_http_error(fake):
    async with serve(fake_settings()) as client:
        fake.engine.script(
            Reply(error=EngineError("no such adapter", param="model", code="bad_adapter")),
            Reply(error=UpstreamError("upstream down")),
        )
        refused = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
        failed = await client.post("/v1/completions", json={"prompt": "Once"})
    assert refused.status_code == 400
    assert refused.json() == {
        "error": {
            "message": "no such adapter",
            "type": "invalid_request_error",
            "param": "model",
            "code": "bad_adapter",
        }
    }
    assert failed.status_code == 502
    assert failed.json()["error"] == {
        "message": "upstream down",
        "type": "upstream_error",
        "param": None,
        "code": None,
    }
    assert fake.engine.stats()["num_blocks_used"] == 0.0


async def test_client_hanging_up_mid_stream_aborts_the_engine_request(fake):
    stall = Stall(at=2)  # never released: only the hang-up ends this request
    async with serve(fake_settings()) as client:
        fake.engine.script(Reply(stall=stall))
        status, chunks = await hang_up(
            client, "/v1/chat/completions", {"messages": MESSAGES, "stream": True}, after_chunks=2
        )
        assert status == 200
        # The role chunk goes out with the first delta's, in one write.
        events = [sse_events(chunk.decode()) for chunk in chunks]
        assert [[json.loads(e)["choices"][0]["delta"] for e in chunk] for chunk in events] == [
            [{"role": "assistant", "content": ""}, {"content": "The"}],
            [{"content": " answer"}],
        ]
        assert fake.engine.aborted == [fake.engine.requests[0].request_id]
        assert fake.engine.stats()["num_blocks_used"] == 0.0
        # The gateway goes on serving, and counted the hang-up.
        after = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        assert after.status_code == 200
        metrics = (await client.get("/metrics")).text
    assert metric(metrics, "ragspeed_requests_total", outcome="aborted") == 1.0
    assert metric(metrics, "ragspeed_requests_total", outcome="length") == 1.0
    assert metric(metrics, "ragspeed_requests_in_flight") == 0.0


async def test_client_hanging_up_a_whole_response_aborts_the_engine_request(fake):
    stall = Stall(at=1)
    async with serve(fake_settings()) as client:
        fake.engine.script(Reply(stall=stall))
        status, chunks = await hang_up(client, "/v1/completions", {"prompt": "Once"}, when=stall.reached)
        metrics = (await client.get("/metrics")).text
    assert (status, chunks) == (None, [])  # gone before any byte
    assert fake.engine.aborted == [fake.engine.requests[0].request_id]
    assert fake.engine.stats()["num_blocks_used"] == 0.0
    assert metric(metrics, "ragspeed_requests_total", outcome="aborted") == 1.0


async def test_many_hang_ups_free_every_block(fake):
    async with serve(fake_settings()) as client:
        for _ in range(20):
            fake.engine.script(Reply(pieces=("a",) * 50, stall=Stall(at=3)))
            await hang_up(
                client,
                "/v1/completions",
                {"prompt": "Once upon a time", "stream": True, "max_tokens": 50},
                after_chunks=3,
            )
        metrics = (await client.get("/metrics")).text
    assert len(fake.engine.aborted) == 20
    assert metric(metrics, "ragspeed_engine_num_blocks_used") == 0.0
    assert metric(metrics, "ragspeed_requests_total", outcome="aborted") == 20.0
