"""The gateway app in this process, driven as a client drives a server: its lifespan, HTTP
requests over ASGI, and chat completions streamed chunk by chunk with their arrival times.

`httpx.ASGITransport` returns a response only once the app has sent all of it, so it cannot
time a first token; `stream_chat` drives the streamed requests over raw ASGI
(ragspeed.evals.asgi_post), every body chunk timed as the app sends it. Everything else
(readiness, collections) goes through httpx.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from ragspeed.evals.asgi_post import post
from ragspeed.gateway.app import create_app
from ragspeed.gateway.settings import Settings

BASE_URL = "http://ragspeed.eval"
READY_POLL_S = 0.05
ADD_BATCH = 256  # passages per POST: well under the gateway's body limit for NQ passages


class GatewayStartError(RuntimeError):
    """The engine (or a service it needs) did not start; the message is the gateway's."""


@dataclass(frozen=True)
class StreamedReply:
    """One streamed chat completion as the client saw it. Times are seconds from sending."""

    status: int
    error: str | None = None  # the error message of a refused or failed request
    text: str = ""
    first_content_s: float | None = None  # the first chunk with content
    end_s: float | None = None  # the last chunk
    usage: dict[str, Any] = field(default_factory=dict)
    ragspeed: dict[str, Any] = field(default_factory=dict)  # the final chunk's `ragspeed` object


@asynccontextmanager
async def running_gateway(settings: Settings, ready_timeout_s: float = 900.0) -> AsyncIterator[Any]:
    """The app of `settings`, started and ready (its /healthz 200)."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with http_client(app) as http:
            deadline = time.monotonic() + ready_timeout_s
            while True:
                response = await http.get("/healthz")
                if response.status_code == 200:
                    break
                if response.json().get("status") == "failed":
                    raise GatewayStartError(response.json().get("error", response.text))
                if time.monotonic() > deadline:
                    raise GatewayStartError(f"the gateway was not ready after {ready_timeout_s:.0f} s")
                await asyncio.sleep(READY_POLL_S)
        yield app


def http_client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE_URL, timeout=None)


def _error_message(status: int, payload: bytes) -> str:
    try:
        return f"{status}: {json.loads(payload)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{status}: {payload[:300].decode('utf-8', 'replace')}"


async def create_collection(app: Any, name: str, passages: Sequence[dict[str, str]]) -> int:
    """A collection `name` of `passages` ({"title", "text"}), each one document (not chunked);
    returns the number of documents added."""
    num_added = 0
    async with http_client(app) as http:
        response = await http.post("/v1/collections", json={"name": name})
        if response.status_code != 201:
            raise GatewayStartError(
                f"creating collection {name!r}: {_error_message(response.status_code, response.content)}"
            )
        for start in range(0, len(passages), ADD_BATCH):
            batch = list(passages[start : start + ADD_BATCH])
            response = await http.post(
                f"/v1/collections/{name}/documents", json={"documents": batch, "chunk": False}
            )
            if response.status_code != 200:
                raise GatewayStartError(
                    f"adding passages to {name!r}: {_error_message(response.status_code, response.content)}"
                )
            num_added += response.json()["num_added"]
    return num_added


def parse_stream(status: int, chunks: Sequence[tuple[float, bytes]]) -> StreamedReply:
    """The reply of an SSE stream whose body arrived as (seconds, bytes) chunks."""
    if status != 200:
        return StreamedReply(status, error=_error_message(status, b"".join(c for _, c in chunks)))
    parts: list[str] = []
    first: float | None = None
    usage: dict[str, Any] = {}
    ragspeed: dict[str, Any] = {}
    buffer = b""
    for at, chunk in chunks:
        buffer += chunk
        *events, buffer = buffer.split(b"\n\n")  # the last piece may be an unfinished event
        for event in events:
            for line in event.decode("utf-8").split("\n"):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[len("data: ") :])
                if "error" in payload:  # failed after the status was sent
                    message = payload["error"].get("message", "")
                    return StreamedReply(status, error=f"in-stream error: {message}", text="".join(parts))
                for choice in payload.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        parts.append(content)
                        first = at if first is None else first
                usage = payload.get("usage") or usage
                ragspeed = payload.get("ragspeed") or ragspeed
    end = chunks[-1][0] if chunks else None
    return StreamedReply(status, None, "".join(parts), first, end, usage, ragspeed)


async def stream_chat(app: Any, body: dict[str, Any]) -> StreamedReply:
    """POST `body` (with `stream: true`) to /v1/chat/completions and read the whole stream."""
    response = await post(app, "/v1/chat/completions", body)
    return parse_stream(response.status or 0, response.chunks)


class CompressorErrors(logging.Handler):
    """Keeps the error of each compressor failure the gateway logs while it fails open (the
    response says only that the compressor failed)."""

    LOGGER = "ragspeed.compression.policy"

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.errors: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            self.errors.append(f"{type(exc).__name__}: {exc}")
        else:
            self.errors.append(record.getMessage())

    def __enter__(self) -> CompressorErrors:
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(self.LOGGER).removeHandler(self)
