"""API keys, tenants and the admin key: units on literal values, then a real server with keys."""

from __future__ import annotations

import logging

import httpx
import pytest
from click.testing import CliRunner

from ragspeed.bench.launcher import ServerProcess
from ragspeed.bench.load import read_gauge
from ragspeed.gateway.limits import TokenBucket
from ragspeed.gateway.security import (
    ApiKeyEntry,
    KeyRing,
    bearer_key,
    hash_key,
    is_admin_path,
    keys,
    tenant_cache_salt,
    warn_if_exposed,
)
from ragspeed.gateway.settings import ConfigError, load_settings

SECRET_HASH = "sha256:2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"  # "secret"
ACME_KEY, GLOBEX_KEY, SLOW_KEY, THRIFTY_KEY, ADMIN_KEY = (
    "rs-acme-key-1", "rs-globex-key-2", "rs-slow-key-3", "rs-thrifty-key-4", "rs-admin-key-5")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_hash_key_and_cli():
    assert hash_key("secret") == SECRET_HASH
    runner = CliRunner()
    assert runner.invoke(keys, ["hash", "secret"]).output == SECRET_HASH + "\n"
    assert runner.invoke(keys, ["hash", "-"], input="secret\n").output == SECRET_HASH + "\n"
    empty = runner.invoke(keys, ["hash", ""])
    assert empty.exit_code == 2 and "the key is empty" in empty.output
    generated = runner.invoke(keys, ["generate", "--tenant", "acme"]).output.splitlines()
    key = generated[0].removeprefix("key:  ")
    assert generated[1] == f"hash: {hash_key(key)}" and "tenant: 'acme'" in generated[2]


def test_api_key_entries_from_strings_and_settings():
    entry = ApiKeyEntry.model_validate(f"{SECRET_HASH},tenant=acme,requests_per_minute=60")
    assert (entry.tenant, entry.requests_per_minute, entry.tokens_per_minute) == ("acme", 60.0, None)
    settings = load_settings(api_keys=[f'{{"hash": "{SECRET_HASH}", "tenant": "globex", "tokens_per_minute": 500}}'],
                             admin_key_hashes=[hash_key("root")])
    assert settings.api_keys[0].tenant == "globex" and settings.api_keys[0].tokens_per_minute == 500.0
    with pytest.raises(ConfigError, match="api_keys"):
        load_settings(api_keys=["sha256:abc,tenant=x"])  # not 64 hex digits
    with pytest.raises(ConfigError, match="admin_key_hashes"):
        load_settings(admin_key_hashes=["secret"])  # a key instead of its hash


def test_keyring_authenticates_and_never_names_the_hash():
    ring = KeyRing([ApiKeyEntry(hash=hash_key("a"), tenant="acme"),
                    ApiKeyEntry(hash=hash_key("b"), tenant="globex", requests_per_minute=6)],
                   [hash_key("root")])
    assert ring.enabled
    assert ring.authenticate("a").tenant == "acme"
    assert ring.authenticate("b").requests.capacity == 6.0
    admin = ring.authenticate("root")
    assert admin.is_admin and admin.tenant == "admin"
    assert ring.authenticate("c") is None and ring.authenticate(None) is None and ring.authenticate("") is None
    assert not KeyRing([], []).enabled
    with pytest.raises(ValueError) as error:
        KeyRing([ApiKeyEntry(hash=hash_key("a"), tenant="acme"), ApiKeyEntry(hash=hash_key("a"), tenant="x")], [])
    assert str(error.value) == "an API key of tenant 'x' is configured twice"


def test_bearer_and_admin_paths():
    assert bearer_key("Bearer abc") == "abc" and bearer_key("bearer  abc ") == "abc"
    assert bearer_key("Basic abc") is None and bearer_key("Bearer") is None and bearer_key(None) is None
    assert is_admin_path("/v1/prompts") and is_admin_path("/v1/collections/docs/search")
    assert not is_admin_path("/v1/promptsX") and not is_admin_path("/v1/chat/completions")


def test_tenant_salts_differ_and_are_stable():
    assert tenant_cache_salt("acme") == tenant_cache_salt("acme")
    assert tenant_cache_salt("acme") != tenant_cache_salt("globex")
    assert tenant_cache_salt("acme").startswith("tenant-") and len(tenant_cache_salt("acme")) == 39


def test_token_bucket_literal_values():
    clock = FakeClock()
    bucket = TokenBucket(60, clock)  # one a second, burst of 60
    assert [bucket.try_take() for _ in range(60)] == [0.0] * 60
    assert bucket.try_take() == 1.0  # empty: the next unit is one second away
    clock.now += 0.5
    assert bucket.try_take() == 0.5
    clock.now += 0.5
    assert bucket.try_take() == 0.0
    bucket.charge(30)  # into debt
    assert bucket.level == -30.0 and bucket.wait_s() == pytest.approx(30.0)
    clock.now += 1000
    assert bucket.level == -30.0 and bucket.wait_s() == 0.0 and bucket.level == 60.0  # capped at capacity
    with pytest.raises(ValueError, match="per_minute"):
        TokenBucket(0)


def test_loud_warning_beyond_loopback(caplog):
    logger = logging.getLogger("test.security")
    with caplog.at_level(logging.WARNING, logger="test.security"):
        assert warn_if_exposed("0.0.0.0", KeyRing([], []), logger)
        assert not warn_if_exposed("127.0.0.1", KeyRing([], []), logger)
        assert not warn_if_exposed("::1", KeyRing([], []), logger)
        assert not warn_if_exposed("localhost", KeyRing([], []), logger)
        assert not warn_if_exposed("0.0.0.0", KeyRing([], [hash_key("root")]), logger)
    assert len(caplog.records) == 1 and "NO API KEYS" in caplog.records[0].getMessage()


# ---------------------------------------------------------------------- a real server with keys


@pytest.fixture(scope="module")
def keyed_server(tiny_model):
    args = ["--engine", "transformers", "--model", str(tiny_model), "--served-model-name", "tiny",
            "--api-keys", f"{hash_key(ACME_KEY)},tenant=acme",
            "--api-keys", f"{hash_key(GLOBEX_KEY)},tenant=globex",
            "--api-keys", f"{hash_key(SLOW_KEY)},tenant=slow,requests_per_minute=2",
            "--api-keys", f"{hash_key(THRIFTY_KEY)},tenant=thrifty,tokens_per_minute=40",
            "--admin-key-hashes", hash_key(ADMIN_KEY)]
    with ServerProcess(args) as server:
        yield server


def _chat(server, key: str | None, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "temperature": 0, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_missing_or_wrong_key_is_401_without_key_material(keyed_server):
    for key in (None, "rs-wrong-key-zzz", ACME_KEY + "x"):
        response = _chat(keyed_server, key)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json() == {"error": {
            "message": "missing or invalid API key; send 'Authorization: Bearer <key>'",
            "type": "authentication_error", "param": None, "code": "invalid_api_key"}}
    assert httpx.get(f"{keyed_server.url}/v1/models", timeout=10).status_code == 401
    basic = httpx.get(f"{keyed_server.url}/v1/models", headers={"Authorization": f"Basic {ACME_KEY}"}, timeout=10)
    assert basic.status_code == 401
    # Open without a key: health, metrics and the OpenAPI schema.
    assert httpx.get(f"{keyed_server.url}/healthz", timeout=10).status_code == 200
    metrics = httpx.get(f"{keyed_server.url}/metrics", timeout=10)
    assert metrics.status_code == 200
    assert read_gauge(metrics.text, "ragspeed_rejected_requests_total") == 5.0  # counted, by reason
    assert 'ragspeed_rejected_requests_total{reason="invalid_api_key"} 5.0' in metrics.text
    assert httpx.get(f"{keyed_server.url}/openapi.json", timeout=10).status_code == 200
    for secret in ("rs-wrong-key-zzz", ACME_KEY, ADMIN_KEY):
        assert secret not in metrics.text
        assert secret not in keyed_server.log_tail(1_000_000)


def test_valid_keys_pass_and_admin_paths_need_the_admin_key(keyed_server):
    assert _chat(keyed_server, ACME_KEY).status_code == 200
    assert _chat(keyed_server, GLOBEX_KEY, cache_salt="anything").status_code == 200
    assert _chat(keyed_server, ADMIN_KEY).status_code == 200  # admin keys may call everything
    for path in ("/v1/prompts", "/v1/collections/docs", "/v1/experiments"):
        denied = httpx.get(f"{keyed_server.url}{path}", headers={"Authorization": f"Bearer {ACME_KEY}"}, timeout=10)
        assert denied.status_code == 403
        assert denied.json()["error"] == {"message": f"{path} needs an admin key", "type": "permission_error",
                                          "param": None, "code": "admin_key_required"}
        # The admin key passes auth (the admin endpoints themselves land later: 404 until then).
        passed = httpx.get(f"{keyed_server.url}{path}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
        assert passed.status_code != 403 and passed.status_code != 401


def test_requests_per_minute_is_429_with_retry_after(keyed_server):
    first, second = _chat(keyed_server, SLOW_KEY), _chat(keyed_server, SLOW_KEY)
    assert (first.status_code, second.status_code) == (200, 200)
    third = _chat(keyed_server, SLOW_KEY)
    assert third.status_code == 429
    assert 1 <= int(third.headers["retry-after"]) <= 30  # 2 a minute: one more in at most 30 s
    error = third.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert "requests_per_minute limit of 2" in error["message"]
    assert _chat(keyed_server, ACME_KEY).status_code == 200  # other tenants are not affected


def test_tokens_per_minute_is_429_once_the_budget_is_spent(keyed_server):
    long_message = [{"role": "user", "content": "Tell me about prefix caching in paged attention engines. " * 4}]
    first = _chat(keyed_server, THRIFTY_KEY, max_tokens=8, messages=long_message)
    assert first.status_code == 200  # admitted: the budget was not in debt
    spent = first.json()["usage"]["total_tokens"]
    assert spent > 40
    second = _chat(keyed_server, THRIFTY_KEY)
    assert second.status_code == 429
    # The debt is `spent - 40` tokens, repaid at 40/60 a token a second.
    assert 1 <= int(second.headers["retry-after"]) <= (spent - 40) * 60 / 40 + 1
    assert "tokens_per_minute limit of 40" in second.json()["error"]["message"]


def test_tenant_salt_overrides_the_client_salt(tiny_model):
    """The salt the engine receives is the tenant's, whatever the client sent."""
    import asyncio

    from ragspeed.engine.backends import build_engine
    from ragspeed.gateway.metrics import GatewayMetrics
    from ragspeed.gateway.pipeline import Pipeline
    from ragspeed.gateway.protocol import CompletionRequest
    from ragspeed.gateway.security import _current_principal

    settings = load_settings(engine="transformers", model=str(tiny_model))
    engine = build_engine(settings.engine_config())
    asyncio.run(engine.start())
    pipeline = Pipeline(settings=settings, engine=engine, metrics=GatewayMetrics())
    request = CompletionRequest(prompt="hello there", max_tokens=2, cache_salt="steal-globex")
    assert pipeline.prepare_completion(request).generation.cache_salt == "steal-globex"  # auth off
    ring = KeyRing([ApiKeyEntry(hash=hash_key("a"), tenant="acme")], [])
    token = _current_principal.set(ring.authenticate("a"))
    try:
        prepared = pipeline.prepare_completion(request)
    finally:
        _current_principal.reset(token)
    assert prepared.generation.cache_salt == tenant_cache_salt("acme")
    assert prepared.principal.tenant == "acme"
