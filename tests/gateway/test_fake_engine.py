"""The fake engine keeps the protocol the in-process tests rely on: deltas as scripted, KV blocks
held while a request runs and freed however it ends, aborts recorded."""

from __future__ import annotations

import asyncio

import pytest

from ragspeed.engine.backends import build_engine
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.protocol import EngineClient, EngineError, GenerationRequest, SamplingParams
from tests.gateway.fake_engine import Reply, Stall, install

pytestmark = pytest.mark.anyio


def request(request_id: str, num_prompt: int = 20, max_tokens: int = 16) -> GenerationRequest:
    return GenerationRequest(request_id, tuple(range(num_prompt)), SamplingParams(max_tokens=max_tokens))


@pytest.fixture
async def engine(monkeypatch, demo_tokenizer):
    backend = install(monkeypatch, demo_tokenizer)
    engine = build_engine(EngineConfig(backend="fake", block_size=8, num_kv_cache_tokens=64))
    await engine.start()
    assert backend.engines == [engine]
    return engine


async def test_deltas_blocks_and_finish(engine):
    assert isinstance(engine, EngineClient)
    held = []
    async for delta in engine.generate(request("r1", num_prompt=20)):
        held.append(engine.stats()["num_blocks_used"])
        last = delta
    assert held == [3.0, 3.0, 3.0, 3.0, 4.0]  # ceil((20 + n) / 8) for n = 1..5
    assert (last.finish_reason, last.num_prompt_tokens) == ("stop", 20)
    assert engine.stats() == {
        "num_blocks_total": 8.0,
        "num_blocks_used": 0.0,
        "num_blocks_free": 8.0,
        "num_requests_running": 0.0,
    }
    assert (engine.finished, engine.aborted) == (["r1"], [])


async def test_closing_early_failing_and_a_full_pool_free_everything(engine):
    stream = engine.generate(request("closed"))
    await anext(stream)
    await stream.aclose()
    engine.script(Reply(error=EngineError("boom"), error_at=1))
    with pytest.raises(EngineError, match="boom"):
        [d async for d in engine.generate(request("failed"))]
    with pytest.raises(EngineError, match="fake KV pool of 8 blocks is full"):
        [d async for d in engine.generate(request("huge", num_prompt=65))]
    assert engine.aborted == ["closed"]
    assert engine.stats()["num_blocks_used"] == 0.0


async def test_abort_ends_a_stalled_request_with_abort(engine):
    stall = Stall(at=1)
    engine.script(Reply(stall=stall))

    async def run():
        return [d.finish_reason async for d in engine.generate(request("held"))]

    task = asyncio.create_task(run())
    await stall.reached.wait()
    assert engine.stats()["num_requests_running"] == 1.0
    await engine.abort("held")
    assert await task == [None, "abort"]
    assert engine.aborted == ["held"] and engine.stats()["num_blocks_used"] == 0.0
