"""A small pooled HTTP/1.1 client for the openai backend's one exchange: a POST of a JSON body
whose answer streams back.

It writes a request in one write (head and body together) and reads answers off a plain
asyncio protocol. On a machine of few cores a write that wakes another process is the dearest
thing a forwarded request does; a client that writes the head and the body apart wakes the
upstream twice.

What it speaks: keep-alive (a connection whose answer was read to its end goes back to the
pool, any other is closed: a cancelled or abandoned exchange never leaves a half-read answer
behind), bodies framed by `Content-Length`, chunked or by the connection's close, interim 1xx
answers skipped, `http` and `https`. Timeouts: connecting, and every wait for bytes (the head,
each piece of the body). Errors are `HTTPError`s: `ConnectError` when nothing was sent (safe to
repeat), `Timeout`, `RemoteProtocolError` for an upstream that closed early or broke the syntax.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from types import TracebackType
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024  # a status line, headers or a chunk-size line longer than this is refused


class HTTPError(Exception):
    """The exchange with the upstream failed."""


class ConnectError(HTTPError):
    """No connection: nothing was sent, so repeating the request is safe."""


class Timeout(HTTPError):
    pass


class ConnectTimeout(ConnectError, Timeout):
    pass


class ReadTimeout(Timeout):
    pass


class RemoteProtocolError(HTTPError):
    """The upstream closed the connection early or answered something that is not HTTP/1.1."""


def _expire(waiter: asyncio.Future[None], timeout_s: float) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimeout(f"no bytes from the upstream for {timeout_s:g} s"))


class Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: what arrives collects in `buffer`; `receive()` waits for
    more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False  # the upstream closed its side, or the connection was lost
        self.idle_since = 0.0  # monotonic seconds, while in the pool
        self.key: tuple[str, str, int] = ("", "", 0)  # (scheme, host, port): its pool's key
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def receive(self, timeout_s: float) -> None:
        """Until more bytes arrived or the upstream closed; ReadTimeout after `timeout_s`."""
        if self.closed:
            raise RemoteProtocolError("the upstream closed the connection mid-answer")
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _expire, waiter, timeout_s)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def take(self, num_bytes: int) -> bytes:
        data = bytes(self.buffer[:num_bytes])
        del self.buffer[:num_bytes]
        return data

    async def read_line(self, timeout_s: float, separator: bytes = b"\r\n") -> bytes:
        """The buffered bytes up to `separator` (taken with it, returned without)."""
        while True:
            end = self.buffer.find(separator)
            if end >= 0:
                return self.take(end + len(separator))[:end]
            if len(self.buffer) > MAX_HEAD_BYTES:
                raise RemoteProtocolError(f"a line of the answer's framing is over {MAX_HEAD_BYTES} bytes")
            await self.receive(timeout_s)


class Response:
    """The answer of one exchange: `status`, `headers` (names lowercased), the body as it
    arrives (`aiter_bytes()`) or whole (`aread()`). `complete` once the body was read to its
    end."""

    def __init__(self, connection: Connection, status: int, headers: dict[str, str], read_timeout_s: float):
        self.status_code = status
        self.headers = headers
        self.complete = False
        self.keep_alive = headers.get("connection", "").lower() != "close"
        self._connection = connection
        self._timeout_s = read_timeout_s

    async def aread(self) -> bytes:
        return b"".join([data async for data in self.aiter_bytes()])

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body in pieces: each is every byte of it that had arrived when it was taken, so
        a burst the upstream wrote at once comes out as one piece."""
        encoding = self.headers.get("transfer-encoding", "").lower()
        if encoding:
            if encoding.rsplit(",", 1)[-1].strip() != "chunked":
                self.keep_alive = False  # framed by the close (RFC 9112 6.3)
                return self._until_close()
            return self._chunked()
        length = self.headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                raise RemoteProtocolError(f"the answer's Content-Length is not a number: {length!r}")
            return self._sized(int(length))
        self.keep_alive = False
        return self._until_close()

    async def _sized(self, num_bytes: int) -> AsyncIterator[bytes]:
        connection, left = self._connection, num_bytes
        while left:
            if not connection.buffer:
                await connection.receive(self._timeout_s)
                continue
            data = connection.take(left)
            left -= len(data)
            yield data
        self.complete = True

    async def _until_close(self) -> AsyncIterator[bytes]:
        connection = self._connection
        while True:
            if connection.buffer:
                yield connection.take(len(connection.buffer))
            elif connection.closed:
                self.complete = True
                return
            else:
                try:
                    await connection.receive(self._timeout_s)
                except RemoteProtocolError:  # closed while waiting: that is the end here
                    pass

    async def _chunked(self) -> AsyncIterator[bytes]:
        """Chunk by chunk: `size-in-hex[;extensions]\\r\\n`, the data, `\\r\\n`; a size of 0
        ends the body, after optional trailer lines and an empty line."""
        connection, timeout_s = self._connection, self._timeout_s
        buffer = connection.buffer
        state, left = _SIZE, 0  # left: data bytes of the current chunk still to come
        pieces: list[bytes] = []
        while True:
            if state == _DATA and buffer:
                data = connection.take(left)
                pieces.append(data)
                left -= len(data)
                if not left:
                    state = _CRLF
                continue
            if state == _CRLF and len(buffer) >= 2:
                if connection.take(2) != b"\r\n":
                    raise RemoteProtocolError("a chunk of the answer does not end with CRLF")
                state = _SIZE
                continue
            end = buffer.find(b"\r\n") if state in (_SIZE, _TRAILER) else -1
            if end >= 0:
                line = connection.take(end + 2)[:end]
                if state == _TRAILER:
                    if not line:  # the empty line after the trailers: the body is whole
                        self.complete = True
                        if pieces:
                            yield b"".join(pieces)
                        return
                    continue
                left = _chunk_size(line)
                state = _DATA if left else _TRAILER
                continue
            # Nothing more to do with what is buffered: hand out what was decoded, then wait.
            if pieces:
                yield b"".join(pieces)
                pieces = []
                continue
            if len(buffer) > MAX_HEAD_BYTES:
                raise RemoteProtocolError(f"a line of the answer's framing is over {MAX_HEAD_BYTES} bytes")
            await connection.receive(timeout_s)


_SIZE, _DATA, _CRLF, _TRAILER = range(4)  # where a chunked body's decoder is


def _chunk_size(line: bytes) -> int:
    digits = line.split(b";", 1)[0].strip()
    if not digits or digits.strip(b"0123456789abcdefABCDEF"):
        raise RemoteProtocolError(f"a chunk size of the answer is not hexadecimal: {digits[:40]!r}")
    return int(digits, 16)


class Exchange:
    """`async with pool.post(url, body) as response:` one request and its answer. Leaving the
    block returns the connection to the pool if the answer was read to its end and may be
    followed by another; else (an error, a cancel, a body left unread) closes it."""

    def __init__(self, pool: ConnectionPool, url: str, body: bytes):
        self._pool, self._url, self._body = pool, url, body
        self._connection: Connection | None = None
        self._response: Response | None = None

    async def __aenter__(self) -> Response:
        pool = self._pool
        parts = urlsplit(self._url)
        key = (parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
        connection = self._connection = pool.checkout(key) or await pool.connect(key)
        head = (
            f"POST {parts.path or '/'} HTTP/1.1\r\nhost: {parts.netloc}\r\n{pool.header_lines}"
            f"content-type: application/json\r\ncontent-length: {len(self._body)}\r\n\r\n"
        )
        try:
            connection.write(head.encode("latin-1") + self._body)  # one write: one wake-up upstream
            self._response = await _read_head(connection, pool.read_timeout_s)
        except BaseException:  # a timeout, a broken answer, a cancel: `__aexit__` will not run
            connection.close()
            raise
        return self._response

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        connection, response = self._connection, self._response
        if connection is None:
            return
        if exc_type is None and response is not None and response.complete and response.keep_alive:
            self._pool.checkin(connection)
        else:
            connection.close()


async def _read_head(connection: Connection, timeout_s: float) -> Response:
    while True:
        head = await connection.read_line(timeout_s, b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        version, _, rest = status_line.partition(" ")
        status = rest[:3]
        if not version.startswith("HTTP/1.") or not status.isdigit():
            raise RemoteProtocolError(f"the upstream's answer is not HTTP/1.1: {status_line[:80]!r}")
        if not 100 <= int(status) < 200:  # an interim answer (100 Continue) is followed by the real one
            break
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    response = Response(connection, int(status), headers, timeout_s)
    if version == "HTTP/1.0":
        response.keep_alive = headers.get("connection", "").lower() == "keep-alive"
    if response.status_code in (204, 304):
        response.headers["content-length"] = "0"  # never a body
    return response


class ConnectionPool:
    """Idle keep-alive connections by (scheme, host, port), newest first. Connections are
    opened as requests need them (the gateway's admission bounds the requests in flight); at
    most `max_idle` of each upstream are kept, none idle longer than `keepalive_s` (upstreams
    close idle connections themselves: uvicorn after 5 s)."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        headers: dict[str, str] | None = None,
        max_idle: int = 100,
        keepalive_s: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
    ):
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.header_lines = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        self.max_idle, self.keepalive_s = max_idle, keepalive_s
        self._ssl_context = ssl_context
        self._idle: dict[tuple[str, str, int], list[Connection]] = {}
        self.num_connects = 0

    def post(self, url: str, body: bytes) -> Exchange:
        return Exchange(self, url, body)

    def checkout(self, key: tuple[str, str, int]) -> Connection | None:
        """An idle connection still fit to reuse, or None."""
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            # Closed by the upstream, or holding bytes nobody asked for: not reusable.
            if connection.closed or connection.buffer or now - connection.idle_since > self.keepalive_s:
                connection.close()
                continue
            return connection
        return None

    def checkin(self, connection: Connection) -> None:
        key = connection.key
        idle = self._idle.setdefault(key, [])
        if connection.closed or connection.buffer or len(idle) >= self.max_idle:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    async def connect(self, key: tuple[str, str, int]) -> Connection:
        scheme, host, port = key
        if scheme not in ("http", "https"):
            raise ConnectError(f"the scheme {scheme!r} is not http or https")
        context = None
        if scheme == "https":
            context = self._ssl_context or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(
                    Connection, host, port, ssl=context, server_hostname=host if context else None
                )
        except TimeoutError:  # before OSError: it is one
            raise ConnectTimeout(
                f"connecting to {host}:{port} took over {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
        self.num_connects += 1
        connection.key = key
        return connection

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
