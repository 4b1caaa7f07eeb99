"""The pipeline in-process, over the fake engine: documents in, the prompt assembled as
contract 1 lays it out, the request the engine gets, per-stage timings in the body and the
`x-ragspeed-*` headers, /v1/models, /healthz and /metrics."""

from __future__ import annotations

import pytest

from tests.gateway.fake_engine import Reply
from tests.gateway.inprocess import SERVED_MODEL, fake_settings, metric, serve

pytestmark = pytest.mark.anyio

SYSTEM = "Answer from the documents."
QUESTION = "Who received the first Nobel Prize in Physics?"
DOCUMENTS = [
    {
        "title": "Nobel Prize in Physics",
        "text": "The first Nobel Prize in Physics was awarded in 1901 to Wilhelm Conrad Röntgen.",
    },
    "John Bardeen is the only laureate to win the prize twice.",
]


def chat_body(**extra) -> dict:
    return {
        "model": SERVED_MODEL,
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        **extra,
    }


async def test_documents_go_into_the_prompt_between_system_and_question(fake, demo_tokenizer):
    async with serve(fake_settings()) as client:
        response = await client.post(
            "/v1/chat/completions", json=chat_body(documents=DOCUMENTS, ragspeed={"return_prompt": True})
        )
        bare = await client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 200, response.text
    body = response.json()
    prompt = body["ragspeed"]["prompt"]
    assert (
        prompt.index(SYSTEM)
        < prompt.index("Wilhelm Conrad Röntgen")
        < prompt.index("John Bardeen")
        < prompt.index(QUESTION)
    )
    # The engine got exactly that prompt, tokenized, with the static system prompt marked.
    sent, sent_bare = fake.engine.requests
    assert sent.prompt == prompt
    assert list(sent.prompt_token_ids) == demo_tokenizer.encode(prompt, add_special_tokens=False)
    assert body["ragspeed"]["num_static_tokens"] == sent.num_static_tokens > 0
    assert (
        sent.prompt_token_ids[: sent.num_static_tokens]
        == sent_bare.prompt_token_ids[: sent.num_static_tokens]
    )
    assert (sent.sampling.max_tokens, sent.sampling.temperature) == (8, 0.0)
    assert body["usage"] == {
        "prompt_tokens": len(sent.prompt_token_ids),
        "completion_tokens": 5,
        "total_tokens": len(sent.prompt_token_ids) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert bare.json()["usage"]["prompt_tokens"] > 0
    assert body["usage"]["prompt_tokens"] > bare.json()["usage"]["prompt_tokens"] + 30
    assert "prompt" not in bare.json()["ragspeed"]  # only echoed when asked


async def test_chat_body_shape_and_timings(fake):
    async with serve(fake_settings()) as client:
        response = await client.post("/v1/chat/completions", json=chat_body(documents=DOCUMENTS))
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == SERVED_MODEL
    assert body["id"] == f"chatcmpl-{body['ragspeed']['request_id']}"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "The answer is 42."},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ]
    ragspeed = body["ragspeed"]
    assert ragspeed["arm"] == "default"
    # With no method configured documents skip the compression stage and go as they are.
    assert set(ragspeed["timings_ms"]) == {
        "segments",
        "prompt",
        "engine_first_token",
        "decode",
    }
    assert "compression" not in ragspeed
    assert all(ms >= 0 for ms in ragspeed["timings_ms"].values())
    assert 0 < ragspeed["ttft_ms"] <= ragspeed["e2e_ms"]
    headers = response.headers
    assert headers["x-ragspeed-request-id"] == ragspeed["request_id"]
    assert headers["x-ragspeed-arm"] == "default"
    assert headers["x-ragspeed-prompt-tokens"] == str(body["usage"]["prompt_tokens"])
    for stage in ("segments", "prompt", "engine-first-token", "decode", "ttft"):
        assert float(headers[f"x-ragspeed-{stage}-ms"]) >= 0
    assert "x-ragspeed-cached-tokens" not in headers  # nothing came from the cache


async def test_cached_tokens_reach_usage_and_headers(fake):
    async with serve(fake_settings()) as client:
        fake.engine.script(Reply(num_cached_tokens=32))
        response = await client.post("/v1/chat/completions", json=chat_body())
    assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert response.headers["x-ragspeed-cached-tokens"] == "32"


async def test_max_tokens_cuts_the_reply_with_length(fake):
    async with serve(fake_settings()) as client:
        response = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    choice = response.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("The answer", "length")
    assert response.json()["usage"]["completion_tokens"] == 2


async def test_documents_between_markers_equal_documents_field(fake):
    plain = [d if isinstance(d, str) else d["text"] for d in DOCUMENTS]
    marked = "".join(f"<document>{text}</document>" for text in plain)
    async with serve(fake_settings()) as client:
        await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": f"{marked}\n{QUESTION}"}], "max_tokens": 4},
        )
        await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "documents": plain},
        )
    from_markers, from_field = fake.engine.requests
    assert from_markers.prompt_token_ids == from_field.prompt_token_ids


async def test_text_completion_sends_the_prompt_as_is(fake, demo_tokenizer):
    async with serve(fake_settings()) as client:
        response = await client.post(
            "/v1/completions",
            json={"prompt": "The first Nobel Prize", "max_tokens": 3, "seed": 7, "stop": ["x"]},
        )
        by_ids = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1})
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "The answer is"
    sent, sent_ids = fake.engine.requests
    assert list(sent.prompt_token_ids) == demo_tokenizer.encode("The first Nobel Prize")
    assert (sent.num_static_tokens, sent.sampling.seed, sent.sampling.stop) == (0, 7, ("x",))
    assert set(body["ragspeed"]["timings_ms"]) == {"prompt", "engine_first_token", "decode"}
    assert by_ids.status_code == 200 and sent_ids.prompt_token_ids == (5, 6, 7)


async def test_models_health_and_metrics(fake):
    async with serve(fake_settings()) as client:
        await client.post("/v1/chat/completions", json=chat_body())
        models = (await client.get("/v1/models")).json()
        health = (await client.get("/healthz")).json()
        metrics = (await client.get("/metrics")).text
    assert [(m["id"], m["max_model_len"], m["engine"]) for m in models["data"]] == [
        (SERVED_MODEL, 4096, "fake")
    ]
    assert health == {
        "status": "ok",
        "model": SERVED_MODEL,
        "engine": "fake",
        "compressors": ["bm25", "first-docs", "identity"],
        "retrieval": False,
    }
    labels = {"model": SERVED_MODEL, "arm": "default"}
    assert metric(metrics, "ragspeed_time_to_first_token_seconds_count", **labels) == 1.0
    assert metric(metrics, "ragspeed_time_per_output_token_seconds_count", **labels) == 1.0
    assert metric(metrics, "ragspeed_e2e_request_latency_seconds_count", **labels) == 1.0
    assert metric(metrics, "ragspeed_stage_seconds_count", stage="prompt", **labels) == 1.0
    assert metric(metrics, "ragspeed_generation_tokens_total", **labels) == 5.0
    assert metric(metrics, "ragspeed_prompt_tokens_total", **labels) > 0
    assert metric(metrics, "ragspeed_requests_total", outcome="stop", **labels) == 1.0
    assert metric(metrics, "ragspeed_requests_in_flight", **labels) == 0.0
    # The engine's stats() as gauges.
    assert metric(metrics, "ragspeed_engine_num_blocks_used", model=SERVED_MODEL) == 0.0
    assert metric(metrics, "ragspeed_engine_num_blocks_total", model=SERVED_MODEL) == 256.0
