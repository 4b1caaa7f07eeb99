"""`PrefixCacheControl`: the native engine pins, exports and restores exact blocks; the other
backends have none."""

from __future__ import annotations

import asyncio

import torch

from ragspeed.engine.backends.native import NativeEngine
from ragspeed.engine.backends.remote.openai_backend import OpenAIEngine
from ragspeed.engine.backends.transformers_backend import TransformersEngine
from ragspeed.engine.config import EngineConfig, UpstreamConfig
from ragspeed.engine.protocol import GenerationRequest, PrefixCacheControl, SamplingParams

PREFIX = tuple(range(10, 47))  # 37 tokens: 4 full blocks of 8


def _config(path, **overrides) -> EngineConfig:
    kwargs = dict(model=str(path), max_model_len=256, num_kv_cache_tokens=2048, block_size=8)
    return EngineConfig(**{**kwargs, **overrides})


async def _cached_tokens(engine: NativeEngine, prompt: tuple[int, ...]) -> int:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    deltas = [d async for d in engine.generate(GenerationRequest("probe", prompt, params))]
    return deltas[0].num_cached_tokens


def test_native_pins_exports_and_restores_exact_blocks(tiny_checkpoints):
    async def main():
        source = NativeEngine(_config(tiny_checkpoints["llama"]))
        await source.start()
        cache = source.prefix_cache()
        assert isinstance(cache, PrefixCacheControl)
        fingerprint = await cache.fingerprint()
        pinned = await cache.pin(PREFIX, None)
        used_after_pin = source.stats()["num_blocks_used"]
        kv = await cache.export(pinned)
        expected = source.engine.kv_pool.kv[:, :, list(pinned)].clone()
        await cache.unpin(pinned)
        used_after_unpin = source.stats()["num_blocks_used"]
        await source.shutdown()

        target = NativeEngine(_config(tiny_checkpoints["llama"]))
        await target.start()
        restore = target.prefix_cache()
        same_fingerprint = await restore.fingerprint() == fingerprint
        restored = await restore.restore(PREFIX, kv, None)
        used_after_restore = target.stats()["num_blocks_used"]
        pool = target.engine.kv_pool.kv[:, :, list(restored)].clone()
        cached = await _cached_tokens(target, PREFIX + (60, 61))
        salted = await restore.restore(PREFIX, kv, "tenant-a")  # another salt: other blocks
        await restore.unpin(restored)
        await restore.unpin(salted)
        used_at_end = target.stats()["num_blocks_used"]
        await target.shutdown()
        return (
            pinned,
            used_after_pin,
            kv,
            expected,
            used_after_unpin,
            same_fingerprint,
            restored,
            used_after_restore,
            pool,
            cached,
            salted,
            used_at_end,
        )

    (
        pinned,
        used_after_pin,
        kv,
        expected,
        used_after_unpin,
        same_fingerprint,
        restored,
        used_after_restore,
        pool,
        cached,
        salted,
        used_at_end,
    ) = asyncio.run(main())
    # warm() took blocks 0..4 for 37 tokens; the 4 full ones are cached and pinned.
    assert pinned == (0, 1, 2, 3)
    assert used_after_pin == 4 and used_after_unpin == 0
    assert tuple(kv.shape[2:4]) == (4, 8)  # [2, layers, blocks, block_size, kv heads, head dim]
    assert torch.equal(kv, expected)
    assert same_fingerprint
    assert restored == (0, 1, 2, 3) and used_after_restore == 4
    assert torch.equal(pool, kv)
    assert cached == 32  # the restored blocks are hits
    # The probe took 0..4 and gave block 4 back (tail first), so the salted copy takes the
    # free list's head: blocks 5..8.
    assert salted == (5, 6, 7, 8)
    assert used_at_end == 0


def test_restore_while_the_pool_is_short_answers_none(tiny_checkpoints):
    async def main():
        engine = NativeEngine(
            _config(tiny_checkpoints["llama"], max_model_len=40, num_kv_cache_tokens=40)
        )  # 5 blocks
        await engine.start()
        cache = engine.prefix_cache()
        try:
            other = await cache.pin(tuple(range(100, 117)), None)  # 2 full blocks held
            shape = list(engine.engine.kv_pool.kv.shape)
            kv = torch.zeros(
                *shape[:2], 4, *shape[3:], dtype=engine.engine.kv_pool.kv.dtype
            )  # 4 blocks, 3 left
            return other, await cache.restore(PREFIX, kv, None), engine.stats()["num_blocks_used"]
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == ((0, 1), None, 2)


def test_pin_is_one_command_and_a_cancelled_pin_holds_nothing(tiny_checkpoints):
    async def main():
        engine = NativeEngine(_config(tiny_checkpoints["llama"]))
        await engine.start()
        cache = engine.prefix_cache()
        try:
            calls = []  # engine-thread calls besides the pinning prefill: none
            call = engine.call
            engine.call = lambda fn: (calls.append(fn), call(fn))[1]
            pinned = await cache.pin(PREFIX, None)
            engine.call = call
            await cache.unpin(pinned)
            # Cancelled at any point of its prefill, a pin leaves no block held.
            held = []
            for delay in (0.0, 0.001, 0.005, 0.02):
                task = asyncio.create_task(cache.pin(tuple(range(200, 300)), None))
                await asyncio.sleep(delay)
                task.cancel()
                result = await asyncio.gather(task, return_exceptions=True)
                if not isinstance(result[0], asyncio.CancelledError):
                    await cache.unpin(result[0])  # it finished before the cancel
                await asyncio.sleep(0.05)
                held.append(engine.stats()["num_blocks_used"])
            return calls, pinned, held
        finally:
            await engine.shutdown()

    calls, pinned, held = asyncio.run(main())
    assert calls == [] and pinned == (0, 1, 2, 3)
    assert held == [0, 0, 0, 0]


def test_backends_without_a_pinnable_cache_have_no_control(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    assert NativeEngine(_config(path, enable_prefix_caching=False)).prefix_cache() is None
    assert TransformersEngine(_config(path, backend="transformers")).prefix_cache() is None
    remote = OpenAIEngine(_config(path, backend="openai"), UpstreamConfig(urls=("http://127.0.0.1:9",)))
    assert remote.prefix_cache() is None
