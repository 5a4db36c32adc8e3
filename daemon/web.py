"""The daemon's HTTP/1.1 server: ``httptools`` (llhttp) on ``uvloop`` transports, routes, responses, drain.

Why not aiohttp's server: Reef is a proxy, and a proxy's CPU per request is its throughput. aiohttp's request,
response, router and middleware objects cost about as much CPU per request as all of Reef's own serve path, and
on a machine the client and the upstream share, that CPU is taken from them. This server does what the daemon's
routes need and nothing more, in the way uvicorn's httptools protocol does:

- Requests: ``Content-Length`` or chunked bodies (trailers ignored), keep-alive (HTTP/1.1 by default, HTTP/1.0
  when asked), pipelined requests answered in order; a head over ``MAX_HEAD_BYTES`` is a 431 (bounded before
  httptools buffers it), a malformed request, an Upgrade or a CONNECT a 400, all closing the connection. A body
  over the limit is refused as soon as it is declared (413, before any of it is read) or, when chunked, as soon
  as it passes the limit; a broken chunked body makes ``Request.read`` raise ``MalformedBody``.
- The handler of a request starts once its head is in; ``Request.read`` waits for the body (and sends
  ``100 Continue`` first when the client asked for it).
- Responses: ``Response`` (one write: head and body) or ``StreamResponse`` (chunked; close-delimited for an
  HTTP/1.0 client), with flow control: a stream write waits while the client's socket buffer is full, and the
  next pipelined request waits until the last answer drained. A client that left makes the next stream write
  raise ``ConnectionResetError``; handlers are never cancelled by a disconnect, except inside
  ``Request.watch()``: there the client leaving cancels the handler's task and the block raises ``ClientGone``
  (the serve path stops generating for a client that went away, and records it). An answer given before the body was all in ends the connection with a lingering close, so that
  the client reads it instead of a reset.
- Idle connections close after ``KEEPALIVE_S`` (checked once a second); a head that does not arrive within it
  closes the connection too.
- ``Server.shutdown``: stop accepting, close idle connections, let in-flight requests finish (up to a timeout),
  then cancel what is left and close everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote

import httptools

if TYPE_CHECKING:
    import ssl as ssl_module

KEEPALIVE_S = 75.0
CROWDED_KEEPALIVE_S = 5.0  # idle keep-alive when connections pass three quarters of the bound
MAX_HEAD_BYTES = 64 * 1024
JOIN_OFF_LOOP_BYTES = 1 << 20  # a body larger than this is joined from its chunks in a worker thread

_REASONS = {s.value: s.phrase for s in HTTPStatus}


class Headers(dict[str, str]):
    """Request headers: names in lower case, looked up case-insensitively; repeated ones joined by ', '."""

    def get(self, name: str, default: Any = None) -> Any:
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name.lower() if isinstance(name, str) else name)


class BodyTooLarge(Exception):
    """``Request.read``: the body passed the limit."""


class Request:
    """One request: method, path, query, headers and a body that ``read`` waits for."""

    __slots__ = ("method", "path", "query_string", "headers", "version", "ctx", "match_info", "route",
                 "content_length", "over_unix", "keep_alive", "expect_continue", "_conn", "_query", "_chunks",
                 "_size", "_limit", "_complete", "_error", "_waiter")

    def __init__(self, method: str, target: bytes, headers: Headers, version: str, conn: _Connection, ctx: Any,
                 limit: int, over_unix: bool) -> None:
        raw_path, _, query = target.partition(b"?")
        self.method = method
        self.path = unquote(raw_path.decode("latin-1")) if b"%" in raw_path else raw_path.decode("latin-1")
        self.query_string = query.decode("latin-1")
        self.headers = headers
        self.version = version
        self._conn = conn
        self.ctx = ctx
        self.match_info: dict[str, str] = {}
        self.route = "unmatched"
        length = headers.get("content-length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self.over_unix = over_unix
        self.keep_alive = True  # the client's wish (HTTP/1.1 unless "Connection: close"; HTTP/1.0 if it asks)
        # "Expect: 100-continue" (HTTP/1.1): answered when the handler first reads the body, not before (a request
        # refused by its head never has its body sent; a pipelined one never interrupts the answer before it)
        self.expect_continue = version == "1.1" and headers.get("expect", "").lower() == "100-continue"
        self._query: dict[str, str] | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._limit = limit
        self._complete = False
        self._error: BaseException | None = None  # why the body cannot be had: raised by every read
        self._waiter: asyncio.Future[None] | None = None

    @property
    def query(self) -> dict[str, str]:
        """The query parameters, percent-decoded (the first of a repeated name)."""
        if self._query is None:
            q: dict[str, str] = {}
            for k, v in parse_qsl(self.query_string, keep_blank_values=True):
                q.setdefault(k, v)
            self._query = q
        return self._query

    def watch(self) -> _Watch:
        """A block in which the client leaving cancels the current task and raises ``ClientGone``: wrap what may
        take long for nothing once the client is gone (generating an answer)."""
        return _Watch(self._conn)

    @property
    def gone(self) -> bool:
        """The client closed the connection."""
        return self._conn.lost

    @property
    def body_complete(self) -> bool:
        """All of the body is in, or it never will be: ``read`` answers without waiting."""
        return self._complete

    async def read(self) -> bytes:
        """The whole body. Raises ``BodyTooLarge`` past the limit, ``MalformedBody`` when its framing is broken and
        ``ConnectionResetError`` when the client left before sending all of it (every time it is called)."""
        if not self._complete:
            if self.expect_continue:
                self.expect_continue = False
                self._conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if self._waiter is None:
                self._waiter = self._conn._loop.create_future()
            await asyncio.shield(self._waiter)
        if self._error is not None:
            raise self._error
        if len(self._chunks) > 1:  # joined once (a second read gets the same bytes); a big body in a thread:
            # bytes.join lets go of the GIL past 1 MB, and on the loop 64 MB took 90 ms
            chunks = self._chunks
            body = await asyncio.to_thread(b"".join, chunks) if self._size > JOIN_OFF_LOOP_BYTES else b"".join(chunks)
            self._chunks = [body]
        return self._chunks[0] if self._chunks else b""

    # fed by the connection

    def _feed(self, data: bytes) -> None:
        if self._complete:
            return
        self._size += len(data)
        if self._size > self._limit:
            self._chunks.clear()
            self._finish(BodyTooLarge())
        else:
            self._chunks.append(data)

    def _finish(self, error: BaseException | None = None) -> None:
        if self._complete:
            return
        self._complete = True
        self._error = error
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class ClientGone(ConnectionResetError):
    """The client closed its connection while its request was being answered (raised by ``Request.watch``)."""


class _Watch:
    """``Request.watch()``: within the block, the client leaving cancels the task running it; the block then raises
    ``ClientGone`` (whatever the cancellation became inside it) and the task is not left cancelled. One task per
    connection serves its requests in turn, and ``connection_lost`` runs only while that task waits inside the
    block, so the cancellation always lands there."""

    __slots__ = ("conn", "task", "fired")

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.task: asyncio.Task[Any] | None = None
        self.fired = False

    def __enter__(self) -> _Watch:
        if self.conn.lost:
            raise ClientGone("the client closed the connection")
        self.task = asyncio.current_task()
        self.conn.watch = self
        return self

    def fire(self) -> None:
        if self.task is not None and not self.fired:
            self.fired = True
            self.task.cancel()

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> None:
        if self.conn.watch is self:
            self.conn.watch = None
        task, self.task = self.task, None
        if self.fired:
            if task is not None:
                task.uncancel()
            raise ClientGone("the client closed the connection") from exc


class MalformedBody(Exception):
    """``Request.read``: the body's framing is broken (a bad chunk size, oversized trailers)."""


class Response:
    """A whole response, written at once."""

    __slots__ = ("body", "status", "headers", "close")

    def __init__(self, body: bytes = b"", status: int = 200, content_type: str | None = "application/json",
                 headers: dict[str, str] | None = None, close: bool = False) -> None:
        self.body = body
        self.status = status
        self.headers = headers if headers is not None else {}
        if content_type is not None:
            self.headers["Content-Type"] = content_type
        self.close = close  # close the connection after this response


def _head(status: int, headers: dict[str, str], extra: str) -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if "\r" not in v and "\n" not in v)
    return f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n{lines}{extra}\r\n".encode("latin-1", "replace")


class StreamResponse:
    """A response written piece by piece (server-sent events): chunked, or close-delimited for HTTP/1.0."""

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None, *,
                 send_buffer: int | None = None) -> None:
        self.status = status
        self.headers = headers if headers is not None else {}
        self._send_buffer = send_buffer  # bytes the kernel and the transport may hold unsent (None: their default)
        self._conn: _Connection | None = None
        self._chunked = True
        self._head_only = False
        self.finished = False

    async def prepare(self, request: Request) -> None:
        conn = self._conn = request._conn
        conn.responded = True
        if self._send_buffer is not None:
            conn.limit_send_buffer(self._send_buffer)
        self._chunked = request.version != "1.0"
        self._head_only = request.method == "HEAD"
        if not self._chunked:
            conn.close_after = True
        extra = "Transfer-Encoding: chunked\r\n" if self._chunked else ""
        if not self._chunked or not request.keep_alive or conn.close_after:
            extra += "Connection: close\r\n"
        conn.write(_head(self.status, self.headers, extra))

    async def write(self, data: bytes) -> None:
        conn = self._conn
        assert conn is not None, "prepare() first"
        if conn.lost:
            raise ConnectionResetError("the client closed the connection")
        if self._head_only:  # the head is the whole answer to HEAD: a stream's producer stops here
            raise ConnectionResetError("HEAD: the answer has no body")
        if not data:
            return
        conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        if conn.paused:
            await conn.drain()

    def abort(self) -> None:
        """Close the connection at once, unsent data and all (a client that stopped reading holds it otherwise)."""
        if self._conn is not None and not self._conn.lost:
            sock = self._conn.transport.get_extra_info("socket")
            if sock is not None:  # linger 0: a reset, not a FIN queued behind unsent data the client never takes
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self._conn.transport.abort()

    async def write_eof(self) -> None:
        conn = self._conn
        assert conn is not None
        if self.finished:
            return
        self.finished = True
        if self._chunked and not self._head_only and not conn.lost:
            conn.write(b"0\r\n\r\n")


Handler = Callable[[Request], Awaitable["Response | StreamResponse"]]


class Router:
    """Routes by method and path; ``{name}`` matches one path segment (``Request.match_info[name]``)."""

    def __init__(self) -> None:
        self._static: dict[str, dict[str, Handler]] = {}
        self._dynamic: list[tuple[re.Pattern[str], str, dict[str, Handler]]] = []

    def add(self, method: str, pattern: str, handler: Handler) -> None:
        if "{" not in pattern:
            self._static.setdefault(pattern, {})[method] = handler
            return
        for _, pat, methods in self._dynamic:
            if pat == pattern:
                methods[method] = handler
                return
        rx = re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", pattern) + "$")
        self._dynamic.append((rx, pattern, {method: handler}))

    def routes(self) -> list[tuple[str, str]]:
        """Every ``(method, pattern)`` added, fixed paths first (``HEAD`` only where added: a ``GET`` route answers
        ``HEAD`` too): what ``daemon/openapi.py`` describes."""
        out = [(m, pattern) for pattern, methods in self._static.items() for m in methods]
        out += [(m, pattern) for _, pattern, methods in self._dynamic for m in methods]
        return out

    def resolve(self, request: Request) -> Handler | None:
        """The handler, with ``match_info`` and ``route`` set; ``None`` when nothing matches the path. A path that
        matches without the method gives ``MethodNotAllowed``."""
        path = request.path
        methods = self._static.get(path)
        if methods is not None:
            request.route = path
        else:
            for rx, pattern, candidates in self._dynamic:
                m = rx.match(path)
                if m is not None:
                    request.match_info = m.groupdict()
                    request.route = pattern
                    methods = candidates
                    break
            else:
                return None
        handler = methods.get(request.method)
        if handler is None and request.method == "HEAD":
            handler = methods.get("GET")
        if handler is None:
            raise MethodNotAllowed(request.method, sorted(methods))
        return handler


class MethodNotAllowed(Exception):
    def __init__(self, method: str, allowed: list[str]) -> None:
        super().__init__(f"{method} is not allowed here (allowed: {', '.join(allowed)})")


class ProtocolFailure(Exception):
    """A request that is not HTTP/1.x, or one whose head is too large (``status``)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs their handlers in order, writes the answers."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: Any = None
        self.lost = False
        self.paused = False
        self.close_after = False  # answer what is in flight, then close (shutdown, a broken body, HTTP/1.0 stream)
        self.responded = False  # the current request's answer has started
        self.watch: _Watch | None = None  # the block a lost connection cancels (``Request.watch``)
        self._refusal: bytes | None = None  # a malformed request after those in flight: answered after them
        self._drain: asyncio.Future[None] | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers = Headers()
        self._head_bytes = 0
        self._in_head = False  # between the start of a message and the end of its head
        self._began = False  # a message began during the current data_received
        self._unparsed = 0
        self._failure: ProtocolFailure | None = None
        self._lingering = False
        self._current: Request | None = None  # the request whose body is being parsed
        self._queue: deque[Request] = deque()  # parsed heads waiting for their turn (pipelining)
        # one task per connection serves its requests in turn (a task per request cost more: creation and
        # asyncio's registry of tasks); ``busy`` from the moment a request is handed to it until it is answered
        self._worker: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self.busy = False
        self.idle_since: float | None = None  # waiting for a request's head since (None: a request is in)
        self._over_unix = False
        self._loop = server.loop

    # --- asyncio.Protocol ---------------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        self._over_unix = sock is not None and sock.family == socket.AF_UNIX
        self.server.connections.add(self)
        self.idle_since = self._loop.time()
        if not self.server.admit(self):
            transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        if self.watch is not None:
            self.watch.fire()
        if self._current is not None:
            self._current._finish(ConnectionResetError("the client closed the connection mid-body"))
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))
        self._queue.clear()
        if self.busy:  # a handler still runs (nothing cancels it): shutdown waits for it like any other
            return
        self.server.connections.discard(self)
        if self._worker is not None:
            self._worker.cancel()

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # refused: what the client still sends is read and dropped
            return
        self._began = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            failure = self._failure or e.__context__
            if isinstance(failure, ProtocolFailure):
                self._refuse(failure.status, str(failure))
            elif isinstance(e, httptools.HttpParserUpgrade):
                self._refuse(400, "protocol upgrades are not supported")
            else:
                self._refuse(400, f"malformed HTTP request: {e}")
            return
        # httptools buffers a header until it is whole: bound a head that never ends here. A read in which the
        # head began is not counted (part of it may be what came before), so a head holds at most the limit + one
        # read; every later read of a head still unfinished is head through and through.
        if self._in_head and not self._began:
            self._unparsed += len(data)
            if self._unparsed > MAX_HEAD_BYTES:
                self._refuse(431, f"request head over {MAX_HEAD_BYTES} bytes")

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def drain(self) -> None:
        """Until the client has taken what was written (raises ``ConnectionResetError`` if it left)."""
        if self.paused and not self.lost:
            if self._drain is None or self._drain.done():
                self._drain = self._loop.create_future()
            await asyncio.shield(self._drain)

    def write(self, data: bytes) -> None:
        if not self.lost:
            self.transport.write(data)

    def limit_send_buffer(self, size: int) -> None:
        """Hold at most about ``size`` unsent bytes in the kernel and as much again in the transport, so that a
        client that stops reading makes ``drain`` wait soon (the kernel's own sizing lets megabytes pile up)."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        self.transport.set_write_buffer_limits(high=size)

    # --- httptools callbacks ------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = Headers()
        self._head_bytes = 0
        self._in_head = True
        self._began = True
        self._unparsed = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._fail(ProtocolFailure("request line too long", 431))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            self._fail(ProtocolFailure(f"request head over {MAX_HEAD_BYTES} bytes", 431))
        if not self._in_head:
            return  # a chunked body's trailers: not headers of the request (its guards have run)
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        old = dict.get(self._headers, key)
        dict.__setitem__(self._headers, key, text if old is None else f"{old}, {text}")

    def _fail(self, failure: ProtocolFailure) -> None:
        """Stop parsing (httptools wraps what a callback raises; ``data_received`` finds it here)."""
        self._failure = failure
        raise failure

    def on_headers_complete(self) -> None:
        self.idle_since = None
        self._in_head = False
        parser = self._parser
        if parser.should_upgrade():  # CONNECT, or an Upgrade: there is no other protocol here
            self._fail(ProtocolFailure("protocol upgrades (and CONNECT) are not supported"))
        request = Request(parser.get_method().decode("latin-1"), self._url, self._headers,
                          parser.get_http_version(), self, self.server.ctx, self.server.max_body,
                          self._over_unix)
        request.keep_alive = parser.should_keep_alive()  # read now: the parser forgets it once the message ends
        self._current = request
        self._queue.append(request)
        if self.busy:  # pipelined behind one in flight: no more reading until it is answered
            self.transport.pause_reading()
            return
        self.busy = True
        if self._worker is None:
            self._worker = self._loop.create_task(self._work())
        elif self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self._current is not None:
            self._current._feed(body)

    def on_message_complete(self) -> None:
        request, self._current = self._current, None
        if request is not None:
            request._finish()

    # --- serving ------------------------------------------------------------------------------------------

    async def _work(self) -> None:
        try:
            while True:
                if not self._queue:
                    self._wakeup = self._loop.create_future()
                    await self._wakeup
                    self._wakeup = None
                    if not self._queue:  # woken by a connection that went away meanwhile
                        return
                request = self._queue.popleft()
                keep = await self._serve(request)
                if self.paused and not self.lost:  # the client is not reading: no next answer until it does
                    await self.drain()
                # a request answered before all of its body was in (a 413, a refusal by its head) leaves bytes that
                # cannot be skipped safely: the connection ends too (lingering: the client still gets the answer)
                if not keep or self.close_after or self.lost or not request.keep_alive or not request._complete:
                    self._linger()
                    return
                if self._queue:
                    if len(self._queue) == 1 and self._refusal is None:
                        self.transport.resume_reading()
                    continue
                self.busy = False
                if self._refusal is not None:
                    self.write(self._refusal)
                    self._linger()
                    return
                self.idle_since = self._loop.time()
        except ConnectionResetError:
            pass
        finally:
            if self.busy:
                self.busy = False
                self._close()
            if self.lost:
                self.server.connections.discard(self)

    async def _serve(self, request: Request) -> bool:
        """Answer one request; whether the connection may stay open."""
        close = False
        self.responded = False
        try:
            response = await self.server.handler(request)
            if isinstance(response, StreamResponse):
                await response.write_eof()
                close = not response._chunked
            else:
                close = response.close
                self._send(request, response)
        except Exception:  # the handler maps its errors to responses: anything here is a bug or a lost client
            close = True
            if not self.lost:
                self.server.log_exception(request)
                if not self.responded:
                    self.write(self.server.refusal(500, "internal error"))
        return not close

    def _send(self, request: Request, response: Response) -> None:
        body = response.body
        extra = f"Content-Length: {len(body)}\r\n"
        if response.close or not request.keep_alive or not request._complete or self.close_after:
            extra += "Connection: close\r\n"
        elif request.version == "1.0":
            extra += "Connection: keep-alive\r\n"
        head = _head(response.status, response.headers, extra)
        self.responded = True
        self.write(head if request.method == "HEAD" else head + body)

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that could not be parsed and close; after the requests before it, if any."""
        current = self._current
        if current is not None and not current._complete:
            # the body of a request already handed on is broken: its handler's read says so (400), then close
            current._finish(MalformedBody(message))
            self.close_after = True
            if not self.lost:
                self.transport.pause_reading()
            return
        if not self.busy:
            self.write(self.server.refusal(status, message))
            self._linger()
        else:
            self._refusal = self.server.refusal(status, message)
            if not self.lost:
                self.transport.pause_reading()

    def _linger(self) -> None:
        """Close without losing the last answer: closing a socket with unread input resets the connection, and
        the client may never see the answer. So: end our side, drop the client's further bytes for up to two
        seconds (or until it closes), then close."""
        self._lingering = True
        self.busy = False
        if self.lost or self.transport.is_closing():
            return
        try:
            self.transport.resume_reading()  # keep taking (and dropping) what the client sends
            self.transport.write_eof()
        except (NotImplementedError, OSError, RuntimeError):
            self._close()
            return
        self._loop.call_later(2.0, self._close)

    def _close(self) -> None:
        if not self.lost and not self.transport.is_closing():
            self.transport.close()


class Server:
    """Serves ``handler`` on listening sockets. ``ctx`` is handed to every request (``Request.ctx``);
    ``refusal(status, message)`` renders the JSON body answering a request refused before it reached a handler."""

    def __init__(self, handler: Handler, *, ctx: Any, max_body: int, refusal: Callable[[int, str], bytes],
                 log_exception: Callable[[Request], None], keepalive_s: float = KEEPALIVE_S,
                 max_connections: int = 4096) -> None:
        self.handler = handler
        # open connections at most: past it, the connections idle longest are closed to make room (a client
        # holding many idle keep-alive connections cannot use up the daemon's file descriptors and shut others
        # out); when none is idle, the new one is closed. Past three quarters of it, idle ones last 5 s.
        self.max_connections = max(1, max_connections)
        self.ctx = ctx
        self.max_body = max_body
        self.keepalive_s = keepalive_s
        self._refusal_body = refusal
        self.log_exception = log_exception
        self.connections: set[_Connection] = set()
        self.loop = asyncio.get_running_loop()
        self._servers: list[asyncio.AbstractServer] = []
        # one sweep a second closes idle connections (a timer per request cost more than the sweep)
        self._sweeper = self.loop.call_later(1.0, self._sweep)

    def admit(self, new: _Connection) -> bool:
        """Room for ``new`` within ``max_connections``, closing the connections idle longest; False: none is idle,
        and ``new`` is closed instead."""
        over = len(self.connections) - self.max_connections
        if over <= 0:
            return True
        idle = sorted((c for c in self.connections if c is not new and not c.busy and c.idle_since is not None
                       and not c.lost), key=lambda c: c.idle_since or 0.0)
        for conn in idle[:over]:
            conn._close()
            self.connections.discard(conn)
        if len(self.connections) > self.max_connections:
            self.connections.discard(new)
            return False
        return True

    def _sweep(self) -> None:
        now = self.loop.time()
        crowded = len(self.connections) > self.max_connections * 3 // 4
        keepalive = min(self.keepalive_s, CROWDED_KEEPALIVE_S) if crowded else self.keepalive_s
        for conn in list(self.connections):
            if not conn.busy and conn.idle_since is not None and now - conn.idle_since > keepalive:
                conn._close()
        self._sweeper = self.loop.call_later(min(1.0, self.keepalive_s / 2), self._sweep)

    def refusal(self, status: int, message: str) -> bytes:
        """A whole response (closing the connection) for a request that never reached the handler."""
        body = self._refusal_body(status, message)
        extra = f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        return _head(status, {"Content-Type": "application/json"}, extra) + body

    async def listen(self, sock: socket.socket, ssl: ssl_module.SSLContext | None = None) -> None:
        """Serve connections on ``sock``; with ``ssl``, TLS on each (a TCP socket's: daemon/listening.py)."""
        factory = lambda: _Connection(self)  # noqa: E731
        if sock.family == socket.AF_UNIX:
            server = await self.loop.create_unix_server(factory, sock=sock)
        else:
            server = await self.loop.create_server(factory, sock=sock, ssl=ssl)
        self._servers.append(server)

    async def shutdown(self, timeout: float) -> None:
        """Stop accepting; close idle connections; wait up to ``timeout`` for requests in flight; close the rest."""
        self._sweeper.cancel()
        for server in self._servers:
            server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for conn in list(self.connections):
                conn.close_after = True  # answered requests end their connection
                if not conn.busy:
                    conn._close()
            busy = [c for c in self.connections if c.busy]
            if not busy or loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            task = conn._worker
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            conn._close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()

