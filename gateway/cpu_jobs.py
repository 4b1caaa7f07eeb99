"""The gateway's CPU jobs (compression, retrieval's embedding), off the event loop.

Beside a native engine a job runs on a CPU thread that the engine gives up while it runs
(engine.backends.native.CpuBudget), so that the process keeps to `num_threads` busy threads,
and on one torch thread, so that it starts no OpenMP team beside the engine thread's (a second
team slows every step: engine.backends.native.NativeEngine._build_and_run). Beside any other
engine, in a plain worker thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class CpuJobs:
    engine: Any  # the server's engine (an EngineClient); its `run_beside`, where it has one

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        run_beside = getattr(self.engine, "run_beside", None)
        if run_beside is None:
            return await asyncio.to_thread(fn, *args)
        return await run_beside(fn, *args)
