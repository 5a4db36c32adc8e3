"""A real OTLP/HTTP trace receiver for the tests: ``POST /v1/traces`` on 127.0.0.1, the protobuf
``ExportTraceServiceRequest`` decoded with ``opentelemetry-proto`` (the protocol a collector speaks, not a stand-in for
the exporter). It can also misbehave as collectors do: refuse (an HTTP 400, which no exporter retries), or hold an
export unanswered until the test lets it go.
"""

from __future__ import annotations

import gzip
import select
import socket
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    return None if kind is None else getattr(v, kind)


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs}


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str, dict[str, Any]]]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    resource: dict[str, Any]
    trace_state: str = ""  # W3C tracestate, as the span carries it
    flags: int = 0  # OTLP span flags: 0x100 the parent's remoteness is known, 0x200 it is remote


def decode(body: bytes) -> list[Span]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        resource = attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(
                    name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(), kind=s.kind, start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano, attributes=attributes(s.attributes),
                    links=[(ln.trace_id.hex(), ln.span_id.hex(), attributes(ln.attributes)) for ln in s.links],
                    status_code=s.status.code, status_message=s.status.message, resource=resource,
                    trace_state=s.trace_state, flags=s.flags,
                ))
    return out


@dataclass
class Receiver:
    """Start with ``start()``; ``mode`` is ``ok``, ``reject`` (400) or ``hold`` (unanswered until ``release``)."""

    mode: str = "ok"
    spans: list[Span] = field(default_factory=list)  # taken (answered 200)
    attempted: list[Span] = field(default_factory=list)  # every span sent, taken or not
    bodies: list[bytes] = field(default_factory=list)  # every request body as sent (decompressed)
    headers: list[dict[str, str]] = field(default_factory=list)
    holding: int = 0  # exports held unanswered now
    peer_left: bool = False  # the exporter gave up on a held export (closed its connection)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _release: threading.Event = field(default_factory=threading.Event)
    _server: ThreadingHTTPServer | None = None
    _connections: set[socket.socket] = field(default_factory=set)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with receiver._cond:
                    receiver._connections.add(self.connection)

            def finish(self) -> None:
                with receiver._cond:
                    receiver._connections.discard(self.connection)
                super().finish()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                body = gzip.decompress(body) if encoding == "gzip" else zlib.decompress(body) if encoding == "deflate" \
                    else body
                spans = decode(body) if self.path == "/v1/traces" else []
                with receiver._cond:
                    receiver.bodies.append(body)
                    receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                    receiver.attempted.extend(spans)
                    mode = receiver.mode
                    if mode == "hold":
                        receiver.holding += 1
                    receiver._cond.notify_all()
                if self.path != "/v1/traces":
                    return self._answer(404, b"")
                if mode == "reject":
                    return self._answer(400, b"refused by the test")
                if mode == "hold":
                    self._hold()
                with receiver._cond:
                    receiver.spans.extend(spans)
                    receiver._cond.notify_all()
                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _hold(self) -> None:
                """Wait for the test's release, noting whether the exporter closes its end meanwhile."""
                try:
                    while not receiver._release.wait(0.01):
                        readable, _, _ = select.select([self.connection], [], [], 0)
                        if readable and not self.connection.recv(1, socket.MSG_PEEK):
                            with receiver._cond:
                                receiver.peer_left = True
                                receiver._cond.notify_all()
                            return
                finally:
                    with receiver._cond:
                        receiver.holding -= 1
                        receiver._cond.notify_all()

            def _answer(self, status: int, payload: bytes) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/x-protobuf")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:  # the exporter left
                    pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True).start()
        return self

    def set_mode(self, mode: str) -> None:
        with self._cond:
            self.mode = mode
            if mode == "hold":
                self._release.clear()

    def release(self) -> None:
        self._release.set()

    def wait(self, what: Callable[[Receiver], Any], guard_s: float = 120) -> Any:
        """Block until ``what(self)`` is true (``guard_s``: a hang guard only); its value."""
        with self._cond:
            got = self._cond.wait_for(lambda: what(self), guard_s)
            assert got, "the receiver never saw what the test waited for"
            return got

    def span(self, receipt: str, *, attempted: bool = False) -> Span | None:
        with self._cond:
            for s in self.attempted if attempted else self.spans:
                if s.attributes.get("reef.receipt") == receipt:
                    return s
        return None

    def close(self) -> None:
        """Stop listening and drop the connections kept alive: the collector is down (connections are refused)."""
        self._release.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        with self._cond:
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
