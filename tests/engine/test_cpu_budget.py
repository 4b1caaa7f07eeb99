"""One CPU budget: helper jobs beside the native engine take threads the engine gives up, and
the process never runs more than `num_threads` busy threads (no model: the budget alone, then
the native backend on the tiny model)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from ragspeed.engine.backends.native import CpuBudget, NativeEngine
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.protocol import GenerationRequest, SamplingParams


def test_a_job_takes_a_thread_from_the_next_step():
    budget = CpuBudget(2)
    assert budget.step_threads() == 2
    budget.end_step()
    with budget.lend(1):
        assert budget.step_threads() == 1
        budget.end_step()
    assert budget.step_threads() == 2
    budget.end_step()


def test_a_job_waits_for_the_step_in_flight_to_end():
    budget = CpuBudget(2)
    assert budget.step_threads() == 2  # a step on both threads is in flight
    entered = threading.Event()

    def job():
        with budget.lend(1):
            entered.set()

    worker = threading.Thread(target=job)
    worker.start()
    assert not entered.wait(0.05)  # 2 + 1 threads would be busy
    budget.end_step()
    assert entered.wait(5)
    worker.join()


def test_with_one_thread_in_all_the_engine_pauses_while_a_job_runs():
    budget = CpuBudget(1)
    stepped = threading.Event()
    with budget.lend(1):

        def step():
            budget.step_threads()
            stepped.set()
            budget.end_step()

        engine_thread = threading.Thread(target=step)
        engine_thread.start()
        assert not stepped.wait(0.05)
    assert stepped.wait(5)
    engine_thread.join()


def test_jobs_leave_the_engine_a_thread_and_wait_their_turn():
    budget = CpuBudget(2)
    with pytest.raises(ValueError, match="1 to 1 threads"):
        with budget.lend(2):
            pass
    order: list[str] = []
    with budget.lend(1):

        def job():
            with budget.lend(1):
                order.append("second")

        second = threading.Thread(target=job)
        second.start()
        time.sleep(0.05)
        assert order == []  # jobs hold at most num_threads - 1
        order.append("first")
    second.join(5)
    assert order == ["first", "second"]


def test_run_beside_runs_on_one_thread_and_the_engine_steps_on_the_rest(tiny_checkpoints):
    config = EngineConfig(
        model=str(tiny_checkpoints["llama"]),
        max_model_len=256,
        num_kv_cache_tokens=2048,
        block_size=8,
        dtype="float32",
        num_threads=2,
    )
    seen: list[int] = []

    async def main():
        engine = NativeEngine(config)
        await engine.start()
        step = engine.engine.step

        def recorded_step():
            seen.append(engine.engine.num_threads)
            return step()

        engine.engine.step = recorded_step
        started, release = threading.Event(), threading.Event()

        def job():
            started.set()
            release.wait(10)
            return torch.get_num_threads()

        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        request = GenerationRequest("r", tuple(range(10, 40)), params)

        async def stream():
            return [d async for d in engine.generate(request)]

        streaming = asyncio.create_task(stream())
        while len(seen) < 2:  # the stream steps on both threads before the job
            await asyncio.sleep(0.001)
        beside = asyncio.create_task(engine.run_beside(job))
        await asyncio.to_thread(started.wait, 10)
        num_steps = len(seen)
        while len(seen) < num_steps + 3 and not streaming.done():  # steps on beside the job
            await asyncio.sleep(0.001)
        release.set()
        job_threads = await beside
        deltas = await streaming
        await engine.shutdown()
        return job_threads, deltas, num_steps

    job_threads, deltas, num_steps = asyncio.run(main())
    assert job_threads == 1
    assert deltas[-1].finish_reason == "length"
    assert seen[0] == 2
    assert len(seen) >= num_steps + 3
    assert set(seen[num_steps : num_steps + 3]) == {1}  # while the job holds its thread
