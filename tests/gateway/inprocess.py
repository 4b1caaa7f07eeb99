"""Running the gateway app inside the test's event loop: its lifespan, an httpx client over
`httpx.ASGITransport`, and a raw ASGI stream whose client hangs up (ragspeed.evals.asgi_post).

Everything here speaks ASGI and HTTP only (the lifespan protocol, requests, responses), never
the app's internals, so the tests hold whatever the app keeps in its state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx

from ragspeed.evals.asgi_post import post
from ragspeed.gateway.app import create_app
from ragspeed.gateway.settings import Settings

READY_TIMEOUT_S = 30.0
MODEL_FREE_METHODS = ("bm25", "first-docs", "identity")
SERVED_MODEL = "tiny"


def fake_settings(**overrides: Any) -> Settings:
    """Settings of a gateway over the fake engine: nothing persisted, nothing loaded (only the
    compressors without models are offered, and retrieval is off)."""
    values: dict[str, Any] = dict(
        engine="fake",
        model="fake",
        served_model_name=SERVED_MODEL,
        prompt_cache_dir=None,
        document_cache_dir=None,  # RAM only: a test's documents are not found by a later run
        max_model_len=4096,
        compression_methods=list(MODEL_FREE_METHODS),
        compression_default_method="bm25",
        enable_retrieval=False,
    )
    values.update(overrides)
    return Settings(**values)


class Lifespan:
    """Drives an ASGI app's lifespan protocol: startup on enter, shutdown on exit."""

    def __init__(self, app: Any):
        self.app = app
        self._to_app: asyncio.Queue = asyncio.Queue()
        self._from_app: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def _expect(self, phase: str) -> None:
        message = await self._from_app.get()
        if message["type"] != f"lifespan.{phase}.complete":
            await asyncio.gather(self._task, return_exceptions=True)
            raise RuntimeError(f"lifespan {phase} failed: {message.get('message', message)}")

    async def __aenter__(self) -> Lifespan:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = asyncio.create_task(self.app(scope, self._to_app.get, self._from_app.put))
        await self._to_app.put({"type": "lifespan.startup"})
        await self._expect("startup")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._to_app.put({"type": "lifespan.shutdown"})
        await self._expect("shutdown")
        await self._task


async def wait_for(
    check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = READY_TIMEOUT_S
) -> None:
    """Poll `check` until it holds; fail naming `what` once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s} s")
        await asyncio.sleep(0.005)


class GatewayClient(httpx.AsyncClient):
    """An httpx client over the app, which it also keeps for `hang_up` (raw ASGI)."""

    def __init__(self, app: Any):
        super().__init__(transport=httpx.ASGITransport(app=app), base_url="http://gateway.test", timeout=60)
        self.app = app


@asynccontextmanager
async def serve(settings: Settings, *, ready: bool = True) -> AsyncIterator[GatewayClient]:
    """The app of `settings`, started; a client for it. `ready`: wait until /healthz is 200."""
    app = create_app(settings)
    async with Lifespan(app):
        async with GatewayClient(app) as client:
            if ready:

                async def healthy() -> bool:
                    response = await client.get("/healthz")
                    if response.json().get("status") == "failed":
                        raise AssertionError(f"engine failed to start: {response.text}")
                    return response.status_code == 200

                await wait_for(healthy, "ready")
            yield client


async def hang_up(
    client: GatewayClient,
    path: str,
    body: dict[str, Any],
    *,
    after_chunks: int = 0,
    when: asyncio.Event | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int | None, list[bytes]]:
    """POST `body` to the app and disconnect, as a client closing its socket does, once
    `after_chunks` body chunks have arrived and `when` (if given) is set; returns the status
    (None: no response had started) and the chunks received. Returns once the app has returned."""
    response = await post(
        client.app, path, body, headers=headers, hang_up_after=after_chunks, hang_up_when=when
    )
    chunks = [chunk for _, chunk in response.chunks]
    assert not response.ended, f"the response ended before the client hung up: {b''.join(chunks)!r}"
    return response.status, chunks


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order (`[DONE]` included)."""
    return [line.removeprefix("data: ") for line in text.split("\n") if line.startswith("data: ")]


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample `name{labels...}` in a /metrics text (labels in any order; a
    subset of the sample's labels is enough); the sum over all samples that match."""
    found = None
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        sample_name, _, rest = series.partition("{")
        if sample_name != name:
            continue
        sample_labels = dict(part.split("=", 1) for part in rest.rstrip("}").split(",") if part)
        if all(sample_labels.get(k) == f'"{v}"' for k, v in labels.items()):
            found = (found or 0.0) + float(value)
    return found
