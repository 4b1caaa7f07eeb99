"""The wire format: response bodies for chat and text completions, streamed as SSE or returned
whole, with their `usage`, `ragspeed` fields and timing headers.

Streams are primed: the first engine delta is awaited before the response starts, so a request
the engine refuses still gets a proper HTTP error status. A client that disconnects cancels the
stream; closing the engine's iterator then aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from ragspeed.engine.protocol import EngineError, TokenDelta
from ragspeed.gateway.errors import error_body
from ragspeed.gateway.limits import DeadlineExceeded
from ragspeed.gateway.logprobs import LogprobsFormatter
from ragspeed.gateway.run import Generation


@dataclass(frozen=True)
class Shape:
    """What differs between chat and text completions on the wire."""

    object_name: str  # "chat.completion" or "text_completion"
    chat: bool

    def content(self, text: str) -> dict[str, Any]:
        return {"delta": {"content": text}} if self.chat else {"text": text}

    def whole(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


CHAT = Shape("chat.completion", chat=True)
TEXT = Shape("text_completion", chat=False)


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


DONE = b"data: [DONE]\n\n"


class LastPiece(bytes):
    """The last piece of a response body: `SSEResponse` sends it with the end of the body, in
    one write."""


class SSEResponse(StreamingResponse):
    """A `StreamingResponse` that writes less: the body's `LastPiece` goes out with the end of
    the body (Starlette sends an empty message after it, a write of its own). A client that
    disconnects cancels the stream; the body iterator is closed in any case, which aborts its
    engine request.

    The stream runs in the request's own task and one plain task waits for the disconnect
    (Starlette runs both in an anyio task group: a dearer set-up for every request)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None, "a response runs in a task"
        finished = gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:  # else the stream ended first, and nothing is left to cancel
                gone = True
                streaming.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.sleep(0)  # the watch looks first: a client already gone gets nothing
            await self.stream_response(send)
        except asyncio.CancelledError:
            # The watch's cancel is ours to absorb, as Starlette's task group does; any other
            # (the server shutting down) goes on.
            if not gone or streaming.uncancel() > 0:
                raise
        finally:
            finished = True  # before any await: the watch can no longer cancel this task
            watcher.cancel()
        if self.background is not None:
            await self.background()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        try:
            async for piece in self.body_iterator:
                ended = isinstance(piece, LastPiece)
                await send({"type": "http.response.body", "body": piece, "more_body": not ended})
                if ended:
                    break
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


_TEXT_MARK = "\x00ragspeed-text\x00"  # never in a request id, an object name or a model id


class TextChunks:
    """The SSE bytes of one stream's plain text chunks, the bulk of a stream. They differ only
    in their text, so each is a prefix, the text as a JSON string and a suffix, fixed for the
    stream: the bytes `_sse` gives for the whole chunk, for a string encoding instead of a
    dict's (a tenth of the time)."""

    def __init__(self, base: dict[str, Any], shape: Shape):
        payload = {**base, "choices": [{"index": 0, **shape.content(_TEXT_MARK), "finish_reason": None}]}
        whole = _sse(payload)
        mark = json.dumps(_TEXT_MARK).encode()
        assert whole.count(mark) == 1, "the text mark must appear once"
        self._prefix, _, self._suffix = whole.partition(mark)

    def __call__(self, text: str) -> bytes:
        return self._prefix + json.dumps(text).encode() + self._suffix


def timing_headers(gen: Generation) -> dict[str, str]:
    headers = {
        "x-ragspeed-request-id": gen.prepared.request_id,
        "x-ragspeed-arm": gen.prepared.arm,
        "x-ragspeed-prompt-tokens": str(len(gen.prepared.generation.prompt_token_ids)),
    }
    for stage, seconds in gen.prepared.timer.seconds.items():
        headers[f"x-ragspeed-{stage.replace('_', '-')}-ms"] = f"{seconds * 1000:.3f}"
    if gen.ttft_s is not None:
        headers["x-ragspeed-ttft-ms"] = f"{gen.ttft_s * 1000:.3f}"
    if gen.num_cached_tokens:
        headers["x-ragspeed-cached-tokens"] = str(gen.num_cached_tokens)
    return headers


def ragspeed_fields(gen: Generation) -> dict[str, Any]:
    """Per-request figures for the response's `ragspeed` object (milliseconds)."""
    timings = {k: round(v * 1000, 3) for k, v in gen.prepared.timer.seconds.items()}
    out: dict[str, Any] = {
        "request_id": gen.prepared.request_id,
        "arm": gen.prepared.arm,
        "timings_ms": timings,
        "ttft_ms": round(gen.ttft_s * 1000, 3) if gen.ttft_s is not None else None,
        "e2e_ms": round(gen.e2e_s * 1000, 3) if gen.e2e_s is not None else None,
        "tpot_ms": round(gen.tpot_s * 1000, 3) if gen.tpot_s is not None else None,
        "predicted_ttft_ms": round(gen.predicted_ttft_s * 1000, 3)
        if gen.predicted_ttft_s is not None
        else None,
        "num_static_tokens": gen.prepared.generation.num_static_tokens,
    }
    if gen.prepared.return_prompt:
        out["prompt"] = gen.prepared.generation.prompt
    if gen.documents is not None:
        out["document_cache"] = {
            "policy": gen.prepared.generation.document_cache.policy
            if gen.prepared.generation.document_cache
            else None,
            "documents_hit": gen.documents.num_hit,
            "documents_computed": gen.documents.num_computed,
            "recomputed_tokens": gen.documents.num_recomputed_tokens,
            # the native engine's hit rate, hits and bytes by tier (engine.document_kv)
            **getattr(gen.documents, "by_tier", {}),
        }
    report = gen.prepared.compression
    if report is not None:
        out["compression"] = {
            "method": report.method,
            "original_tokens": report.original_tokens,
            "compressed_tokens": report.compressed_tokens,
            "ms": round(report.seconds * 1000, 3),
            "failed": report.failed,
            "skipped_reason": report.skipped_reason,
        }
    return out


def usage(gen: Generation) -> dict[str, Any]:
    """The OpenAI `usage` object."""
    return {
        "prompt_tokens": gen.num_prompt_tokens,
        "completion_tokens": gen.num_completion_tokens,
        "total_tokens": gen.num_prompt_tokens + gen.num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.num_cached_tokens},
    }


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def complete(gen: Generation, shape: Shape, request: Request) -> JSONResponse:
    """Run the request to its end; abort it if the client goes away first."""

    async def drain() -> None:
        async for _ in gen.deltas():
            pass

    work = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()  # the client left: closing the generator aborts the request
    await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        return JSONResponse({}, status_code=499)
    work.result()  # re-raise engine errors for the error handlers
    logprobs = None
    if gen.wants_logprobs:
        logprobs = LogprobsFormatter(gen.tokenizer, chat=shape.chat)(gen.logprobs)
    body = {
        "id": f"{'chatcmpl' if shape.chat else 'cmpl'}-{gen.prepared.request_id}",
        "object": shape.object_name,
        "created": int(time.time()),
        "model": gen.model_id,
        "choices": [
            {"index": 0, **shape.whole(gen.text), "finish_reason": gen.finish_reason, "logprobs": logprobs}
        ],
        "usage": usage(gen),
        "ragspeed": ragspeed_fields(gen),
    }
    return JSONResponse(body, headers=timing_headers(gen))


async def stream(gen: Generation, shape: Shape, include_usage: bool) -> SSEResponse:
    deltas = gen.deltas()
    try:
        first = await anext(deltas)  # engine errors surface here, before any byte is sent
    except StopAsyncIteration:
        first = None
    except BaseException:
        await deltas.aclose()
        raise
    base = {
        "id": f"{'chatcmpl' if shape.chat else 'cmpl'}-{gen.prepared.request_id}",
        "object": shape.chunk_object,
        "created": int(time.time()),
        "model": gen.model_id,
    }

    text_chunk = TextChunks(base, shape)
    formatter = None
    if gen.wants_logprobs:
        formatter = LogprobsFormatter(gen.tokenizer, chat=shape.chat)

    def chunk(choice: dict[str, Any] | None, **extra: Any) -> bytes:
        return _sse({**base, "choices": [] if choice is None else [{"index": 0, **choice}], **extra})

    def delta_events(delta: TokenDelta) -> bytes:
        if formatter is not None and delta.logprobs:
            # Every token gets its logprobs, also one whose text is held back (a split UTF-8
            # character, a possible stop string) or not shown (EOS).
            logprobs = formatter(delta.logprobs)
            return chunk({**shape.content(delta.text), "logprobs": logprobs, "finish_reason": None})
        return text_chunk(delta.text) if delta.text else b""

    async def body() -> AsyncIterator[bytes]:
        """The role chunk, then one piece per engine delta, each sent as it comes, and the
        ending (final chunk, usage, [DONE]) in one `LastPiece`. A piece goes out with the next
        one where nothing is waited for in between: the role chunk with the first delta's
        (primed, so there already), the last delta's (it has the finish reason) with the
        ending. Every write wakes the client: fewer pieces, fewer wake-ups."""
        try:
            held = (
                chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
                if shape.chat
                else b""
            )
            delta = first
            while delta is not None:
                held += delta_events(delta)
                if held and delta.finish_reason is None:
                    yield held
                    held = b""
                try:
                    delta = await anext(deltas)
                except StopAsyncIteration:
                    break
                except DeadlineExceeded:  # the status is sent: end the stream as aborted
                    gen.finish_reason = "abort"
                    break
                except EngineError as exc:  # failed after the status was sent: say so in-stream
                    yield LastPiece(
                        held + _sse(error_body(exc.status_code, exc.message, exc.param, exc.code)) + DONE
                    )
                    return
            final: dict[str, Any] = {"delta": {}} if shape.chat else {"text": ""}
            ending = chunk({**final, "finish_reason": gen.finish_reason}, ragspeed=ragspeed_fields(gen))
            if include_usage:
                ending += chunk(None, usage=usage(gen))
            yield LastPiece(held + ending + DONE)
        finally:
            await deltas.aclose()  # aborts the engine request if the client went away

    return SSEResponse(
        body(),
        headers={**timing_headers(gen), "cache-control": "no-cache", "x-accel-buffering": "no"},
    )
