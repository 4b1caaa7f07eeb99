"""Admission on a real server (uvicorn on a socket, in a thread of the test process) over a slow
fake engine: one prefill at a time, 1 ms a prompt token, so a request of 1,000 tokens takes 1 s
alone against a TTFT deadline of 0.5 s, as a 20-document request does on a slow CPU against the
default 10 s. Such a request is served alone and one after another; of a burst, the first is
served and the rest are refused for load (429 with Retry-After); a request past the configured
size limit (`max_prompt_tokens`) gets the 400 that names it."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from ragspeed.engine.backends import BACKENDS
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.protocol import GenerationRequest, TokenDelta
from ragspeed.gateway.app import create_app
from tests.gateway.fake_engine import FakeBackend, FakeEngine
from tests.gateway.inprocess import fake_settings

SECONDS_PER_TOKEN = 0.001
DEADLINE_MS = 500
MAX_PROMPT_TOKENS = 1500
BURST = 6


class SlowEngine(FakeEngine):
    """The fake engine behind a first-come first-served prefill of `SECONDS_PER_TOKEN` a prompt
    token, which it estimates as the native engine does (so the app times it at start-up)."""

    def __init__(self, config: EngineConfig, backend: FakeBackend):
        super().__init__(config, backend)
        self._prefill = asyncio.Lock()

    def estimate_new_tokens(self, request: GenerationRequest) -> int:
        return len(request.prompt_token_ids)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        async with self._prefill:
            await asyncio.sleep(SECONDS_PER_TOKEN * len(request.prompt_token_ids))
        async for delta in super().generate(request):
            yield delta


class SlowBackend(FakeBackend):
    def build(self, config: EngineConfig) -> FakeEngine:
        engine = SlowEngine(config, self)
        self.engines.append(engine)
        return engine


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def server_url(monkeypatch, demo_tokenizer) -> Iterator[str]:
    """A server of backend "slow" on a free port, ready (its start-up calibration done)."""
    backend = SlowBackend(demo_tokenizer)
    monkeypatch.setattr(sys.modules[__name__], "build_slow", backend.build, raising=False)
    monkeypatch.setitem(BACKENDS, "slow", f"{__name__}:build_slow")
    settings = fake_settings(engine="slow", ttft_deadline_ms=DEADLINE_MS, max_prompt_tokens=MAX_PROMPT_TOKENS)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server was not ready after 60 s"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def body(num_tokens: int) -> dict[str, Any]:
    """A chat request of about `num_tokens` prompt tokens (the demo tokenizer: 2 a "sky ")."""
    return {"messages": [{"role": "user", "content": "sky " * (num_tokens // 2)}], "max_tokens": 2}


async def post(client: httpx.AsyncClient, num_tokens: int) -> httpx.Response:
    return await client.post("/v1/chat/completions", json=body(num_tokens))


def test_a_request_that_misses_its_deadline_alone_is_served_and_only_load_is_refused(server_url):
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server_url, timeout=60) as client:
            lone = await post(client, 1000)
            assert lone.status_code == 200, lone.text
            assert lone.json()["ragspeed"]["predicted_ttft_ms"] > DEADLINE_MS  # late, and served
            for _ in range(2):  # one after the other: nothing ahead of either
                assert (await post(client, 1000)).status_code == 200
            burst = await asyncio.gather(*(post(client, 1000) for _ in range(BURST)))
            statuses = sorted(r.status_code for r in burst)
            assert statuses[0] == 200 and statuses[-1] == 429 and set(statuses) == {200, 429}, statuses
            for refused in (r for r in burst if r.status_code == 429):
                assert refused.json()["error"]["code"] == "ttft_deadline"
                assert "work queued ahead" in refused.json()["error"]["message"]
                assert int(refused.headers["retry-after"]) >= 1
            too_large = await post(client, 2000)
            assert too_large.status_code == 400 and too_large.json()["error"]["code"] == "prompt_too_long"
            assert (
                f"the limit is {MAX_PROMPT_TOKENS} (max_prompt_tokens)"
                in too_large.json()["error"]["message"]
            )
            assert (await post(client, 1000)).status_code == 200  # the burst's work is done

    asyncio.run(scenario())
