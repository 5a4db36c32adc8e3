"""A lean HTTP/1.1 client for the upstream engine: one origin, a pool of kept-alive connections.

Why not aiohttp's client: a proxy's per-request CPU is its throughput, and ``ClientSession.post`` + ``read``
costs about 0.16 ms of CPU per request here (URL and header objects, timers, traces, payload and response
machinery), several times the rest of a relayed request. This client writes a request as one buffer and parses
the answer with ``httptools`` (llhttp, the parser uvicorn uses): about 0.035 ms. It does what an upstream needs
and nothing more:

- ``POST`` with a body of known length; ``http`` and ``https`` (TLS verified with the system's CAs); no proxies,
  no cookies, no redirects, no compression (none is asked for).
- Answers delimited by ``Content-Length``, chunked transfer encoding, or the end of the connection.
- Connections are reused while the server keeps them alive (``Connection: close`` and HTTP/1.0 are honoured);
  an idle connection older than ``keepalive_s``, or one the server closed, is dropped, never reused.
- Errors: ``ConnectFailed`` when no connection could be made (the request never left: safe to retry),
  ``TLSFailed``, ``TimeoutError`` when the answer (or, streaming, its next piece) is late, ``ConnectionLost`` when
  the connection ended before the answer did, ``ProtocolError`` for an answer that is not HTTP.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator

import httptools


class HTTPClientError(Exception):
    """Base of this client's errors."""


class ConnectFailed(HTTPClientError):
    """No connection: refused, unresolvable, or not made within the connect timeout. The request never left."""

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


class TLSFailed(HTTPClientError):
    """The TLS handshake failed (certificate not trusted, protocol mismatch)."""


class ConnectionLost(HTTPClientError):
    """The connection ended before the answer was complete."""


class ProtocolError(HTTPClientError):
    """The server answered something that is not an HTTP/1.x response."""


class _Connection(asyncio.Protocol):
    """One connection and the answer being read on it (one request at a time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.transport: asyncio.Transport | None = None
        self.loop = loop
        self.lost = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._reset(None)

    def _reset(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = False
        self.complete = False
        self.error: BaseException | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.head: asyncio.Future[None] | None = loop.create_future() if loop is not None else None
        self.waiter: asyncio.Future[None] | None = None
        self._eof_body = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream connection's transport: asyncio types the argument BaseTransport, and uvloop's transports are
        # Transports in behaviour but not by class (an isinstance check fails)
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ProtocolError(f"malformed HTTP response: {e}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.complete or self.head is None:
            return
        if self._eof_body and self.head.done():  # a body delimited by the end of the connection
            self.on_message_complete()
        else:
            self._fail(ConnectionLost("the upstream closed the connection before the answer was complete"))

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        self._eof_body = "content-length" not in self.headers and "chunked" not in self.headers.get(
            "transfer-encoding", "")
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # helpers

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, err: BaseException) -> None:
        if self.error is None:
            self.error = err
        if self.head is not None and not self.head.done():
            self.head.set_exception(err)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(err)


class Response:
    """An answer whose status line and headers are in; the body is read with ``read`` or ``iter_chunks``."""

    def __init__(self, pool: Pool, conn: _Connection) -> None:
        self._pool, self._conn = pool, conn
        self.status = conn.status
        self.headers = conn.headers  # names in lower case
        self.content_type = self.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        self.deadline: float | None = None  # time.monotonic() by which the whole answer is due, if set
        self._released = False

    async def _wait(self, timeout: float | None) -> None:
        """Until more of the body (or its end, or an error) arrives."""
        conn = self._conn
        if conn.error is not None:
            raise conn.error
        loop = conn.loop
        waiter = conn.waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _late, waiter)
        try:
            await waiter
        finally:
            conn.waiter = None
            if timer is not None:
                timer.cancel()

    async def _more(self, timeout: float | None) -> bool:
        """Wait for body bytes; ``False`` once the answer is complete and every byte was taken."""
        conn = self._conn
        while not conn.chunks:
            if conn.complete:
                return False
            await self._wait(timeout)
        return True

    async def read(self, timeout: float | None = None) -> bytes:
        """The whole body, within ``timeout`` seconds (and by ``deadline``, if set)."""
        conn = self._conn
        if self.deadline is not None:
            left = max(0.0, self.deadline - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        if not conn.complete:
            async with asyncio.timeout(timeout):
                while not conn.complete:
                    await self._wait(None)
        data = b"".join(conn.chunks)
        conn.chunks.clear()
        return data

    async def iter_chunks(self, timeout: float | None = None) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; ``TimeoutError`` if none come for ``timeout`` seconds."""
        conn = self._conn
        while await self._more(timeout):
            data = b"".join(conn.chunks)
            conn.chunks.clear()
            yield data

    def release(self) -> None:
        """Done with this answer: its connection goes back to the pool if it can carry another request."""
        if not self._released:
            self._released = True
            self._pool._put(self._conn)


class Pool:
    """Kept-alive connections to one origin (``scheme://host:port``)."""

    def __init__(self, scheme: str, host: str, port: int, *, connect_timeout: float, keepalive_s: float = 30.0,
                 max_idle: int = 64, resend_on_stale: bool = False) -> None:
        self.scheme, self.host, self.port = scheme, host, port
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        # a kept-alive connection the server closes as the request arrives (its idle timeout) ends before any byte
        # of an answer: send the request once more on a new connection. Only for servers where that cannot run a
        # request twice (an inference server Reef supervises closes only idle connections), never by default.
        self.resend_on_stale = resend_on_stale
        self.max_idle = max_idle
        default = 443 if scheme == "https" else 80
        self.host_header = host if port == default else f"{host}:{port}"
        if ":" in host and not host.startswith("["):  # an IPv6 literal
            self.host_header = f"[{host}]" if port == default else f"[{host}]:{port}"
        self._ssl: ssl.SSLContext | None = None
        self._idle: list[_Connection] = []
        self._closed = False

    async def request(self, head: bytes, body: bytes, *, timeout: float | None) -> tuple[Response, bool]:
        """Send ``head`` (request line and headers, up to the blank line) and ``body``; returns the response once
        its headers are in (within ``timeout``), and whether the connection was a new one."""
        conn = self._idle_connection()
        if conn is None:
            return await self._send(await self._connect(), head, body, timeout), True
        try:
            return await self._send(conn, head, body, timeout), False
        except ConnectionLost:
            if not self.resend_on_stale:
                raise
        return await self._send(await self._connect(), head, body, timeout), True

    async def _send(self, conn: _Connection, head: bytes, body: bytes, timeout: float | None) -> Response:
        loop = conn.loop  # not asyncio.get_running_loop(): on Python 3.11 that is a getpid() system call
        conn._reset(loop)
        assert conn.transport is not None and conn.head is not None
        conn.transport.write(head + body)
        timer = None if timeout is None else loop.call_later(timeout, _late, conn.head)
        try:
            await conn.head
        except BaseException:
            self._discard(conn)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return Response(self, conn)

    def _idle_connection(self) -> _Connection | None:
        """A kept-alive connection still open and not idle too long (the most recently used), else ``None``."""
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            transport = conn.transport
            if not conn.lost and transport is not None and not transport.is_closing() and \
                    now - conn.idle_since < self.keepalive_s:
                return conn
            self._discard(conn)
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        ssl_context = None
        if self.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ssl_context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), self.host, self.port, ssl=ssl_context,
                    server_hostname=self.host if ssl_context is not None else None,
                )
        except ssl.SSLError as e:
            raise TLSFailed(f"TLS error: {e}") from None
        except TimeoutError:
            raise ConnectFailed(f"no connection within {self.connect_timeout:g} s", timeout=True) from None
        except OSError as e:
            raise ConnectFailed(str(e) or type(e).__name__) from None
        return conn

    def _put(self, conn: _Connection) -> None:
        transport = conn.transport
        if (self._closed or not conn.complete or not conn.keep_alive or conn.lost or conn.chunks
                or transport is None or transport.is_closing() or len(self._idle) >= self.max_idle):
            self._discard(conn)
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    @staticmethod
    def _discard(conn: _Connection) -> None:
        if conn.transport is not None and not conn.lost:
            conn.transport.close()

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            self._discard(conn)


def _late(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


def header_lines(headers: dict[str, str]) -> str:
    """Header lines (each ending in CRLF); values that could end the header (CR, LF) are left out."""
    return "".join(f"{k}: {v}\r\n" for k, v in headers.items() if "\r" not in v and "\n" not in v)


def request_head(method: str, target: str, host: str, headers: str, length: int) -> bytes:
    """The request line and headers of one request (``headers`` from ``header_lines``), up to the blank line."""
    return f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n{headers}Content-Length: {length}\r\n\r\n".encode(
        "latin-1", "replace")


