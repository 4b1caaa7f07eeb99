"""The openai backend's HTTP/1.1 client against scripted servers: framing (chunked, sized, to
the close), keep-alive, and what it does with connections that fail, time out or are
abandoned."""

from __future__ import annotations

import asyncio
import socket

import pytest

from ragspeed.engine.backends.remote.http11 import (
    ConnectError,
    ConnectionPool,
    ReadTimeout,
    RemoteProtocolError,
    Response,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


BODY = b'data: {"text":"Hello"}\n\ndata: [DONE]\n\n'
CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"17;ext=1\r\n" + BODY[:23] + b"\r\n" + b"f\r\n" + BODY[23:] + b"\r\n" + b"0\r\nx-trailer: 1\r\n\r\n"
)
WIRE_BODY = CHUNKED[CHUNKED.index(b"\r\n\r\n") + 4 :]  # the chunked framing of BODY


class Scripted:
    """A server that answers every request on a connection with the next of `answers` (written
    in one go), records the requests' bytes and counts its connections."""

    def __init__(self, answers: list[bytes], close_after: bool = False):
        self.answers, self.close_after = answers, close_after
        self.requests: list[bytes] = []
        self.num_connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if not answer:  # silent: holds the connection until the client leaves
                    await reader.read()
                writer.write(answer)
                if self.close_after:
                    break
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def pool(**kwargs) -> ConnectionPool:
    return ConnectionPool(connect_timeout_s=1.0, read_timeout_s=kwargs.pop("read_timeout_s", 1.0), **kwargs)


async def exchange(client: ConnectionPool, url: str) -> tuple[int, dict[str, str], bytes]:
    async with client.post(f"{url}/v1/completions", b'{"a":1}') as response:
        return response.status_code, response.headers, await response.aread()


async def test_the_request_goes_out_whole_and_a_chunked_answer_comes_back_whole():
    server = Scripted([CHUNKED])
    async with server as url:
        client = pool(headers={"authorization": "Bearer k"})
        status, headers, body = await exchange(client, url)
        client.close()
    assert (status, headers["content-type"], body) == (200, "text/event-stream", BODY)
    port = url.rsplit(":", 1)[1]
    assert server.requests == [
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nauthorization: Bearer k\r\n"
        f"content-type: application/json\r\ncontent-length: 7\r\n\r\n"
        '{"a":1}'.encode()
    ]


class FakeConnection:
    def __init__(self) -> None:
        self.buffer = bytearray()
        self.closed = False
        self.arrivals: asyncio.Queue[bytes] = asyncio.Queue()

    async def receive(self, timeout_s: float) -> None:
        self.buffer += await self.arrivals.get()

    def take(self, num_bytes: int) -> bytes:
        data = bytes(self.buffer[:num_bytes])
        del self.buffer[:num_bytes]
        return data


@pytest.mark.parametrize("cut", range(1, len(WIRE_BODY)))
async def test_a_chunked_body_cut_anywhere_decodes_to_the_same_bytes(cut):
    wire = WIRE_BODY
    connection = FakeConnection()
    response = Response(connection, 200, {"transfer-encoding": "chunked"}, 1.0)  # type: ignore[arg-type]
    connection.arrivals.put_nowait(wire[:cut])
    connection.arrivals.put_nowait(wire[cut:])
    pieces = [piece async for piece in response.aiter_bytes()]
    assert b"".join(pieces) == BODY
    assert response.complete and connection.buffer == b""


async def test_what_arrived_in_one_read_comes_out_as_one_piece():
    connection = FakeConnection()
    response = Response(connection, 200, {"transfer-encoding": "chunked"}, 1.0)  # type: ignore[arg-type]
    connection.arrivals.put_nowait(b"2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n")
    assert [piece async for piece in response.aiter_bytes()] == [b"abcde"]


@pytest.mark.parametrize("size", [b"zz", b"-1", b"+1", b""])
async def test_a_chunk_size_that_is_not_hex_is_a_protocol_error(size):
    connection = FakeConnection()
    response = Response(connection, 200, {"transfer-encoding": "chunked"}, 1.0)  # type: ignore[arg-type]
    connection.arrivals.put_nowait(size + b"\r\nab\r\n0\r\n\r\n")
    with pytest.raises(RemoteProtocolError, match="not hexadecimal"):
        [piece async for piece in response.aiter_bytes()]


async def test_keep_alive_reuses_one_connection_for_sized_and_chunked_answers():
    sized = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 5\r\n\r\nnope!"
    server = Scripted([CHUNKED, sized, CHUNKED])
    async with server as url:
        client = pool()
        answers = [await exchange(client, url) for _ in range(3)]
        client.close()
    assert [(status, body) for status, _, body in answers] == [(200, BODY), (400, b"nope!"), (200, BODY)]
    assert (server.num_connections, client.num_connects) == (1, 1)


async def test_connection_close_and_a_body_framed_by_the_close_are_not_reused():
    close = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"
    until_close = b"HTTP/1.0 200 OK\r\n\r\nthe rest"
    server = Scripted([close, until_close, CHUNKED], close_after=True)
    async with server as url:
        client = pool()
        answers = [await exchange(client, url) for _ in range(3)]
        client.close()
    assert [body for _, _, body in answers] == [b"ok", b"the rest", BODY]
    assert client.num_connects == 3


async def test_an_interim_answer_is_skipped_and_204_has_no_body():
    server = Scripted([b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", CHUNKED])
    async with server as url:
        client = pool()
        first = await exchange(client, url)
        second = await exchange(client, url)
        client.close()
    assert (first[0], first[2], second[2]) == (204, b"", BODY)
    assert client.num_connects == 1


async def test_an_abandoned_or_cancelled_answer_closes_its_connection():
    unended = CHUNKED[: CHUNKED.index(b"0\r\nx-trailer")]  # the rest would come later
    server = Scripted([unended, CHUNKED, CHUNKED])
    async with server as url:
        client = pool()
        async with client.post(f"{url}/v1/completions", b"{}") as response:
            pieces = response.aiter_bytes()
            assert await anext(pieces) == BODY  # the consumer leaves before the body's end
        await pieces.aclose()

        async def read_forever() -> None:
            async with client.post(f"{url}/v1/completions", b"{}"):
                await asyncio.sleep(3600)

        task = asyncio.create_task(read_forever())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert (await exchange(client, url))[2] == BODY
        client.close()
    assert client.num_connects == 3  # neither half-read connection went back to the pool


async def test_a_silent_upstream_times_out_and_a_dead_one_refuses():
    server = Scripted([b""])  # takes the request, never answers
    async with server as url:
        client = pool(read_timeout_s=0.1)
        with pytest.raises(ReadTimeout, match="no bytes from the upstream for 0.1 s"):
            await exchange(client, url)
        client.close()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    with pytest.raises(ConnectError, match=f"cannot connect to 127.0.0.1:{dead_port}"):
        await exchange(pool(), f"http://127.0.0.1:{dead_port}")


async def test_an_upstream_that_closes_mid_body_is_a_protocol_error_and_a_stale_connection_is_not_reused():
    cut = CHUNKED[: len(CHUNKED) - 20]
    server = Scripted([cut], close_after=True)
    async with server as url:
        client = pool()
        with pytest.raises(RemoteProtocolError, match="closed the connection mid-answer"):
            await exchange(client, url)
    sized = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    server = Scripted([sized, sized], close_after=True)  # answers once, then closes the connection
    async with server as url:
        client = pool()
        assert (await exchange(client, url))[2] == b"ok"
        await asyncio.sleep(0.05)  # the close arrives while the connection is idle in the pool
        assert (await exchange(client, url))[2] == b"ok"
        client.close()
    assert client.num_connects == 2
