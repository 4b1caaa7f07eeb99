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
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import quote

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

    def whole(self, gen: Generation) -> dict[str, Any]:
        if not self.chat:
            return {"text": gen.text}
        if not gen.tool_calls:
            return {"message": {"role": "assistant", "content": gen.text}}
        # A turn of calls has no content unless the model wrote some beside them (OpenAI: null).
        content = gen.text or None
        return {"message": {"role": "assistant", "content": content, "tool_calls": gen.tool_calls}}

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


CHAT = Shape("chat.completion", chat=True)
TEXT = Shape("text_completion", chat=False)


def _call_pieces(calls: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """Tool-call deltas in OpenAI's chunking: a whole call becomes its head (index, id, type,
    name, no arguments yet) and then its arguments; a piece already (an upstream's) stays so."""
    pieces = []
    for call in calls:
        function = call.get("function") or {}
        if not (call.get("id") and function.get("arguments")):
            pieces.append(call)
            continue
        pieces.append({**call, "function": {**function, "arguments": ""}})
        pieces.append({"index": call["index"], "function": {"arguments": function["arguments"]}})
    return pieces


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

    def __init__(self, base: dict[str, Any], shape: Shape, index: int = 0):
        payload = {**base, "choices": [{"index": index, **shape.content(_TEXT_MARK), "finish_reason": None}]}
        whole = _sse(payload)
        mark = json.dumps(_TEXT_MARK).encode()
        assert whole.count(mark) == 1, "the text mark must appear once"
        self._prefix, _, self._suffix = whole.partition(mark)

    def __call__(self, text: str) -> bytes:
        return self._prefix + json.dumps(text).encode() + self._suffix


def timing_headers(gen: Generation) -> dict[str, str]:
    headers = {
        **ignored_fields_header(gen),
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


def ignored_fields_header(gen: Generation) -> dict[str, str]:
    """The fields the client sent that changed nothing (gateway.surface), where there are any;
    a name outside printable ASCII percent-encoded (a header value is Latin-1 text)."""
    ignored = [quote(name, safe="!#$&'()*+-./:;<=>?@[]^_`{|}~") for name in gen.prepared.ignored_fields]
    return {"x-ragspeed-ignored-fields": ",".join(ignored)} if ignored else {}


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
            # the native engine's hit rate, hits and bytes by tier (engine.native.core.document_kv)
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


def usage(gens: list[Generation]) -> dict[str, Any]:
    """The OpenAI `usage` object of one response: its prompt once, every choice's output."""
    num_completion_tokens = sum(gen.num_completion_tokens for gen in gens)
    return {
        "prompt_tokens": gens[0].num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": gens[0].num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gens[0].num_cached_tokens},
    }


def choice_logprobs(gen: Generation, shape: Shape) -> dict[str, Any] | None:
    """A whole choice's logprobs: the engine's, formatted, or an upstream's, joined."""
    if gen.wire_logprobs:
        return {"content": [entry for part in gen.wire_logprobs for entry in part.get("content") or ()]}
    if gen.wants_logprobs:
        return LogprobsFormatter(gen.tokenizer, chat=shape.chat)(gen.logprobs)
    return None


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def complete(gens: list[Generation], shape: Shape, request: Request) -> JSONResponse:
    """Run the request's choices to their end; abort them if the client goes away first, or
    the others when one fails."""

    async def drain(deltas: AsyncIterator[TokenDelta]) -> None:
        async for _ in deltas:
            pass

    async def drain_choices() -> None:
        # The first choice's prompt is in the prefix cache by its first token: the others
        # start then, and prefill only what is left.
        first = gens[0].deltas()
        try:
            if await _prime(first) is not None:
                await _all([drain(first), *(drain(gen.deltas()) for gen in gens[1:])])
        finally:
            await first.aclose()

    work = asyncio.ensure_future(drain_choices())
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()  # the client left: closing the generators aborts the requests
    await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        return JSONResponse({}, status_code=499)
    work.result()  # re-raise engine errors for the error handlers
    gen = gens[0]
    body = {
        "id": f"{'chatcmpl' if shape.chat else 'cmpl'}-{gen.prepared.request_id}",
        "object": shape.object_name,
        "created": int(time.time()),
        "model": gen.model_id,
        "choices": [
            {
                "index": index,
                **shape.whole(choice),
                "finish_reason": choice.finish_reason,
                "logprobs": choice_logprobs(choice, shape),
            }
            for index, choice in enumerate(gens)
        ],
        "usage": usage(gens),
        "ragspeed": ragspeed_fields(gen),
    }
    return JSONResponse(body, headers=timing_headers(gen))


async def _all(awaitables: list[Any]) -> None:
    """Await them all; the first to fail cancels the others (which frees their requests)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _indexed(deltas: AsyncIterator[TokenDelta]) -> AsyncGenerator[tuple[int, TokenDelta], None]:
    async for delta in deltas:
        yield 0, delta


async def _merged(
    streams: Sequence[AsyncIterator[TokenDelta]],
) -> AsyncGenerator[tuple[int, TokenDelta], None]:
    """The deltas of several choices as they come, each with its choice's index."""
    pending = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    delta = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, delta
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _prime(deltas: AsyncIterator[TokenDelta]) -> TokenDelta | None:
    try:
        return await anext(deltas)
    except StopAsyncIteration:
        return None


async def stream(gens: list[Generation], shape: Shape, include_usage: bool) -> SSEResponse:
    streams = [gen.deltas() for gen in gens]
    # Every choice's first delta is awaited before the status goes out: engine errors surface
    # here, as an HTTP error. The first choice's prompt is in the prefix cache by its first
    # token: the others start then, and prefill only what is left.
    primed: list[Any] = []
    for batch in (streams[:1], streams[1:]):
        primed += await asyncio.gather(*(_prime(deltas) for deltas in batch), return_exceptions=True)
    failed = next((p for p in primed if isinstance(p, BaseException)), None)
    if failed is not None:
        for deltas in streams:
            await deltas.aclose()
        raise failed
    firsts = cast(list[TokenDelta | None], primed)
    gen = gens[0]
    base = {
        "id": f"{'chatcmpl' if shape.chat else 'cmpl'}-{gen.prepared.request_id}",
        "object": shape.chunk_object,
        "created": int(time.time()),
        "model": gen.model_id,
    }
    text_chunks = [TextChunks(base, shape, index) for index in range(len(gens))]
    formatters = [
        LogprobsFormatter(choice.tokenizer, chat=shape.chat) if choice.wants_logprobs else None
        for choice in gens
    ]

    def chunk(index: int | None, choice: dict[str, Any] | None = None, **extra: Any) -> bytes:
        return _sse({**base, "choices": [] if choice is None else [{"index": index, **choice}], **extra})

    def delta_events(index: int, delta: TokenDelta) -> bytes:
        events = b""
        formatter = formatters[index]
        if delta.wire_logprobs is not None:  # an upstream's, as it sent them
            events = chunk(
                index, {**shape.content(delta.text), "logprobs": delta.wire_logprobs, "finish_reason": None}
            )
        elif formatter is not None and delta.logprobs:
            # Every token gets its logprobs, also one whose text is held back (a split UTF-8
            # character, a possible stop string) or not shown (EOS).
            logprobs = formatter(delta.logprobs)
            events = chunk(index, {**shape.content(delta.text), "logprobs": logprobs, "finish_reason": None})
        elif delta.text:
            events = text_chunks[index](delta.text)
        for piece in _call_pieces(delta.tool_calls):
            events += chunk(index, {"delta": {"tool_calls": [piece]}, "finish_reason": None})
        return events

    async def following() -> AsyncGenerator[tuple[int, TokenDelta], None]:
        """The firsts, then every choice's deltas as they come."""
        for index, first in enumerate(firsts):
            if first is not None:
                yield index, first
        live = [deltas for deltas, first in zip(streams, firsts) if first is not None]
        if len(streams) == 1:
            if live:
                async for pair in _indexed(streams[0]):
                    yield pair
            return
        indexes = [index for index, first in enumerate(firsts) if first is not None]
        async for index, delta in _merged(live):
            yield indexes[index], delta

    async def body() -> AsyncIterator[bytes]:
        """The role chunks, then one piece per engine delta, each sent as it comes, and the
        ending (final chunks, usage, [DONE]) in one `LastPiece`. A piece goes out with the next
        one where nothing is waited for in between: the role chunk with the first delta's
        (primed, so there already), the last delta's (it has the finish reason) with the
        ending. Every write wakes the client: fewer pieces, fewer wake-ups."""
        pairs = following()
        try:
            held = b""
            if shape.chat:
                role = {"delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                held = b"".join(chunk(index, role) for index in range(len(gens)))
            while True:
                try:
                    index, delta = await anext(pairs)
                except StopAsyncIteration:
                    break
                except DeadlineExceeded:  # the status is sent: end the stream as aborted
                    for choice in gens:
                        choice.finish_reason = choice.finish_reason or "abort"
                    break
                except EngineError as exc:  # failed after the status was sent: say so in-stream
                    yield LastPiece(
                        held + _sse(error_body(exc.status_code, exc.message, exc.param, exc.code)) + DONE
                    )
                    return
                held += delta_events(index, delta)
                if held and delta.finish_reason is None:
                    yield held
                    held = b""
            final: dict[str, Any] = {"delta": {}} if shape.chat else {"text": ""}
            ending = b"".join(
                chunk(index, {**final, "finish_reason": choice.finish_reason})
                for index, choice in enumerate(gens[:-1])
            )
            ending += chunk(
                len(gens) - 1,
                {**final, "finish_reason": gens[-1].finish_reason},
                ragspeed=ragspeed_fields(gen),
            )
            if include_usage:
                ending += chunk(None, usage=usage(gens))
            yield LastPiece(held + ending + DONE)
        finally:
            await pairs.aclose()
            for deltas in streams:
                await deltas.aclose()  # aborts the engine requests if the client went away

    return SSEResponse(
        body(),
        headers={**timing_headers(gen), "cache-control": "no-cache", "x-accel-buffering": "no"},
    )
