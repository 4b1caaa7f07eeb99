"""The native engine behind `EngineClient`: an asyncio front over `LLMEngine` on a thread.

The engine thread owns the `LLMEngine` (model, KV pool, scheduler, block manager); nothing else
touches them. The event loop talks to it through a command queue (add, abort, stop) and gets
deltas back through `loop.call_soon_threadsafe` into one asyncio queue per request. The thread
drains the commands before every step, so an abort (or a consumer closing its stream) frees the
request's blocks within one step. Torch releases the GIL in its kernels, so the event loop stays
responsive while a step runs.

One CPU budget: the process runs at most `num_threads` busy threads (EngineConfig.num_threads).
A helper job beside the engine (compression, retrieval embedding: `run_beside`) takes one of
them from the `CpuBudget` and runs on one torch thread; the engine's next steps run on what is
left, and the job waits for the step in flight to end first. With one thread in all, the engine
pauses while a job holds it. Measured on 2 cores (Zen 3, the default model): the coarse-to-fine
compressor of 20 documents takes as long on one thread as on two (p50 73 vs 78 ms), so lending
it one costs it nothing, while the decode steps on the thread left run about 1.3x slower for
the few tokens it lasts. Running it on the engine thread between steps instead would stall every
stream for the whole compression (~80 ms, over the 50 ms step budget) unless the compressors
were cut into slices.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.compute.threads import cpu_threads
from ragspeed.engine.native.core.factory import build_llm_engine
from ragspeed.engine.native.core.llm_engine import LLMEngine, StepOutput
from ragspeed.engine.native.core.prefix_store import (
    engine_fingerprint,
    export_kv,
    restore_prefix,
    unpin_prefix,
)
from ragspeed.engine.protocol import (
    DocumentReuse,
    EngineError,
    GenerationRequest,
    PrefixCacheControl,
    SamplingParams,
    TokenDelta,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class _Add:
    request: GenerationRequest
    sink: asyncio.Queue
    prefill_only: bool = False
    pin: bool = False  # with prefill_only: pin the full blocks as the prefill finishes


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    """Run `fn(llm_engine)` on the engine thread (block manager and KV pool are its alone)."""

    fn: Any
    future: asyncio.Future


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


_STOP = object()


class CpuBudget:
    """`num_threads` CPU threads shared by the engine's steps and helper jobs (thread-safe).

    The engine thread asks `step_threads()` before each step (all threads not held by a job,
    at least one; it waits while jobs hold them all) and calls `end_step()` after it. A job
    holds threads through `lend(n)`, which waits until they are free of the step in flight;
    jobs together hold at most `num_threads - 1` of them (all, with one thread in all), and a
    waiting job is served before the engine's next step, so neither side starves."""

    def __init__(self, num_threads: int):
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.num_threads = num_threads
        self.max_lent = max(num_threads - 1, 1)
        self._cond = threading.Condition()
        self._lent = 0  # threads held by jobs
        self._wanted = 0  # threads asked for by jobs waiting in `lend`
        self._stepping = 0  # threads of the engine's step in flight (0: none)

    @property
    def num_lent(self) -> int:
        return self._lent

    def step_threads(self) -> int:
        with self._cond:
            while self.num_threads - self._lent - self._wanted < 1:
                self._cond.wait()
            self._stepping = self.num_threads - self._lent - self._wanted
            return self._stepping

    def end_step(self) -> None:
        with self._cond:
            self._stepping = 0
            self._cond.notify_all()

    @contextlib.contextmanager
    def lend(self, num_threads: int = 1):
        if not 1 <= num_threads <= self.max_lent:
            raise ValueError(f"a job may hold 1 to {self.max_lent} threads, asked {num_threads}")
        with self._cond:
            self._wanted += num_threads
            try:
                while (
                    self._lent + num_threads > self.max_lent
                    or self._stepping + self._lent + num_threads > self.num_threads
                ):
                    self._cond.wait()
            finally:
                self._wanted -= num_threads
            self._lent += num_threads
        try:
            yield
        finally:
            with self._cond:
                self._lent -= num_threads
                self._cond.notify_all()


async def _final_delta(sink: asyncio.Queue) -> TokenDelta:
    """The final delta a prefill-only request's sink receives (an error put there raises)."""
    while True:
        item = await sink.get()
        if isinstance(item, BaseException):
            raise item
        if item.finish_reason is not None:
            return item


class NativeEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_name = config.model
        self.max_model_len = config.max_model_len or 0
        self._engine: LLMEngine | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, asyncio.Queue] = {}  # touched by the engine thread only
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._warm_ids = itertools.count()
        self.cpu_budget: CpuBudget | None = None  # built with the engine (its thread count)
        self._started = threading.Event()  # set by start() once the engine thread may step

    # ------------------------------------------------------------------ lifecycle

    @property
    def tokenizer(self) -> Any:
        return None if self._engine is None else self._engine.tokenizer

    @property
    def weights(self) -> dict[str, Any] | None:
        """The engine's weights and the paths that read them (LLMEngine.weights); None before start."""
        return None if self._engine is None else self._engine.weights

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise EngineError("the native engine is not started", code="engine_not_ready")
        return self._engine

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        built: asyncio.Future = self._loop.create_future()
        self._engine = None
        self._started.clear()
        thread = threading.Thread(
            target=self._build_and_run, args=(built,), name="ragspeed-engine", daemon=True
        )
        thread.start()
        try:
            self._engine = await built
        except BaseException:  # the build failed, or start was cancelled: the thread ends once built
            self._started.set()
            raise
        self._thread = thread
        self.cpu_budget = CpuBudget(self._engine.num_threads)
        # The Rust tokenizers' batch encoding (the compressors' and embedders' tokenizers) runs
        # on a pool of one thread per core of its own, outside the budget; an operator's
        # explicit setting wins.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.max_model_len = self._engine.max_model_len
        self._started.set()

    def _build_and_run(self, built: asyncio.Future) -> None:
        """The engine thread: build the engine (its weights, start-up gate and the grammar
        library's table of the tokenizer, about half a second), hand it to `start`, then run.

        The engine thread builds it so that its OpenMP team is the process's only one. libgomp
        spins at a barrier only while the process's OpenMP threads do not outnumber the cores;
        a team left parked by another thread that ran torch on several threads (an executor's
        thread that built the engine) turns every barrier of a step into a sleep and a wake-up,
        which made the default model's decode steps about 1.6x slower on 2 cores."""
        assert self._loop is not None  # set by start(), before this thread
        try:
            engine = build_llm_engine(self.config)
            engine.grammars.warm()
        except BaseException as exc:
            self._loop.call_soon_threadsafe(_settle, built, None, exc)
            return
        self._loop.call_soon_threadsafe(_settle, built, engine, None)
        self._started.wait()  # `start` sets the CPU budget the steps ask
        if self._engine is not None:
            self._run()

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    # ------------------------------------------------------------------ engine thread

    def _deliver(self, out: StepOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return
        if out.delta.finish_reason is not None:
            del self._sinks[out.request_id]
        assert self._loop is not None  # set by start(), before the engine thread
        self._loop.call_soon_threadsafe(sink.put_nowait, out.delta)

    def _handle(self, command: Any) -> bool:
        """Apply one command; False on stop."""
        engine = self.engine
        assert self._loop is not None  # set by start(), before the engine thread
        if command is _STOP:
            return False
        if isinstance(command, _Add):
            try:
                # `generate` and `_prefill_only` validated it before queuing the command.
                engine.add_validated(command.request, prefill_only=command.prefill_only, pin=command.pin)
            except BaseException as exc:  # refused: hand the error to the waiting consumer
                self._loop.call_soon_threadsafe(command.sink.put_nowait, exc)
                return True
            self._sinks[command.request.request_id] = command.sink
        elif isinstance(command, _Call):
            try:
                result, error = command.fn(engine), None
            except Exception as exc:  # handed to the caller, the engine keeps running
                result, error = None, exc
            self._loop.call_soon_threadsafe(_settle, command.future, result, error)
        elif isinstance(command, _Abort):
            out = engine.abort(command.request_id)
            if out is not None:
                self._deliver(out)
        return True

    def _run(self) -> None:
        engine = self.engine
        budget = self.cpu_budget
        assert budget is not None  # built by start(), before the engine thread
        running = True
        with torch.inference_mode():
            while running:
                # Block for work only when idle; otherwise take what arrived and step.
                if not engine.has_unfinished():
                    running = self._handle(self._commands.get())
                while running:
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    running = self._handle(command)
                if not running or not engine.has_unfinished():
                    continue
                num_threads = budget.step_threads()  # what helper jobs leave (waits for one)
                if num_threads != engine.num_threads:
                    engine.use_threads(num_threads)
                try:
                    outputs = engine.step()
                except BaseException as exc:  # a failed step fails every request, frees all
                    logger.exception("engine step failed")
                    self._fail_all(exc)
                    continue
                finally:
                    budget.end_step()
                for out in outputs:
                    self._deliver(out)
            for request_id in list(self._sinks):
                final = engine.abort(request_id)
                if final is not None:
                    self._deliver(final)

    def _fail_all(self, exc: BaseException) -> None:
        engine = self.engine
        assert self._loop is not None  # set by start(), before the engine thread
        for request_id, sink in list(self._sinks.items()):
            engine.abort(request_id)
            self._loop.call_soon_threadsafe(sink.put_nowait, exc)
        self._sinks.clear()

    # ------------------------------------------------------------------ EngineClient

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        engine = self.engine
        engine.validate(request)  # raises before anything is queued
        sink: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Add(request, sink))
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away: free the blocks within one step
                self._commands.put(_Abort(request.request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def warm(self, prefix_token_ids: tuple[int, ...], cache_salt: str | None = None) -> int:
        """Prefill the prefix (no sampling) so its full blocks enter the prefix cache; returns the
        number of its tokens now cached (0 with prefix caching off)."""
        if not self.engine.config.enable_prefix_caching or not prefix_token_ids:
            return 0
        delta = await self._prefill_only(self._warm_request(prefix_token_ids, cache_salt))
        return delta.num_cached_tokens  # counted on the engine thread

    async def warm_and_pin(self, token_ids: tuple[int, ...], cache_salt: str | None) -> tuple[int, ...]:
        """Prefill `token_ids` and pin its full blocks as they are computed, in one command;
        the pinned block ids (() with prefix caching off or no full block)."""
        if not self.engine.config.enable_prefix_caching or not token_ids:
            return ()
        delta = await self._prefill_only(self._warm_request(token_ids, cache_salt), pin=True)
        return delta.pinned_block_ids

    def _warm_request(self, token_ids: tuple[int, ...], cache_salt: str | None) -> GenerationRequest:
        return GenerationRequest(
            request_id=f"warm-{next(self._warm_ids)}",
            prompt_token_ids=tuple(token_ids),
            sampling=SamplingParams(max_tokens=1, temperature=0.0),
            cache_salt=cache_salt,
        )

    async def store_documents(self, request: GenerationRequest) -> DocumentReuse | None:
        """Prefill the documents of `request` (its spans) into the document store, sampling
        nothing; what was found and computed. None: this engine has no document store."""
        if self.engine.documents is None or request.document_cache is None or not request.document_spans:
            return None
        return (await self._prefill_only(request)).documents

    async def _prefill_only(self, request: GenerationRequest, *, pin: bool = False) -> TokenDelta:
        """Run `request` as a prefill-only request (`pin`: pinning its blocks); its final delta.
        Cancelled, it aborts the request and drops a pin taken before the abort landed."""
        self.engine.validate(request, prefill_only=True)
        sink: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Add(request, sink, prefill_only=True, pin=pin))
        try:
            return await _final_delta(sink)
        except asyncio.CancelledError:
            self._commands.put(_Abort(request.request_id))
            if pin:
                with contextlib.suppress(Exception):  # a refused request pinned nothing
                    delta = await _final_delta(sink)  # the abort's, or the pinning finish's
                    if delta.pinned_block_ids:
                        await self.call(lambda e: unpin_prefix(e, delta.pinned_block_ids))
            raise

    async def run_beside(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a worker thread on one CPU thread that the engine gives up while it
        runs (`CpuBudget`): compression and embedding, beside the engine's steps, within
        `num_threads` busy threads in all."""
        budget = self.cpu_budget
        if budget is None:
            raise EngineError("the native engine is not started", code="engine_not_ready")

        def job() -> T:
            with budget.lend(1), cpu_threads(1):
                return fn(*args)

        return await asyncio.to_thread(job)

    async def call(self, fn: Any) -> Any:
        """`fn(llm_engine)` run on the engine thread between steps; its result or exception."""
        _ = self.engine  # raises while not started
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_Call(fn, future))
        return await future

    def estimate_new_tokens(self, request: GenerationRequest) -> int:
        """The prompt tokens a prefill of `request` would compute now: less its cached prefix
        and its stored documents. Read from the event loop while the engine runs, so an
        estimate (gateway.admission)."""
        engine = self.engine
        tokens = request.prompt_token_ids
        cached = engine.manager.peek_num_cached_tokens(tokens, request.cache_salt)
        stored = engine.documents.num_stored_tokens(request, cached) if engine.documents is not None else 0
        return max(1, len(tokens) - cached - stored)

    def stats(self) -> dict[str, float]:
        if self._engine is None:
            return {}
        lent = self.cpu_budget.num_lent if self.cpu_budget is not None else 0
        return {**self._engine.stats(), "cpu_threads_lent": float(lent)}

    def prefix_cache(self) -> PrefixCacheControl | None:
        return NativePrefixCache(self) if self.config.enable_prefix_caching else None


class NativePrefixCache:
    """`PrefixCacheControl` of a `NativeEngine`: each operation runs on the engine thread
    (`engine.native.core.prefix_store`'s functions touch the block manager and the KV pool)."""

    def __init__(self, engine: NativeEngine):
        self._engine = engine

    @property
    def block_size(self) -> int:
        return self._engine.config.block_size

    async def fingerprint(self) -> dict[str, Any]:
        return await self._engine.call(engine_fingerprint)

    async def pin(self, token_ids: tuple[int, ...], cache_salt: str | None) -> tuple[int, ...]:
        return await self._engine.warm_and_pin(token_ids, cache_salt)

    async def unpin(self, block_ids: tuple[int, ...]) -> None:
        await self._engine.call(lambda e: unpin_prefix(e, block_ids))

    async def export(self, block_ids: tuple[int, ...]) -> torch.Tensor:
        return await self._engine.call(lambda e: export_kv(e, block_ids))

    async def restore(
        self, token_ids: tuple[int, ...], kv: torch.Tensor, cache_salt: str | None
    ) -> tuple[int, ...] | None:
        return await self._engine.call(lambda e: restore_prefix(e, token_ids, kv, cache_salt))
