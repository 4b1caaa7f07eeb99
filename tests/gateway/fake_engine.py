"""A scripted `EngineClient` for in-process gateway tests: no model, no thread, no sleeps.

The fake answers every request with a `Reply`: text pieces sent one delta (one token id) each,
then a finish reason. A reply may fail (an `EngineError` before its first delta or after some)
or stall before a delta until the test sets an `asyncio.Event`. It keeps a pool of KV blocks as
the native engine would (`block_size` tokens a block, the prompt's and the output's), so tests
can read `ragspeed_engine_num_blocks_used` on /metrics and see every block freed after aborts
and failures, and it records which requests it saw and which were aborted.

`install(monkeypatch, tokenizer)` registers the backend name "fake" in `engine.backends.BACKENDS`
for one test; `create_app(Settings(engine="fake", ...))` then builds fakes through the ordinary
`build_engine` path, one per engine the app asks for (A/B arms with an engine of their own get
their own fake), all listed in `FakeBackend.engines`.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ragspeed.engine.backends import BACKENDS
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.protocol import EngineError, GenerationRequest, TokenDelta

# What the fake says when no reply is scripted: one delta per piece, cut at max_tokens.
DEFAULT_PIECES = ("The", " answer", " is", " 42", ".")
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_NUM_BLOCKS = 256


@dataclass
class Stall:
    """Hold a reply before its delta number `at` (0: before the first) until `release` is set;
    `reached` is set when the reply gets there, so a test knows the request is in the engine."""

    at: int = 0
    reached: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class Reply:
    pieces: tuple[str, ...] = DEFAULT_PIECES
    finish_reason: str = "stop"  # when every piece was sent; "length" when max_tokens cut it
    error: EngineError | None = None  # raised in place of delta number `error_at`
    error_at: int = 0  # 0: before any delta, so the gateway still answers with an error status
    stall: Stall | None = None
    num_cached_tokens: int = 0


class FakeEngine:
    """One fake engine; built by `build_engine` as `FakeEngine(config)` via `FakeBackend.build`."""

    def __init__(self, config: EngineConfig, backend: FakeBackend):
        self.config = config
        self.backend = backend
        self.model_name = config.model
        self.max_model_len = config.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.block_size = config.block_size
        self.num_blocks = (
            config.num_kv_cache_tokens // config.block_size
            if config.num_kv_cache_tokens
            else DEFAULT_NUM_BLOCKS
        )
        self.replies: deque[Reply] = deque()  # taken one per request; empty: the default reply
        self.requests: list[GenerationRequest] = []  # every request generate() was given
        self.aborted: list[str] = []  # ids stopped before their last delta (closed or abort())
        self.finished: list[str] = []  # ids that reached their finish reason
        self.started = False
        self.shut_down = False
        self._blocks: dict[str, int] = {}  # request id -> blocks it holds
        self._running: dict[str, asyncio.Event] = {}  # request id -> set by abort()

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    def script(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    async def start(self) -> None:
        if self.backend.start_gate is not None:
            await self.backend.start_gate.wait()
        if self.backend.start_error is not None:
            raise self.backend.start_error
        self.started = True

    async def shutdown(self) -> None:
        for request_id in list(self._running):
            await self.abort(request_id)
        self.shut_down = True

    def _hold(self, request_id: str, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size)
        in_use = sum(self._blocks.values()) - self._blocks.get(request_id, 0)
        if in_use + need > self.num_blocks:
            raise EngineError(f"the fake KV pool of {self.num_blocks} blocks is full", code="kv_full")
        self._blocks[request_id] = need

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        if not self.started:
            raise EngineError("the fake engine is not started", code="engine_not_ready")
        self.requests.append(request)
        reply = self.replies.popleft() if self.replies else Reply()
        request_id = request.request_id
        num_prompt = len(request.prompt_token_ids)
        aborted = self._running[request_id] = asyncio.Event()
        pieces = reply.pieces[: request.sampling.max_tokens]
        finish = reply.finish_reason if len(pieces) == len(reply.pieces) else "length"
        ended = failed = False  # ended: the last delta is out (or the abort delta)
        try:
            self._hold(request_id, num_prompt)
            for index, piece in enumerate(pieces):
                if reply.error is not None and index == reply.error_at:
                    raise reply.error
                if reply.stall is not None and index == reply.stall.at:
                    reply.stall.reached.set()
                    await _first(reply.stall.release, aborted)
                if aborted.is_set():
                    ended = True
                    yield TokenDelta("", finish_reason="abort", num_prompt_tokens=num_prompt)
                    return
                self._hold(request_id, num_prompt + index + 1)
                last = index == len(pieces) - 1
                ended = last
                yield TokenDelta(
                    piece,
                    token_ids=(index + 1,),
                    finish_reason=finish if last else None,
                    num_prompt_tokens=num_prompt,
                    num_cached_tokens=reply.num_cached_tokens,
                )
            if not pieces:
                ended = True
                yield TokenDelta("", finish_reason=finish, num_prompt_tokens=num_prompt)
        except EngineError:
            failed = True  # refused (a full pool) or the scripted error: not an abort
            raise
        finally:
            # Closed early (the gateway's abort), cancelled (a deadline) or failed: free it all.
            self._blocks.pop(request_id, None)
            self._running.pop(request_id, None)
            if not (ended or failed):
                self.aborted.append(request_id)
            elif ended and not aborted.is_set():  # abort() recorded its own
                self.finished.append(request_id)

    async def abort(self, request_id: str) -> None:
        event = self._running.get(request_id)
        if event is not None:
            event.set()
            self.aborted.append(request_id)

    async def warm(self, prefix_token_ids: tuple[int, ...], cache_salt: str | None = None) -> int:
        return 0

    async def store_documents(self, request: GenerationRequest) -> None:
        return None

    def prefix_cache(self) -> None:
        return None  # no KV to pin: prompts fall back to text substitution, as on a remote engine

    def stats(self) -> dict[str, float]:
        used = sum(self._blocks.values())
        return {
            "num_blocks_total": float(self.num_blocks),
            "num_blocks_used": float(used),
            "num_blocks_free": float(self.num_blocks - used),
            "num_requests_running": float(len(self._running)),
        }


async def _first(*events: asyncio.Event) -> None:
    """Wait until any of `events` is set."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


class FakeBackend:
    """Builds the fakes of one test and holds what they share: the tokenizer and start-up."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.engines: list[FakeEngine] = []
        self.start_gate: asyncio.Event | None = None  # start() waits for it (the "loading" state)
        self.start_error: Exception | None = None  # start() raises it (the "failed" state)

    @property
    def engine(self) -> FakeEngine:
        """The app's main engine: the first one built."""
        return self.engines[0]

    def build(self, config: EngineConfig) -> FakeEngine:
        engine = FakeEngine(config, self)
        self.engines.append(engine)
        return engine


def install(monkeypatch: Any, tokenizer: Any) -> FakeBackend:
    """Register backend "fake" for one test (undone by `monkeypatch`); returns its builder."""
    backend = FakeBackend(tokenizer)
    # `build_engine` resolves "module:attribute" and calls it with the EngineConfig.
    monkeypatch.setattr(sys.modules[__name__], "build_fake", backend.build, raising=False)
    monkeypatch.setitem(BACKENDS, "fake", f"{__name__}:build_fake")
    return backend
