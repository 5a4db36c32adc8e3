"""OpenTelemetry traces of what the daemon serves: a span per exchange, a span per report linked to its exchanges.

Optional: on when config.toml has a ``[telemetry]`` table (``daemon/config.TelemetrySettings``). This module imports
the SDK and the OTLP/HTTP exporter (the ``otel`` extra) at its top, and ``daemon/serving.py`` imports it only when
the table is there: a daemon without it loads none of OpenTelemetry, and one with it but without the extra refuses
to start, saying how to install it.

Design choices:
- Off the serve path. A task reads the event bus: the ``record`` event every stored exchange announces
  (``ServePath.record``) and the ``report`` event of every stored report (``daemon/reports.py``), and makes the
  spans from them; the SDK's batch processor sends them from its own thread. A request never waits on a span, on
  the collector or on its errors: a collector that is down, slow or refusing costs spans, never answers.
- The GenAI semantic conventions: span ``chat <model>``, ``gen_ai.*`` attributes for the model, the sampling
  parameters given, the tokens, the finish reason; Reef's own under ``reef.`` (scenario, run, release, receipt).
  The span starts when the request came in and ends when its record was durable (when the receipt could go out).
- Content only on request. By default a span holds names, ids, counts and times; ``content = true`` adds the
  prompt and the answer (``gen_ai.input.messages``, ``gen_ai.output.messages``, JSON in the conventions' shape) and
  a report's feedback (``reef.report.feedback``), read back from the record store: the event stream never
  carries them.
- Ids from the receipt. An exchange's trace id and span id are the first 16 and the next 8 bytes of
  SHA-256(``reef/exchange/<receipt>``), so a report that comes hours later links to its exchanges' spans knowing
  only their receipts, and so can any other tool. A report's span is a trace of its own (SHA-256 of
  ``reef/report/<report id>``) with one link per exchange it judges.
- The client's trace followed. A request that carries a W3C ``traceparent`` (and ``tracestate``), as an
  OpenTelemetry-instrumented client sends, gets its exchange span in the client's trace: that trace id, the
  traceparent's span as parent, its tracestate, its sampled flag obeyed (``ParentBased``, the SDK's default). The
  span id stays the receipt's. Parsing is OpenTelemetry's own propagator; a malformed header is ignored (the span
  starts its own trace, as without one). Nothing new is kept for it: the record keeps the client's headers (these
  two among them) and the ``record`` event carries them; a report reads them back from the store to link to the
  exchange span in whichever trace it is.
- Collector errors are logged once: a warning at the first failed export, then nothing until an export goes
  through again (an info line says so). The exporter's own log lines (one per failed batch, one per retry) are
  kept out of the daemon's log.
- A stop flushes: spans not yet sent get ``timeout_s`` (``FLUSH_ON_STOP_S`` at most) before the daemon exits.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from daemon.events import DROPPED, RecordEvent, ReportEvent
from daemon.exchange import Completion, Message, Part
from daemon.records.location import redact

if TYPE_CHECKING:
    from daemon.config import TelemetrySettings
    from daemon.events import EventBus
    from daemon.records import RecordStore

log = logging.getLogger("reef")

FLUSH_ON_STOP_S = 5.0  # the longest a stop waits for unsent spans (a collector that is down must not hold it)
MAX_QUEUE = 4096  # finished spans held for the exporter; past that the newest are dropped (a collector too slow)
BATCH = 512  # spans per export request
# the loggers of the exporter and the batch processor: their lines are held back (the last one is the reason the
# once-logged warning gives)
QUIET_LOGGERS = ("opentelemetry.exporter", "opentelemetry.sdk._shared_internal")
# the loggers of the W3C propagator and of its tracestate parser: a client's malformed header is ignored (the spec
# says so), not a warning in the daemon's log per request; their lines are dropped
CLIENT_HEADER_LOGGERS = ("opentelemetry.trace.propagation.tracecontext", "opentelemetry.trace.span")
TRACE_HEADERS = ("traceparent", "tracestate")  # the W3C Trace Context headers (as the record keeps them: lower case)
_W3C = TraceContextTextMapPropagator()


def span_ids(kind: str, record_id: str) -> tuple[int, int]:
    """The trace id and span id of a record's span: SHA-256 of ``reef/<kind>/<id>`` (``kind``: exchange or
    report), its first 16 bytes and its next 8 (never zero: a zero id is invalid in OpenTelemetry)."""
    digest = hashlib.sha256(f"reef/{kind}/{record_id}".encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:24], "big") or 1


def client_parent(headers: Mapping[str, Any] | None) -> SpanContext | None:
    """The client's span an exchange's span is the child of: from its W3C ``traceparent`` and ``tracestate``
    headers (``headers``: the recorded headers, or the record event's fields), read by OpenTelemetry's propagator.
    None where the client sent none, or one that is malformed (wrong length, not lower-case hex, an all-zero id,
    version ff, ...): such a header is ignored, as the spec says."""
    carrier = {k: v for k in TRACE_HEADERS if isinstance(v := (headers or {}).get(k), str)}
    if "traceparent" not in carrier:
        return None
    parent = get_current_span(_W3C.extract(carrier)).get_span_context()
    return parent if parent.is_valid else None


def exchange_span_context(receipt: str, headers: dict[str, Any] | None) -> SpanContext:
    """Where an exchange's span is: its receipt's span id, in the client's trace where the client sent a valid
    ``traceparent`` (``client_parent``), else in the receipt's own trace (``span_ids``). What a report links to."""
    trace_id, span_id = span_ids("exchange", receipt)
    parent = client_parent(headers)
    if parent is None:
        return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return SpanContext(parent.trace_id, span_id, is_remote=True,
                       trace_flags=TraceFlags(parent.trace_flags & TraceFlags.SAMPLED))


class _PinnedIds(IdGenerator):
    """Span ids derived from record ids (``span_ids``), pinned just before each span starts (a span with a parent,
    the client's, takes only the span id: its trace id is the parent's). Spans are only made on the event loop's
    thread, one at a time, so one pinned pair is enough."""

    def __init__(self) -> None:
        self.trace_id = 0
        self.span_id = 0

    def pin(self, ids: tuple[int, int]) -> None:
        self.trace_id, self.span_id = ids

    def generate_trace_id(self) -> int:
        assert self.trace_id, "a span started without its ids pinned"
        return self.trace_id

    def generate_span_id(self) -> int:
        assert self.span_id, "a span started without its ids pinned"
        return self.span_id


class _Held(logging.Handler):
    """Holds back the exporter's and the batch processor's log lines, keeping the last (the reason a failed export
    gives)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.last = record.getMessage()
        except Exception:  # a record whose arguments do not format: its bare message
            self.last = str(record.msg)


class _Exporter(SpanExporter):
    """The OTLP exporter, its failures told once: a warning at the first failed export, an info line when one goes
    through again. Never raises (a failed export is spans lost, nothing more)."""

    def __init__(self, inner: OTLPSpanExporter, endpoint: str, held: _Held) -> None:
        self._inner = inner
        self._endpoint = endpoint
        self._held = held
        self._failing = False
        self._closed = False
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception as e:  # the exporter's own bug: these spans are lost, the next batch is tried
            self._held.last = f"{type(e).__name__}: {e}"
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            if self._failing:
                self._failing = False
                log.info("telemetry: exporting spans to %s again", self._endpoint)
        elif not self._failing and not self._closed:
            self._failing = True
            log.warning("telemetry: could not export spans to %s (%s); spans are dropped until it takes them, and"
                        " this is not logged again until then", self._endpoint, self._held.last or "no reason given")
        return result

    def shutdown(self) -> None:
        """Stop exporting; an export under way ends at once (its retries are abandoned)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._inner.shutdown()  # type: ignore[no-untyped-call]  # the exporter leaves it unannotated

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("reef")
    except PackageNotFoundError:  # run from a checkout
        return None


class Telemetry:
    """Spans of the daemon's exchanges and reports, sent to an OTLP/HTTP collector (``start``, then ``close`` at
    the stop, which flushes)."""

    def __init__(self, settings: TelemetrySettings, events: EventBus, store: RecordStore) -> None:
        self.settings = settings
        self._events = events
        self._store = store
        self._held = _Held()
        self._dropped = logging.NullHandler()
        self._quieted: list[tuple[logging.Logger, bool]] = []
        inner = OTLPSpanExporter(endpoint=settings.endpoint, headers=dict(settings.headers),
                                 timeout=settings.timeout_s)
        self._shown = redact(settings.endpoint)  # for the log: without a password the URL may hold
        self._exporter = _Exporter(inner, self._shown, held=self._held)
        self._processor = BatchSpanProcessor(
            self._exporter, max_queue_size=MAX_QUEUE, schedule_delay_millis=settings.batch_delay_s * 1e3,
            max_export_batch_size=BATCH, export_timeout_millis=settings.timeout_s * 1e3,
        )
        self._ids = _PinnedIds()
        resource: dict[str, AttributeValue] = {"service.name": settings.service_name}
        if (version := _version()) is not None:
            resource["service.version"] = version
        # ParentBased(ALWAYS_ON), the SDK's default sampler: a span of Reef's own trace is always sampled; one in a
        # client's trace (its traceparent) follows that trace's sampled flag: where the client's flag says not
        # sampled, the exchange span is not recorded and never exported, as any OpenTelemetry service would do
        self._provider = TracerProvider(resource=Resource(resource), sampler=ParentBased(ALWAYS_ON),
                                        id_generator=self._ids, shutdown_on_exit=False)
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("reef")
        self._queue: asyncio.Queue[dict[str, Any] | None] | None = None
        # the seq of the last event read: a new subscription replays from it (0: from the first, which came after
        # this reader subscribed, at the start)
        self._after = 0
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._broken = False  # a span that could not be made was logged (once)

    def start(self) -> None:
        for name in QUIET_LOGGERS + CLIENT_HEADER_LOGGERS:
            logger = logging.getLogger(name)
            self._quieted.append((logger, logger.propagate))
            logger.addHandler(self._held if name in QUIET_LOGGERS else self._dropped)
            logger.propagate = False
        self._queue = self._events.subscribe(internal=True)
        self._task = asyncio.create_task(self._run(), name="reef-telemetry")
        log.info("telemetry: exporting spans to %s (from %s%s)", self._shown, self.settings.source,
                 "; with content" if self.settings.content else "")

    async def close(self) -> None:
        """Make spans of the events still queued, then send what is unsent (``FLUSH_ON_STOP_S`` at most)."""
        self._closing = True
        if self._task is not None and self._queue is not None:
            self._events.unsubscribe(self._queue)
            if not self._task.done():
                try:  # after the events it holds: those become spans first
                    await asyncio.wait_for(self._queue.put(None), FLUSH_ON_STOP_S)
                    await asyncio.wait({self._task}, timeout=FLUSH_ON_STOP_S)
                except TimeoutError:
                    pass
            if not self._task.done():  # a store read that hangs, say: the spans not made yet are lost
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.to_thread(self._flush)
        for logger, propagate in self._quieted:
            logger.removeHandler(self._held)
            logger.removeHandler(self._dropped)
            logger.propagate = propagate
        self._quieted.clear()

    def _flush(self) -> None:
        bound = min(self.settings.timeout_s, FLUSH_ON_STOP_S)
        cut = threading.Event()

        def cut_short() -> None:  # a collector that is down or slow: its retries end here, the stop goes on
            cut.set()
            self._exporter.shutdown()

        timer = threading.Timer(bound, cut_short)
        timer.start()
        try:
            self._provider.shutdown()
        finally:
            timer.cancel()
        if cut.is_set():
            log.warning("telemetry: the collector at %s did not take the last spans within %g s of the stop; they"
                        " were dropped", self._shown, bound)

    # --- events to spans ---------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            assert self._queue is not None
            event = await self._queue.get()
            if event is None:  # the bus ended this stream: a stop (close), or the bus closed its streams early
                if self._closing:
                    return
                self._queue = self._events.subscribe(after=self._after)  # replays what came meanwhile
                continue
            if event["kind"] == DROPPED:
                log.warning("telemetry: fell behind the event bus (events_queue); the spans of some events were"
                            " not made")
                continue
            self._after = event["seq"]
            try:
                if event["kind"] == "record":
                    await self._exchange(cast(RecordEvent, event))
                elif event["kind"] == "report":
                    await self._report(cast(ReportEvent, event))
            except Exception:  # a span that cannot be made is lost; serving and the next spans go on
                if not self._broken:
                    self._broken = True
                    log.exception("telemetry: could not make the span of %s %s (logged once)", event["kind"],
                                  event.get("id"))

    def _span(self, name: str, ids: tuple[int, int], attrs: dict[str, AttributeValue], *, start: float, end: float,
              links: list[Link] | None = None, error: str | None = None, parent: SpanContext | None = None) -> None:
        """Make and end a span (``parent``: the client's span, of which it is the child; else a trace of its own)."""
        self._ids.pin(ids)
        context = Context() if parent is None else set_span_in_context(NonRecordingSpan(parent), Context())
        span = self._tracer.start_span(name, context=context, kind=SpanKind.SERVER, attributes=attrs,
                                       links=links, start_time=int(start * 1e9))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=int(end * 1e9))

    async def _exchange(self, ev: RecordEvent) -> None:
        receipt = ev["id"]
        requested = ev.get("request_model") or None
        attrs: dict[str, AttributeValue] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "reef",
            "gen_ai.system": "reef",  # the older name of gen_ai.provider.name, still read by many backends
            "reef.receipt": receipt,
            "reef.scenario": ev["scenario"],
            "reef.status": ev["status"],
        }
        optional: dict[str, AttributeValue | None] = {
            "gen_ai.request.model": requested,
            "gen_ai.response.model": ev.get("response_model") or ev.get("model"),
            "reef.run": ev.get("run"),
            "reef.release_id": ev.get("release_id"),
            "reef.model": ev.get("model"),
            "reef.engine": ev.get("engine"),
            "reef.format": ev.get("format"),
            "reef.runtime_load_id": ev.get("runtime_load_id"),
        }
        usage = ev.get("usage") or {}
        optional["gen_ai.usage.input_tokens"] = usage.get("input_tokens")
        optional["gen_ai.usage.output_tokens"] = usage.get("output_tokens")
        for key, value in (ev.get("sampling") or {}).items():
            optional[f"gen_ai.request.{key}"] = value
        ttft = (ev.get("timings") or {}).get("ttft_ms")
        optional["reef.ttft_ms"] = ttft
        attrs.update({k: v for k, v in optional.items() if v is not None})
        if ev.get("finish_reason"):
            attrs["gen_ai.response.finish_reasons"] = (ev["finish_reason"],)
        error = ev.get("error")
        if error:
            attrs["error.type"] = error.get("type") or "error"
        if self.settings.content:
            attrs.update(await self._exchange_content(receipt))
        self._span(f"chat {requested}" if requested else "chat", span_ids("exchange", receipt), attrs,
                   start=ev.get("started_at") or ev["time"], end=ev["time"], parent=client_parent(ev),
                   error=None if not error else error.get("message") or error.get("type") or "error")

    async def _report(self, ev: ReportEvent) -> None:
        references = [r for r in ev.get("references") or [] if isinstance(r, str)]
        attrs: dict[str, AttributeValue] = {"reef.report.id": ev["id"], "reef.receipts": references}
        if ev.get("scenario") is not None:
            attrs["reef.scenario"] = ev["scenario"]
        score = ev.get("score")
        if isinstance(score, (int, float)):
            attrs["reef.report.score"] = float(score)
        if ev.get("source"):
            attrs["reef.report.source"] = str(ev["source"])
        if self.settings.content:
            rec = await self._store.exchanges.get(ev["id"], full=False)
            feedback = (rec.get("report") or {}).get("feedback")
            if feedback is not None:
                attrs["reef.report.feedback"] = feedback if isinstance(feedback, str) else json.dumps(feedback)
        # the exchange spans may be in their clients' traces: their traceparents, from the records' headers
        headers = await self._store.exchanges.trace_headers(references) if references else {}
        links = [Link(exchange_span_context(r, headers.get(r)), {"reef.receipt": r}) for r in references]
        self._span("reef report", span_ids("report", ev["id"]), attrs, start=ev["time"], end=ev["time"], links=links)

    async def _exchange_content(self, receipt: str) -> dict[str, AttributeValue]:
        """``gen_ai.input.messages`` and ``gen_ai.output.messages`` of a stored exchange (what it can parse back)."""
        rec = await self._store.exchanges.get(receipt)
        return await asyncio.to_thread(content_attributes, rec)


# --- content in the GenAI conventions' shape ---------------------------------------------------------------


def content_attributes(rec: Mapping[str, Any]) -> dict[str, AttributeValue]:
    """The prompt and the answer of an exchange record as the GenAI conventions' message JSON (parsed back with
    the record's wire format; what does not parse is left out)."""
    from daemon.protocols.formats import FORMATS

    wire = FORMATS.get(rec.get("format") or "")
    out: dict[str, AttributeValue] = {}
    if wire is None:
        return out
    request, response = rec.get("request"), rec.get("response")
    try:
        messages = wire.parse_request(request).messages
        out["gen_ai.input.messages"] = json.dumps([_message(m) for m in messages], ensure_ascii=False)
    except Exception:  # a request recorded as it came and then refused: no prompt to give
        pass
    if isinstance(response, dict) and "error" not in response:
        try:
            completion = wire.parse_response({k: v for k, v in response.items() if k != "reef"})
            out["gen_ai.output.messages"] = json.dumps([_answer(completion)], ensure_ascii=False)
        except Exception:  # an answer in a shape its format does not parse back
            pass
    return out


def _part(p: Part) -> dict[str, Any]:
    if p.type == "text":
        return {"type": "text", "content": p.text}
    if p.type == "thinking":
        return {"type": "reasoning", "content": p.text}
    if p.type == "tool_call":
        return {"type": "tool_call", "id": p.id, "name": p.name, "arguments": _arguments(p.arguments)}
    if p.type == "tool_result":
        return {"type": "tool_call_response", "id": p.tool_call_id, "response": p.text}
    return {"type": "uri", "modality": "image", "mime_type": p.media_type, "uri": p.source}


def _arguments(text: str | None) -> Any:
    try:
        return json.loads(text or "")
    except ValueError:
        return text


def _message(m: Message) -> dict[str, Any]:
    return {"role": m.role, "parts": [_part(p) for p in m.parts]}


def _answer(c: Completion) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    if c.thinking:
        parts.append({"type": "reasoning", "content": c.thinking})
    if c.text:
        parts.append({"type": "text", "content": c.text})
    parts += [{"type": "tool_call", "id": t.id, "name": t.name, "arguments": _arguments(t.arguments)}
              for t in c.tool_calls]
    return {"role": "assistant", "parts": parts, "finish_reason": c.stop_reason}
