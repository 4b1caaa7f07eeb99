"""An OpenAI-compatible upstream that answers at once: what `bench gateway` puts behind the
gateway, so that the latency it reports is the gateway's own and not a model's on the same cores.

It speaks just enough HTTP/1.1 (keep-alive, `Content-Length` request bodies, chunked streamed
answers) on a bare asyncio protocol: `POST /v1/completions` and `POST /v1/chat/completions`,
streamed (`"stream": true`, SSE, with the usage chunk when `stream_options.include_usage`) and
whole, `GET /healthz` and `GET /v1/models`. Each answer is `max_tokens` tokens (at most
`MAX_TOKENS`) of the word "tok", computed from nothing: the body is parsed and the reply is
written in one go.

    python -m ragspeed.bench.instant_upstream --port 8001
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import click

MAX_TOKENS = 256
PROMPT_TOKENS = 7  # what its usage reports for every prompt: it never tokenizes
TOKEN_TEXT = " tok"


def _head(status: int, content_type: str, length: int | None) -> bytes:
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
    return f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n{framing}\r\n\r\n".encode()


def _json_response(status: int, payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()
    return _head(status, "application/json", len(body)) + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _usage(num_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": num_tokens,
        "total_tokens": PROMPT_TOKENS + num_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def answer(path: str, body: dict[str, Any]) -> bytes:
    """The whole HTTP response to a completion request `body` sent to `path`."""
    chat = path.endswith("/chat/completions")
    num_tokens = max(1, min(int(body.get("max_tokens") or 16), MAX_TOKENS))
    model = body.get("model") or "instant"
    base = {"id": "cmpl-instant", "created": 0, "model": model}
    if not body.get("stream"):
        text = TOKEN_TEXT * num_tokens
        choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        return _json_response(
            200,
            {
                **base,
                "object": "chat.completion" if chat else "text_completion",
                "choices": [{"index": 0, **choice, "finish_reason": "length", "logprobs": None}],
                "usage": _usage(num_tokens),
            },
        )
    obj = "chat.completion.chunk" if chat else "text_completion"
    token = {"delta": {"content": TOKEN_TEXT}} if chat else {"text": TOKEN_TEXT}
    events = []
    if chat:
        events.append(
            _sse({**base, "object": obj, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        )
    piece = _sse({**base, "object": obj, "choices": [{"index": 0, **token, "finish_reason": None}]})
    events += [piece] * num_tokens
    end: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
    events.append(_sse({**base, "object": obj, "choices": [{"index": 0, **end, "finish_reason": "length"}]}))
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(_sse({**base, "object": obj, "choices": [], "usage": _usage(num_tokens)}))
    events.append(b"data: [DONE]\n\n")
    return _head(200, "text/event-stream", None) + _chunk(b"".join(events)) + b"0\r\n\r\n"


def respond(method: str, path: str, body: bytes) -> bytes:
    if method == "GET" and path == "/healthz":
        return _json_response(200, {"status": "ok"})
    if method == "GET" and path == "/v1/models":
        return _json_response(200, {"object": "list", "data": [{"id": "instant", "object": "model"}]})
    if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
        try:
            request = json.loads(body)
        except ValueError:
            return _json_response(
                400, {"error": {"message": "the body is not JSON", "type": "invalid_request_error"}}
            )
        return answer(path, request)
    return _json_response(404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}})


class InstantUpstream:
    """The server, in the running event loop: `await InstantUpstream.start(port=0)`, then its
    `url`; it counts the connections it accepted and the requests it answered (tests check that
    a client reuses its connections)."""

    def __init__(self) -> None:
        self.num_connections = 0
        self.num_requests = 0
        self.server: asyncio.Server | None = None

    @classmethod
    async def start(cls, host: str = "127.0.0.1", port: int = 0) -> InstantUpstream:
        upstream = cls()
        loop = asyncio.get_running_loop()
        upstream.server = await loop.create_server(lambda: _Connection(upstream), host, port, backlog=1024)
        return upstream

    @property
    def url(self) -> str:
        assert self.server is not None, "start() first"
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


class _Connection(asyncio.Protocol):
    """One client connection: requests in order, each answered as soon as its body is in."""

    def __init__(self, upstream: InstantUpstream) -> None:
        self.upstream = upstream
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.upstream.num_connections += 1

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buffer) < end + 4 + length:
                return  # the body is still coming
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            method, path, *_ = head[0].split(" ")
            self.upstream.num_requests += 1
            assert self.transport is not None
            self.transport.write(respond(method, path.split("?", 1)[0], body))


async def serve(host: str, port: int) -> None:
    upstream = await InstantUpstream.start(host, port)
    assert upstream.server is not None
    async with upstream.server:
        await upstream.server.serve_forever()


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (less client overhead per request), else None:
    asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, required=True)
def main(host: str, port: int) -> None:
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve(host, port))


if __name__ == "__main__":
    main()
