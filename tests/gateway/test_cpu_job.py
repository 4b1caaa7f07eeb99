"""The pipeline's CPU jobs (compression, retrieval embedding) go through the engine's CPU
budget when it has one (the native engine's `run_beside`), else a plain worker thread."""

from __future__ import annotations

import asyncio
import threading

from ragspeed.gateway.cpu_jobs import CpuJobs


class _Engine:
    def __init__(self) -> None:
        self.jobs: list[tuple] = []

    async def run_beside(self, fn, *args):
        self.jobs.append(args)
        return await asyncio.to_thread(fn, *args)


def _preparer(engine) -> CpuJobs:
    return CpuJobs(engine)


def test_a_cpu_job_runs_beside_the_engine_when_it_has_a_budget():
    engine = _Engine()
    result = asyncio.run(_preparer(engine).run(lambda a, b: a + b, 2, 3))
    assert result == 5
    assert engine.jobs == [(2, 3)]


def test_without_a_budget_a_cpu_job_runs_in_a_worker_thread():
    main = threading.get_ident()
    result = asyncio.run(_preparer(object()).run(lambda: threading.get_ident() != main))
    assert result is True
