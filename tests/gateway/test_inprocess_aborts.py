"""The aborted-streams check, short form, in CI: a few hundred streams hung up mid-generation
against the real native engine (a tiny Llama) inside the test's event loop; afterwards no
request is left in the engine and every KV block is free. The long form (a thousand streams
against a server process, memory flat) is test_load.py's slow test."""

from __future__ import annotations

import asyncio

import pytest

from ragspeed.gateway.settings import Settings
from tests.gateway.inprocess import hang_up, metric, serve, wait_for

pytestmark = pytest.mark.anyio

NUM_STREAMS = 300
CONCURRENCY = 16
NUM_KV_TOKENS, BLOCK_SIZE = 8192, 16


async def test_hundreds_of_streams_hung_up_mid_generation_free_every_block(tiny_model):
    settings = Settings(
        engine="native",
        model=str(tiny_model),
        served_model_name="tiny",
        max_model_len=512,
        num_kv_cache_tokens=NUM_KV_TOKENS,
        block_size=BLOCK_SIZE,
        num_threads=1,
        prompt_cache_dir=None,
        max_concurrent_requests=CONCURRENCY,
    )
    slots = asyncio.Semaphore(CONCURRENCY)
    statuses: dict[int, int | None] = {}

    async def one(i: int) -> None:
        # Prompts of 1 to 4 blocks, some sharing a prefix (prefix-cache hits on the way), each
        # hung up after 0 to 4 chunks of a generation that would run for 400 tokens.
        body = {
            "prompt": "Once upon a time " * (1 + i % 12) + f"story {i}",
            "stream": True,
            "max_tokens": 400,
            "ignore_eos": True,
            "temperature": 0.8,
            "seed": i,
        }
        async with slots:
            status, _ = await hang_up(client, "/v1/completions", body, after_chunks=i % 5)
        statuses[i] = status

    async with serve(settings) as client:
        await asyncio.gather(*(one(i) for i in range(NUM_STREAMS)))

        async def idle() -> bool:
            text = (await client.get("/metrics")).text
            return (
                metric(text, "ragspeed_engine_num_requests_running") == 0.0
                and metric(text, "ragspeed_engine_num_requests_waiting") == 0.0
            )

        await wait_for(idle, "idle", timeout_s=30)
        metrics = (await client.get("/metrics")).text
        after = await client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})

    # Hung up after 0 chunks: gone before the response started (the request was in the engine).
    assert statuses == {i: None if i % 5 == 0 else 200 for i in range(NUM_STREAMS)}
    assert metric(metrics, "ragspeed_requests_total", outcome="aborted") == NUM_STREAMS
    assert metric(metrics, "ragspeed_engine_num_blocks_total") == NUM_KV_TOKENS // BLOCK_SIZE
    assert metric(metrics, "ragspeed_engine_num_blocks_used") == 0.0
    generated = metric(metrics, "ragspeed_engine_generation_tokens_total")
    assert NUM_STREAMS <= generated < NUM_STREAMS * 400  # every one started, none ran to its end
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2
