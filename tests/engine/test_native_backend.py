"""The async front: streaming, closing and aborting free blocks, warm(), errors, stats."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ragspeed.engine.backends.native import NativeEngine
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.core.detokenizer import IncrementalDetokenizer
from ragspeed.engine.native.core.request import Request
from ragspeed.engine.native.core.sampling import SamplingState
from ragspeed.engine.protocol import EngineClient, GenerationRequest, PromptTooLongError, SamplingParams

PROMPT = tuple(range(10, 50))
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run(coro):
    return asyncio.run(coro)


async def started(path, **overrides) -> NativeEngine:
    kwargs = dict(model=str(path), max_model_len=256, num_kv_cache_tokens=2048, block_size=8)
    engine = NativeEngine(EngineConfig(**{**kwargs, **overrides}))
    await engine.start()
    return engine


async def wait_until_free(engine: NativeEngine) -> None:
    for _ in range(200):
        stats = engine.stats()
        if stats["num_blocks_used"] == 0 and stats["num_requests_running"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks not freed: {engine.stats()}")


def test_streams_the_same_tokens_as_the_sync_engine(tiny_checkpoints):
    async def main():
        engine = await started(tiny_checkpoints["llama"])
        assert isinstance(engine, EngineClient)
        deltas = [d async for d in engine.generate(GenerationRequest("a", PROMPT, GREEDY))]
        expected = engine.engine  # same weights, run synchronously after the stream is done
        await engine.shutdown()
        reference = expected.generate([GenerationRequest("b", PROMPT, GREEDY)])["b"]
        return deltas, reference

    deltas, reference = run(main())
    assert [t for d in deltas for t in d.token_ids] == reference["token_ids"]
    assert "".join(d.text for d in deltas) == reference["text"]
    assert (deltas[0].num_prompt_tokens, deltas[0].num_cached_tokens) == (40, 0)
    assert [d.finish_reason for d in deltas] == [None] * 11 + ["length"]


def test_concurrent_streams_closing_and_abort_free_blocks(tiny_checkpoints):
    async def main():
        engine = await started(tiny_checkpoints["qwen2"])
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

        async def take(request_id: str, n: int):
            stream = engine.generate(GenerationRequest(request_id, PROMPT, long))
            got = [await stream.__anext__() for _ in range(n)]
            await stream.aclose()  # the consumer goes away
            return got

        async def aborted():
            got = []
            async for delta in engine.generate(GenerationRequest("ab", PROMPT, long)):
                got.append(delta)
                if len(got) == 3:
                    await engine.abort("ab")
            return got

        results = await asyncio.gather(take("c1", 2), take("c2", 5), aborted())
        await wait_until_free(engine)
        engine.engine.manager.check_invariants()
        await engine.shutdown()
        return results

    c1, c2, ab = run(main())
    assert (len(c1), len(c2)) == (2, 5)
    assert ab[-1].finish_reason == "abort" and len(ab) < 200


def test_warm_caches_the_prefix_and_requests_reuse_it(tiny_checkpoints):
    async def main():
        engine = await started(tiny_checkpoints["mistral"])
        cached = await engine.warm(PROMPT[:37], cache_salt="t1")
        deltas = [d async for d in engine.generate(GenerationRequest("w", PROMPT, GREEDY, cache_salt="t1"))]
        other_tenant = [
            d async for d in engine.generate(GenerationRequest("o", PROMPT, GREEDY, cache_salt="t2"))
        ]
        stats = engine.stats()
        await engine.shutdown()
        return cached, deltas, other_tenant, stats

    cached, deltas, other, stats = run(main())
    assert cached == 32  # 4 full blocks of 8 of the 37 tokens
    assert deltas[0].num_cached_tokens == 32
    assert other[0].num_cached_tokens == 0
    assert stats["num_blocks_used"] == 0
    assert stats["prefix_cache_hits_tokens"] == 32
    assert stats["prefix_cache_queries_tokens"] == 80  # warm() is not a query


def test_prompt_too_long_is_raised_by_generate(tiny_checkpoints):
    async def main():
        engine = await started(tiny_checkpoints["llama"])
        try:
            with pytest.raises(PromptTooLongError) as err:
                async for _ in engine.generate(
                    GenerationRequest("x", tuple(range(2, 202)), SamplingParams(max_tokens=100))
                ):
                    pass
            return err.value
        finally:
            await engine.shutdown()

    error = run(main())
    assert error.param == "max_tokens" and "256" in error.message


def test_streamed_text_never_splits_a_utf8_character(tiny_checkpoints):
    """Feed the engine's output path the tokens of multi-byte characters one by one."""

    async def main():
        engine = await started(tiny_checkpoints["llama"])
        await engine.shutdown()
        return engine.engine

    core = run(main())
    text = "naïve 東京 😀!"
    token_ids = core.tokenizer.encode(text)
    assert len(token_ids) > len(text) // 2  # byte-level pieces: characters span tokens
    params = SamplingParams(max_tokens=len(token_ids), temperature=0.0, ignore_eos=True)
    request = Request(
        GenerationRequest("u", PROMPT, params),
        SamplingState.create(params, (), "cpu"),
        detokenizer=IncrementalDetokenizer(core.tokenizer, PROMPT),
    )
    core.scheduler.add(request)
    pieces = [core._append_token(request, t).delta.text for t in token_ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert core.manager.num_free_blocks == core.manager.num_blocks


def test_a_request_is_validated_once(tiny_checkpoints):
    """On the event loop before it is queued (a refusal raises at once), not again on the
    engine thread."""

    async def main():
        engine = await started(tiny_checkpoints["llama"])
        calls: list[str] = []
        validate = engine.engine.validate

        def counting(request, **kwargs):
            calls.append(request.request_id)
            return validate(request, **kwargs)

        engine.engine.validate = counting  # type: ignore[method-assign]
        tokens = [
            t async for d in engine.generate(GenerationRequest("a", PROMPT, GREEDY)) for t in d.token_ids
        ]
        await engine.shutdown()
        return tokens, calls

    tokens, calls = run(main())
    assert len(tokens) == 12 and calls == ["a"]


def test_the_engine_thread_builds_the_engine_and_a_failed_build_raises_from_start(
    tiny_checkpoints, monkeypatch
):
    """Its OpenMP team must be the process's only one: built in another thread that stays
    parked (an executor's), torch's team there would make every step's barriers sleep."""
    import ragspeed.engine.backends.native as native

    built_on = []
    build = native.build_llm_engine

    def recording(config):
        built_on.append(threading.current_thread())
        return build(config)

    monkeypatch.setattr(native, "build_llm_engine", recording)

    async def main():
        engine = await started(tiny_checkpoints["llama"])
        try:
            deltas = [d async for d in engine.generate(GenerationRequest("a", PROMPT, GREEDY))]
            return engine._thread, len(deltas)
        finally:
            await engine.shutdown()

    thread, num_deltas = run(main())
    assert built_on == [thread] and thread.name == "ragspeed-engine" and num_deltas == 12

    async def missing():
        await started(tiny_checkpoints["llama"].parent / "no-such-model")

    with pytest.raises(Exception, match="no-such-model"):
        run(missing())
    assert len(built_on) == 2
    built_on[1].join(timeout=10)  # it ends once it has handed the error over
    assert not built_on[1].is_alive()
