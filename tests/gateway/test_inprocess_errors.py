"""Errors in-process, over the fake engine: the OpenAI error body (`{"error": {message, type,
param, code}}`) for bad input (400), unknown models (404), an engine still loading or failed
(503), and API keys (401, 403, 429 by request and token rates)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from ragspeed.gateway.security import hash_key
from tests.gateway.inprocess import SERVED_MODEL, fake_settings, metric, serve, wait_for

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "hi"}]
ACME_KEY, GLOBEX_KEY, SLOW_KEY, THRIFTY_KEY, ADMIN_KEY = (
    "rs-acme-key-1",
    "rs-globex-key-2",
    "rs-slow-key-3",
    "rs-thrifty-key-4",
    "rs-admin-key-5",
)


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b'{"messages": [', 400, None),
        (b'{"model": "tiny"}', 400, "messages"),
        (b'{"messages": []}', 400, "messages"),
        (b'{"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 17}', 400, "n"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}', 400, "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}', 400, "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 3}', 400, "temperature"),
        (b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages.0.role"),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "ragspeed": {"unknown": 1}}',
            400,
            "ragspeed.unknown",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "ragspeed": {"compression": {"rate": 1.5}}}',
            400,
            "ragspeed.compression.rate",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [999999]}',
            400,
            "stop_token_ids",
        ),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages.0.content"),
    ],
)
async def test_bad_input_gets_openai_style_error(fake, body, status, param):
    async with serve(fake_settings()) as client:
        response = await client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param and error["message"]
        assert error["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
        assert fake.engine.requests == []  # refused before the engine
        # The server goes on serving.
        assert (await client.get("/healthz")).status_code == 200


async def test_unknown_model_names_the_served_one(fake):
    async with serve(fake_settings()) as client:
        response = await client.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    assert response.json() == {
        "error": {
            "message": f"the model 'gpt-4' does not exist; this server serves '{SERVED_MODEL}'",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


async def test_prompt_longer_than_context_is_refused(fake):
    async with serve(fake_settings()) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "word " * 6000}], "max_tokens": 4},
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    assert error["message"].startswith("prompt (")
    assert error["message"].endswith(
        " tokens) plus max_tokens (4) exceeds the model's context of 4096 tokens"
    )


async def test_unknown_route_is_404_in_the_openai_shape(fake):
    async with serve(fake_settings()) as client:
        response = await client.get("/v1/nothing-here")
    assert response.status_code == 404
    assert response.json() == {
        "error": {"message": "Not Found", "type": "not_found_error", "param": None, "code": None}
    }


async def test_503_while_the_engine_loads_then_ready(fake):
    fake.start_gate = asyncio.Event()
    async with serve(fake_settings(), ready=False) as client:
        health = await client.get("/healthz")
        assert (health.status_code, health.json(), health.headers["retry-after"]) == (
            503,
            {"status": "loading"},
            "2",
        )
        early = await client.post("/v1/chat/completions", json={"messages": HI})
        assert (early.status_code, early.headers["retry-after"]) == (503, "2")
        assert early.json() == {
            "error": {
                "message": "the engine is still loading; retry shortly",
                "type": "service_unavailable",
                "param": None,
                "code": "engine_not_ready",
            }
        }
        fake.start_gate.set()

        async def ready() -> bool:
            return (await client.get("/healthz")).status_code == 200

        await wait_for(ready, "ready")
        assert (await client.post("/v1/chat/completions", json={"messages": HI})).status_code == 200


async def test_503_when_the_engine_failed_to_start(fake):
    fake.start_error = RuntimeError("weights not found")
    async with serve(fake_settings(), ready=False) as client:

        async def settled() -> bool:
            return (await client.get("/healthz")).json()["status"] != "loading"

        await wait_for(settled, "failed")
        health = await client.get("/healthz")
        response = await client.post("/v1/completions", json={"prompt": "hi"})
    assert health.status_code == 503
    assert health.json() == {"status": "failed", "error": "RuntimeError: weights not found"}
    assert response.status_code == 503
    assert response.json()["error"] == {
        "message": "the engine failed to start: RuntimeError: weights not found",
        "type": "service_unavailable",
        "param": None,
        "code": "engine_failed",
    }


# ---------------------------------------------------------------------- API keys


def keyed_settings(**overrides):
    return fake_settings(
        api_keys=[
            f"{hash_key(ACME_KEY)},tenant=acme",
            f"{hash_key(GLOBEX_KEY)},tenant=globex",
            f"{hash_key(SLOW_KEY)},tenant=slow,requests_per_minute=2",
            f"{hash_key(THRIFTY_KEY)},tenant=thrifty,tokens_per_minute=40",
        ],
        admin_key_hashes=[hash_key(ADMIN_KEY)],
        **overrides,
    )


async def _chat(client, key: str | None, **extra):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    body = {"model": SERVED_MODEL, "messages": HI, "max_tokens": 2, "temperature": 0, **extra}
    return await client.post("/v1/chat/completions", json=body, headers=headers)


async def test_missing_or_wrong_key_is_401_without_key_material(fake, caplog):
    with caplog.at_level(logging.DEBUG):
        async with serve(keyed_settings()) as client:
            for key in (None, "rs-wrong-key-zzz", ACME_KEY + "x"):
                response = await _chat(client, key)
                assert response.status_code == 401
                assert response.headers["www-authenticate"] == "Bearer"
                assert response.json() == {
                    "error": {
                        "message": "missing or invalid API key; send 'Authorization: Bearer <key>'",
                        "type": "authentication_error",
                        "param": None,
                        "code": "invalid_api_key",
                    }
                }
            assert (await client.get("/v1/models")).status_code == 401
            basic = await client.get("/v1/models", headers={"Authorization": f"Basic {ACME_KEY}"})
            assert basic.status_code == 401
            # Open without a key: health, metrics and the OpenAPI schema.
            assert (await client.get("/healthz")).status_code == 200
            metrics = await client.get("/metrics")
            assert (await client.get("/openapi.json")).status_code == 200
    assert metrics.status_code == 200
    assert metric(metrics.text, "ragspeed_rejected_requests_total") == 5.0  # counted, by reason
    assert metric(metrics.text, "ragspeed_rejected_requests_total", reason="invalid_api_key") == 5.0
    assert fake.engine.requests == []
    for secret in ("rs-wrong-key-zzz", ACME_KEY, ADMIN_KEY):
        assert secret not in metrics.text
        assert secret not in caplog.text


async def test_valid_keys_pass_and_admin_paths_need_the_admin_key(fake):
    async with serve(keyed_settings()) as client:
        assert (await _chat(client, ACME_KEY)).status_code == 200
        assert (await _chat(client, GLOBEX_KEY, cache_salt="anything")).status_code == 200
        assert (await _chat(client, ADMIN_KEY)).status_code == 200  # admin keys may call everything
        for path in ("/v1/prompts", "/v1/collections/docs", "/v1/experiments"):
            denied = await client.get(path, headers={"Authorization": f"Bearer {ACME_KEY}"})
            assert denied.status_code == 403
            assert denied.json()["error"] == {
                "message": f"{path} needs an admin key",
                "type": "permission_error",
                "param": None,
                "code": "admin_key_required",
            }
            passed = await client.get(path, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert passed.status_code not in (401, 403)
    # A tenant's salt always wins over the client's; the admin has a salt of its own.
    acme, globex, admin = (r.cache_salt for r in fake.engine.requests)
    assert len({acme, globex, admin}) == 3 and globex != "anything"
    assert acme.startswith("tenant-") and globex.startswith("tenant-")


async def test_requests_per_minute_is_429_with_retry_after(fake):
    async with serve(keyed_settings()) as client:
        first, second = await _chat(client, SLOW_KEY), await _chat(client, SLOW_KEY)
        assert (first.status_code, second.status_code) == (200, 200)
        third = await _chat(client, SLOW_KEY)
        assert third.status_code == 429
        assert 1 <= int(third.headers["retry-after"]) <= 30  # 2 a minute: one more in at most 30 s
        error = third.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "requests_per_minute limit of 2" in error["message"]
        assert (await _chat(client, ACME_KEY)).status_code == 200  # other tenants are not affected


async def test_tokens_per_minute_is_429_once_the_budget_is_spent(fake):
    long_message = [
        {"role": "user", "content": "Tell me about prefix caching in paged attention engines. " * 4}
    ]
    async with serve(keyed_settings()) as client:
        first = await _chat(client, THRIFTY_KEY, max_tokens=8, messages=long_message)
        assert first.status_code == 200  # admitted: the budget was not in debt
        spent = first.json()["usage"]["total_tokens"]
        assert spent > 40
        second = await _chat(client, THRIFTY_KEY)
    assert second.status_code == 429
    # The debt is `spent - 40` tokens, repaid at 40/60 a token a second.
    assert 1 <= int(second.headers["retry-after"]) <= (spent - 40) * 60 / 40 + 1
    assert "tokens_per_minute limit of 40" in second.json()["error"]["message"]
