"""Limits in-process, over the fake engine: body size (413), documents and prompt tokens (400),
the admission queue (a held request, a queued one, 429 with Retry-After) and the request
deadline (504, or finish_reason "abort" once streaming). Requests are held in the engine by
events, never by a long generation."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.gateway.fake_engine import Reply, Stall
from tests.gateway.inprocess import SERVED_MODEL, fake_settings, metric, serve, sse_events

pytestmark = pytest.mark.anyio


def small_limits(**overrides):
    return fake_settings(
        max_body_bytes=2048,
        max_documents=2,
        max_prompt_tokens=200,
        max_concurrent_requests=1,
        max_queued_requests=1,
        **overrides,
    )


async def test_body_size_is_413_by_content_length_and_by_streamed_body(fake):
    big = json.dumps({"model": SERVED_MODEL, "messages": [{"role": "user", "content": "x" * 3000}]}).encode()

    async def chunked():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}]}'

    async with serve(small_limits()) as client:
        declared = await client.post(
            "/v1/chat/completions", content=big, headers={"content-type": "application/json"}
        )
        streamed = await client.post(
            "/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"}
        )
        metrics = (await client.get("/metrics")).text
    assert declared.status_code == 413
    assert declared.json()["error"] == {
        "message": f"the request body is {len(big)} bytes; the limit is 2048 bytes (max_body_bytes)",
        "type": "invalid_request_error",
        "param": None,
        "code": "body_too_large",
    }
    assert "content-length" not in streamed.request.headers
    assert streamed.status_code == 413
    assert streamed.json()["error"]["message"] == (
        "the request body is larger than that; the limit is 2048 bytes (max_body_bytes)"
    )
    assert metric(metrics, "ragspeed_rejected_requests_total", reason="body_too_large") == 2.0
    assert fake.engine.requests == []


async def test_a_content_length_that_is_no_number_is_400(fake):
    async with serve(small_limits()) as client:
        response = await client.post(
            "/v1/completions",
            content=b"{}",
            headers={"content-type": "application/json", "content-length": "two"},
        )
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "the Content-Length header is not a number",
        "type": "invalid_request_error",
        "param": "Content-Length",
        "code": "invalid_request",
    }


async def test_documents_and_prompt_tokens_are_400_naming_the_limit(fake):
    async with serve(small_limits()) as client:
        three = await client.post(
            "/v1/chat/completions",
            json={
                "model": SERVED_MODEL,
                "messages": [{"role": "user", "content": "q"}],
                "documents": ["a", "b", "c"],
                "max_tokens": 1,
            },
        )
        wordy = await client.post(
            "/v1/completions", json={"model": SERVED_MODEL, "prompt": "word " * 300, "max_tokens": 1}
        )
    assert three.status_code == 400
    assert three.json()["error"] == {
        "message": "the request has 3 documents; the limit is 2 (max_documents)",
        "type": "invalid_request_error",
        "param": "documents",
        "code": "too_many_documents",
    }
    assert wordy.status_code == 400
    error = wordy.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "prompt_too_long")
    assert error["message"] == "the prompt has 303 tokens; the limit is 200 (max_prompt_tokens)"


async def test_concurrency_limit_queues_then_sheds_with_429(fake):
    """One slot and one queue place: a held request runs, of two more one waits and one is 429;
    once the held one finishes, the queued one is served."""
    stall = Stall(at=1)
    async with serve(small_limits()) as client:
        fake.engine.script(Reply(stall=stall))
        holder = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Once", "stream": True}))
        await stall.reached.wait()  # the holder has the only slot, inside the engine
        second = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2}))
        third = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2}))
        # One of them takes the queue place and waits; the other is shed at once.
        done, pending = await asyncio.wait({second, third}, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        shed, queued = done.pop().result(), pending.pop()
        assert shed.status_code == 429 and shed.headers["retry-after"] == "1"
        assert shed.json()["error"] == {
            "message": "the server is at capacity: 1 requests running and 1 queued (max_queued_requests); "
            "retry later",
            "type": "rate_limit_error",
            "param": None,
            "code": "queue_full",
        }
        assert len(fake.engine.requests) == 1
        stall.release.set()
        assert (await holder).status_code == 200
        assert (await queued).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert len(fake.engine.requests) == 2
    assert metric(metrics, "ragspeed_rejected_requests_total", reason="queue_full") == 1.0


async def test_a_wait_past_queue_timeout_is_429(fake):
    stall = Stall(at=0)
    async with serve(small_limits(queue_timeout_s=0.05)) as client:
        fake.engine.script(Reply(stall=stall))
        holder = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Once"}))
        await stall.reached.wait()
        late = await client.post("/v1/completions", json={"prompt": "Once"})
        stall.release.set()
        assert (await holder).status_code == 200
    assert (late.status_code, late.headers["retry-after"]) == (429, "1")
    assert late.json()["error"]["code"] == "queue_timeout"
    assert (
        late.json()["error"]["message"]
        == "no request slot freed within 0.05 s (queue_timeout_s); retry later"
    )


async def test_deadline_aborts_the_request(fake):
    """Past request_timeout_s: 504 before any byte, finish_reason "abort" once streaming; the
    engine request is aborted (its blocks freed) and the next request is served."""
    async with serve(fake_settings(request_timeout_s=0.2)) as client:
        fake.engine.script(Reply(stall=Stall(at=0)), Reply(stall=Stall(at=2)))  # never released
        whole = await client.post("/v1/completions", json={"prompt": "Once"})
        streamed = await client.post("/v1/completions", json={"prompt": "Once", "stream": True})
        quick = await client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
        metrics = (await client.get("/metrics")).text
    assert whole.status_code == 504, whole.text
    assert whole.json()["error"] == {
        "message": "the request ran past its deadline of 0.2 s (request_timeout_s)",
        "type": "upstream_timeout",
        "param": None,
        "code": "deadline_exceeded",
    }
    assert streamed.status_code == 200
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    finals = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finals == [None, None, "abort"]
    assert quick.status_code == 200
    first, second, _ = fake.engine.requests
    assert fake.engine.aborted == [first.request_id, second.request_id]
    assert metric(metrics, "ragspeed_engine_num_blocks_used") == 0.0
    assert metric(metrics, "ragspeed_requests_total", outcome="deadline") == 2.0
