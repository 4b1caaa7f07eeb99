"""SSEResponse's disconnect watch over raw ASGI: a client that leaves cancels the stream and
nothing else; any other cancel goes on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from ragspeed.gateway.streaming import LastPiece, SSEResponse

pytestmark = pytest.mark.anyio

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Body:
    """A body iterator that sends `pieces`, then waits on `more` for ever; records its close."""

    def __init__(self, *pieces: bytes):
        self.pieces = pieces
        self.closed = False
        self.more = asyncio.Event()

    async def __call__(self) -> AsyncIterator[bytes]:
        try:
            for piece in self.pieces:
                yield piece
            await self.more.wait()
        finally:
            self.closed = True


async def test_a_client_that_leaves_mid_stream_cancels_it_and_the_call_returns():
    body, sent = Body(b"a"), []
    left = asyncio.Event()

    async def receive() -> dict:
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message.get("body"))
        if message.get("body") == b"a":
            left.set()

    await SSEResponse(body())(SCOPE, receive, send)  # returns: the cancel was absorbed
    assert (sent, body.closed) == ([None, b"a"], True)
    await asyncio.sleep(0)  # no cancel left pending on this task


async def test_a_client_gone_before_the_start_gets_nothing():
    body, sent = Body(LastPiece(b"all")), []

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await SSEResponse(body())(SCOPE, receive, send)
    assert sent == []


async def test_another_cancel_goes_on():
    body = Body(b"a")
    stay = asyncio.Event()

    async def receive() -> dict:
        await stay.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    task = asyncio.create_task(SSEResponse(body())(SCOPE, receive, send))
    await asyncio.sleep(0.01)
    task.cancel()  # e.g. the server shutting down
    with pytest.raises(asyncio.CancelledError):
        await task
    assert body.closed
