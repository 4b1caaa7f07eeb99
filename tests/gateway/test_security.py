"""API keys, tenants and the admin key: units on literal values, and the tenant salt in the pipeline."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from click.testing import CliRunner

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
    settings = load_settings(
        api_keys=[f'{{"hash": "{SECRET_HASH}", "tenant": "globex", "tokens_per_minute": 500}}'],
        admin_key_hashes=[hash_key("root")],
    )
    entry = settings.security.api_keys[0]
    assert entry.tenant == "globex" and entry.tokens_per_minute == 500.0
    with pytest.raises(ConfigError, match="api_keys"):
        load_settings(api_keys=["sha256:abc,tenant=x"])  # not 64 hex digits
    with pytest.raises(ConfigError, match="admin_key_hashes"):
        load_settings(admin_key_hashes=["secret"])  # a key instead of its hash


def test_keyring_authenticates_and_never_names_the_hash():
    ring = KeyRing(
        [
            ApiKeyEntry(hash=hash_key("a"), tenant="acme"),
            ApiKeyEntry(hash=hash_key("b"), tenant="globex", requests_per_minute=6),
        ],
        [hash_key("root")],
    )
    assert ring.enabled
    assert ring.authenticate("a").tenant == "acme"
    assert ring.authenticate("b").requests.capacity == 6.0
    admin = ring.authenticate("root")
    assert admin.is_admin and admin.tenant == "admin"
    assert (
        ring.authenticate("c") is None and ring.authenticate(None) is None and ring.authenticate("") is None
    )
    assert not KeyRing([], []).enabled
    with pytest.raises(ValueError) as error:
        KeyRing(
            [ApiKeyEntry(hash=hash_key("a"), tenant="acme"), ApiKeyEntry(hash=hash_key("a"), tenant="x")], []
        )
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


# The keys over HTTP (401, 403, 429 by rates, nothing secret in /metrics or the logs) are tested
# in-process: test_inprocess_errors.py.


def test_tenant_salt_overrides_the_client_salt(tiny_model):
    """The salt the engine receives is the tenant's, whatever the client sent."""
    import asyncio

    from ragspeed.engine.backends import build_engine
    from ragspeed.gateway.metrics import GatewayMetrics
    from ragspeed.gateway.pipeline import build_pipeline
    from ragspeed.gateway.prompt_registry import PromptService
    from ragspeed.gateway.protocol import CompletionRequest
    from ragspeed.gateway.retrieval_service import RetrievalService
    from ragspeed.gateway.security import _current_principal

    settings = load_settings(engine="transformers", model=str(tiny_model))
    engine = build_engine(settings.engine.config())
    asyncio.run(engine.start())
    pipeline = build_pipeline(
        settings,
        metrics=GatewayMetrics(),
        engine=engine,
        prompts=PromptService(engine, None),
        retrieval=RetrievalService(settings.retrieval),
    )
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
    # Built complete, then never changed: the request's arm and echo are set at construction.
    assert (prepared.arm, prepared.return_prompt) == ("default", False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.arm = "b"  # type: ignore[misc]
