"""One POST to an ASGI app in this process, driven over raw ASGI as a server drives it: the
response's status and body chunks with their arrival times, and, where asked, a client that
hangs up mid-stream.

`httpx.ASGITransport` returns a response only once the app has sent all of it, so it can neither
time a first token nor disconnect during a stream; `eval rag` (ragspeed.evals.rag_gateway) and
the in-process gateway tests use this instead. Tooling, not serving: the app never imports it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

HOST = "ragspeed.inprocess"


@dataclass
class RawResponse:
    status: int | None = None  # None: no response had started
    chunks: list[tuple[float, bytes]] = field(default_factory=list)  # (seconds from sending, body)
    ended: bool = False  # the app sent its last body chunk


async def post(
    app: Any,
    path: str,
    body: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    hang_up_after: int | None = None,
    hang_up_when: asyncio.Event | None = None,
) -> RawResponse:
    """POST `body` as JSON to `path`; returns once the app has returned. The client stays until
    the response ends, unless `hang_up_after` (body chunks received) or `hang_up_when` is given:
    then it disconnects, as a client closing its socket does, once both hold, and takes nothing
    more."""
    payload = json.dumps(body).encode()
    raw_headers = [
        (b"host", HOST.encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    # spec_version 2.3: the server reports a disconnect through `receive` (Starlette then
    # cancels the response), not by failing `send`.
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw_headers,
        "server": (HOST, 80),
        "client": ("127.0.0.1", 50000),
    }
    hangs_up = hang_up_after is not None or hang_up_when is not None
    response = RawResponse()
    ended = asyncio.Event()
    enough_chunks = asyncio.Event()
    if not hang_up_after:
        enough_chunks.set()
    sent_body = gone = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body, gone
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": payload, "more_body": False}
        if not hangs_up:
            await ended.wait()
        await enough_chunks.wait()
        if hang_up_when is not None:
            await hang_up_when.wait()
        gone = True
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone:
            return  # a closed socket takes nothing more
        if message["type"] == "http.response.start":
            response.status = message["status"]
        elif message["type"] == "http.response.body":
            if message.get("body"):
                response.chunks.append((time.perf_counter() - start, message["body"]))
            if hang_up_after is not None and len(response.chunks) >= hang_up_after:
                enough_chunks.set()
            if not message.get("more_body", False):
                response.ended = True
                ended.set()

    start = time.perf_counter()
    try:
        await app(scope, receive, send)
    finally:
        ended.set()
    return response
