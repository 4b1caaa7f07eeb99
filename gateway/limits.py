"""Limits that keep the gateway standing under load: body size, admission, rates and deadlines.

Terms:

- *admission*: a generation request (POST under `/v1/`) takes one of `max_concurrent_requests`
  slots for its whole life, streamed body included. When none is free it waits in a FIFO queue
  of at most `max_queued_requests`, for at most `queue_timeout_s`; a full queue or a wait that
  runs out is answered 429 with `Retry-After`. Nothing else queues, so memory stays bounded.
- *token bucket*: a budget refilled continuously at `per_minute / 60` units a second, holding at
  most `per_minute`. A bucket may go into debt (tokens are only known once generated); a debt is
  paid back by refill before the next request is admitted.
- *deadline*: the request's arrival plus `request_timeout_s`. Past it, the engine stream is
  cancelled (which aborts the engine request and frees its KV blocks) and the request ends with
  504, or with finish_reason "abort" once a stream has started.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any, TypeVar

from prometheus_client import Counter

from ragspeed.gateway.errors import APIError, error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

T = TypeVar("T")


def retry_after(seconds: float) -> str:
    """A `Retry-After` value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


async def send_error(
    send: Send,
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    error_type: str | None = None,
) -> None:
    """Answer with an OpenAI-style error body straight from an ASGI middleware."""
    body = error_body(status_code, message, param, code)
    if error_type is not None:
        body["error"]["type"] = error_type
    payload = json.dumps(body, separators=(",", ":")).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status_code, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


class Rejections:
    """`ragspeed_rejected_requests_total{reason}`: requests refused before the pipeline (auth,
    rates, admission, size), counted by the error code they got. Registered on the app's
    metrics registry in the lifespan."""

    def __init__(self) -> None:
        self.counter = Counter(
            "ragspeed_rejected_requests",
            "Requests refused before the pipeline, by reason.",
            ("reason",),
            registry=None,
        )

    async def send(
        self, send: Send, status_code: int, message: str, *, code: str | None, **kwargs: Any
    ) -> None:
        self.counter.labels(reason=code or str(status_code)).inc()
        await send_error(send, status_code, message, code=code, **kwargs)


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


# ---------------------------------------------------------------------- rates


class TokenBucket:
    """`per_minute` units a minute, bursting up to `per_minute`; `clock` is injectable for tests."""

    def __init__(self, per_minute: float, clock: Callable[[], float] = time.monotonic):
        if per_minute <= 0:
            raise ValueError(f"per_minute must be > 0, got {per_minute}")
        self.capacity = float(per_minute)
        self.rate_per_s = per_minute / 60.0
        self._clock = clock
        self.level = self.capacity
        self._updated = clock()

    def _refill(self) -> None:
        now = self._clock()
        self.level = min(self.capacity, self.level + (now - self._updated) * self.rate_per_s)
        self._updated = now

    def try_take(self, amount: float = 1.0) -> float:
        """Take `amount` now and return 0.0, or take nothing and return the seconds to wait."""
        self._refill()
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (min(amount, self.capacity) - self.level) / self.rate_per_s

    def wait_s(self) -> float:
        """Seconds until the bucket is out of debt (0.0: a request may start now)."""
        self._refill()
        return 0.0 if self.level > 0 else (-self.level + 1e-9) / self.rate_per_s

    def charge(self, amount: float) -> None:
        """Spend `amount` even if that puts the bucket into debt."""
        self._refill()
        self.level -= amount


# ---------------------------------------------------------------------- admission


class AdmissionQueue:
    """At most `max_active` holders; at most `max_waiting` FIFO waiters, each for `max_wait_s`.

    A freed slot is handed straight to the first waiter (no barging), so `active` never
    exceeds `max_active` and a waiter cannot starve behind newcomers.
    """

    def __init__(self, max_active: int, max_waiting: int, max_wait_s: float):
        self.max_active, self.max_waiting, self.max_wait_s = max_active, max_waiting, max_wait_s
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def enter(self) -> None:
        """Take a slot, waiting if needed; raises APIError 429 when the queue is full or the
        wait runs out."""
        if self.active < self.max_active and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise APIError(
                429,
                f"the server is at capacity: {self.max_active} requests running and "
                f"{self.max_waiting} queued (max_queued_requests); retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.max_wait_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.leave()  # the slot was handed over just as we gave up: pass it on
            else:
                waiter.cancel()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise APIError(
                    429,
                    f"no request slot freed within {self.max_wait_s:g} s (queue_timeout_s); retry later",
                    code="queue_timeout",
                    headers={"Retry-After": retry_after(self.max_wait_s)},
                ) from None
            raise

    def leave(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot changes hands; `active` stays
                return
        self.active -= 1
        assert self.active >= 0, "leave() without enter()"


class AdmissionMiddleware:
    """Holds an admission slot around every POST under `/v1/`, streamed response included."""

    def __init__(self, app: ASGIApp, queue: AdmissionQueue, rejections: Rejections):
        self.app, self.queue, self.rejections = app, queue, rejections

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        try:
            await self.queue.enter()
        except APIError as exc:
            return await self.rejections.send(
                send, exc.status_code, exc.message, code=exc.code, headers=exc.headers
            )
        try:
            await self.app(scope, receive, send)
        finally:
            self.queue.leave()


# ---------------------------------------------------------------------- arrival

_arrival: ContextVar[float | None] = ContextVar("ragspeed_arrival", default=None)


def arrival_time() -> float | None:
    """When the current request reached the app (perf_counter seconds; None outside one)."""
    return _arrival.get()


class ArrivalMiddleware:
    """Outermost: stamps each HTTP request's arrival, from which its deadlines and TTFT count."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        token = _arrival.set(time.perf_counter())
        try:
            await self.app(scope, receive, send)
        finally:
            _arrival.reset(token)


# ---------------------------------------------------------------------- body size


class BodyLimitMiddleware:
    """413 for a body over `max_body_bytes`, by its Content-Length or as it streams in.

    The body is read here, up to the limit, and replayed to the app; after it, `receive` is the
    server's again (so the app still sees `http.disconnect`).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, rejections: Rejections):
        self.app, self.max_body_bytes, self.rejections = app, max_body_bytes, rejections

    def _too_large(self, send: Send, size: str) -> Awaitable[None]:
        return self.rejections.send(
            send,
            413,
            f"the request body is {size}; the limit is {self.max_body_bytes} bytes (max_body_bytes)",
            code="body_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = header(scope, b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                return await self.rejections.send(
                    send,
                    400,
                    "the Content-Length header is not a number",
                    param="Content-Length",
                    code="invalid_request",
                )
            if int(declared) > self.max_body_bytes:
                return await self._too_large(send, f"{int(declared)} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await self._too_large(send, "larger than that")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# ---------------------------------------------------------------------- deadlines


class DeadlineExceeded(APIError):
    def __init__(self, timeout_s: float):
        super().__init__(
            504,
            f"the request ran past its deadline of {timeout_s:g} s (request_timeout_s)",
            code="deadline_exceeded",
        )


async def next_before(stream: AsyncIterator[T], deadline: float | None, timeout_s: float | None) -> T:
    """`anext(stream)` by `deadline` (event-loop time, None: no deadline; `timeout_s` names it).

    Past the deadline the pending `anext` is cancelled inside the stream (an engine stream
    aborts its request and frees its blocks on that) and DeadlineExceeded is raised.
    """
    if deadline is None:
        return await anext(stream)
    try:
        async with asyncio.timeout_at(deadline):
            return await anext(stream)
    except TimeoutError:
        assert timeout_s is not None  # a deadline comes from a timeout
        raise DeadlineExceeded(timeout_s) from None
