"""The daemon's state and its serve path: exchange in, engine, durable record, receipt out.

``Reef`` owns the config, the record store, the engines, the event bus and the metrics. ``ServePath`` is the
serve path, given what it uses (store, chains, canaries, events, metrics, the scenario and engine look-ups): it
resolves the release and the engine, collects or streams the engine's answer in the client's wire format
(``daemon/protocols/base.WireFormat``), records the exchange durably and hands out the receipt. The HTTP layer
(``daemon/app.py``) parses and authenticates, calls ``ServePath.serve`` and maps what it returns to a response;
everything about *serving an exchange* happens here, so the provider formats, the engines and the record store
meet in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from daemon.canary import Canaries, arm_key
from daemon.chains import Chains
from daemon.config import Config, TelemetrySettings
from daemon.engines import Engine, build_engine
from daemon.engines.base import ReleaseRef
from daemon.errors import Archived, BadRequest, ReefError, StorageError, Unavailable
from daemon.evaluation import Evaluations
from daemon.events import EventBus
from daemon.exchange import Completion, EngineEvent, Exchange, Finish, Message, Receipt, Relay
from daemon.headers import capture_header, safe_headers
from daemon.inflight import in_flight
from daemon.learning import Learner
from daemon.metrics import Metrics, watch_loop_lag
from daemon.names import check_scenario
from daemon.protocols.base import WireFormat
from daemon.protocols.sse import dumpb
from daemon.records import ExchangeRecord, RecordStore, Scenario, new_id, open_store
from daemon.releases import Release
from daemon.residency import Residency
from daemon.retention import Retention
from daemon.scopes import Scopes
from daemon.served import Served, no_events, reef_error
from recipes import add_recipe_paths, load_recipe

if TYPE_CHECKING:
    from daemon.telemetry import Telemetry

log = logging.getLogger("reef")

LOAD_WAIT_S = 600.0  # how long a request waits for its model's load (the first start converts SmolLM2: ~40 s)


def _settle_heap() -> None:
    """Move every object alive out of the cyclic collector's sight (``gc.freeze``): later full collections walk
    only what came after. Reference counting still frees frozen objects; cyclic garbage frozen with them is never
    collected, and there is little (131 objects after torch's import and a model's load: the collector has run
    meanwhile). No collection first: it would hold the GIL 0.4 s."""
    gc.freeze()


class Reef:
    """The daemon: config, records, engines, events, metrics."""

    def __init__(self, config: Config, token: str) -> None:
        self.config = config
        self.token = token
        self.scopes = Scopes()  # scoped tokens (episodes, sandboxes): in memory only
        self.store = open_store(config.records_location)
        self.events = EventBus(config.events_queue)
        self.metrics = Metrics()
        self.chains = Chains(config, self.events, self.metrics, ensure_model=self.engine)
        self.learner = Learner(config, self.store, self.chains, self.events, self.metrics, self.engine,
                               scopes=self.scopes)
        self.evaluations = Evaluations(config.home, self.store, self.chains, self.events, self.engine,
                                       self.learner.make_recipe)  # reef eval (daemon/evaluation.py)
        self.started_at = time.time()
        self._engines: dict[str, Engine] = {}
        self._engine_locks: dict[str, asyncio.Lock] = {}
        self.loading: set[str] = set()  # models whose load is under way
        self.waiting: dict[str, int] = {}  # model -> requests waiting for its load (``/healthz``)
        self.load_errors: dict[str, str] = {}  # model -> why its last load failed (cleared when one succeeds)
        self._warm: asyncio.Task[None] | None = None
        self.telemetry: Telemetry | None = None  # [telemetry]: spans of exchanges and reports (daemon/telemetry.py)
        self._retention: asyncio.Task[None] | None = None
        self._loop_lag: asyncio.Task[None] | None = None
        self._settled = False  # the heap frozen after the first engine's load (``_settle_heap``)
        self.canaries = Canaries(self)
        self.learner.start_canary = self.canaries.begin
        self.learner.canary_running = self.canaries.active.__contains__
        self.canaries.on_end = self.learner.canary_ended
        self.residency = Residency(self.chains, self.canaries, self.events, lambda: self._engines)
        self.weights_retention = Retention(self)  # which releases keep their weights (daemon/retention.py)
        self.serve_path = ServePath(store=self.store, chains=self.chains, canaries=self.canaries, events=self.events,
                                    metrics=self.metrics, scenario=self.scenario, engine=self.engine,
                                    observe=self.learner.observe, residency=self.residency)
        self._load_attempts: dict[str, int] = {}  # loads tried per model (a waiter learns whether one ended meanwhile)
        self._load_failures: dict[str, ReefError] = {}

    # --- lifecycle -----------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop_lag = asyncio.create_task(watch_loop_lag(self.metrics.loop_lag, self.metrics.loop_held), name="reef-loop-lag")
        if self.config.telemetry is not None:
            self.telemetry = _telemetry(self.config.telemetry, self.events, self.store)
            self.telemetry.start()
        add_recipe_paths(self.config.recipe_paths)
        try:  # a default recipe that cannot load, or refuses its configured settings: refuse to start
            self.learner.make_recipe(self.config.default_recipe)
        except ReefError as e:
            log.error("default_recipe %s: %s", self.config.default_recipe, e.message)
            raise
        await self.chains.start()
        self.residency.start()  # which releases the engines keep loaded (daemon/residency.py)
        # the default model loads in the background: the port answers at once, ``/healthz`` says what is loaded and
        # loading, and a request for a model still loading waits for it (``LOAD_WAIT_S``); a load that fails is one
        # log line and a clear error for its requests, while other models serve
        self._warm = asyncio.create_task(self._warm_default(), name="reef-load-default-model")
        await self.canaries.start()  # first: a scenario whose canary runs on after a restart does not step meanwhile
        await self.learner.start()
        self.weights_retention.start()
        if self.config.retention_days is not None or self.config.retention_max_mb is not None:
            from daemon.forgetting import retention_loop

            self._retention = asyncio.create_task(retention_loop(self), name="reef-retention")

    async def _warm_default(self) -> None:
        try:
            await self.engine(self.config.default_model)
        except ReefError as e:
            log.error("the default model %s cannot be served: %s", self.config.default_model, e.message)
        except asyncio.CancelledError:
            raise
        except Exception:  # an engine's own bug: logged with its traceback, the daemon serves on
            log.exception("loading the default model %s", self.config.default_model)

    async def close(self) -> None:
        for task in (self._warm, self._retention, self._loop_lag):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.weights_retention.close()
        await self.canaries.close()
        await self.residency.close()
        await self.chains.close()
        await self.learner.close()
        for engine in self._engines.values():
            try:
                await engine.close()
            except Exception:  # closing must go on for the others
                log.exception("closing engine %s", engine.info.model)
        if self.telemetry is not None:  # after the engines (no exchange is recorded later), before the store
            await self.telemetry.close()
        self.events.close()
        await asyncio.to_thread(self.store.close)

    # --- engines and scenarios -----------------------------------------------------------------------------

    async def engine(self, model: str) -> Engine:
        engine = self._engines.get(model)
        if engine is not None:
            return engine
        lock = self._engine_locks.setdefault(model, asyncio.Lock())
        attempt = self._load_attempts.get(model, 0)
        self.waiting[model] = self.waiting.get(model, 0) + 1
        try:
            await asyncio.wait_for(lock.acquire(), LOAD_WAIT_S)
        except TimeoutError:
            raise Unavailable(f"model {model} is still loading after {LOAD_WAIT_S:.0f} s; try again", model=model) from None
        finally:
            if self.waiting[model] == 1:
                del self.waiting[model]
            else:
                self.waiting[model] -= 1
        try:
            if model not in self._engines:
                failed = self._load_failures.get(model)
                if failed is not None and self._load_attempts.get(model, 0) != attempt:
                    raise failed  # the load this request waited for failed: its answer is that error, not a retry
                self.loading.add(model)
                try:
                    engine = await self._load_engine(model)
                    if not self._settled:
                        # what start-up and the first load made lives as long as the daemon: out of the cyclic
                        # collector's walks from now on (a full collection walked it in one call, GIL held: 0.36 s
                        # with torch loaded)
                        self._settled = True
                        _settle_heap()
                except ReefError as e:
                    self.load_errors[model], self._load_failures[model] = e.message, e
                    raise
                finally:
                    self.loading.discard(model)
                    self._load_attempts[model] = self._load_attempts.get(model, 0) + 1
                self.load_errors.pop(model, None)
                self._load_failures.pop(model, None)
                self._engines[model] = engine
                self.residency.tell(model)
                self.metrics.loads.labels(model).inc()
                self.events.publish("engine.load", model=model, runtime_load_id=engine.runtime_load_id)
            return self._engines[model]
        finally:
            lock.release()

    async def _load_engine(self, model: str) -> Engine:
        """Build and start the engine of ``model`` (making a built-in model directory on first use)."""
        entry = self.config.model(model)
        if entry.engine == "transformers" and entry.path is not None and not entry.path.exists():
            from daemon.model_dirs import BUILT_IN, init_built_in

            if entry.path.parent == self.config.models_dir and entry.path.name in BUILT_IN:
                log.info("building the %s model into %s (first use)", entry.path.name, entry.path)
                await asyncio.to_thread(init_built_in, entry.path, entry.path.name)
        if entry.engine == "transformers":  # torch's import takes seconds: not on the event loop
            import importlib

            await asyncio.to_thread(importlib.import_module, "daemon.engines.transformers")
        engine = build_engine(entry, self.config.secrets, self.metrics)
        try:
            await engine.start()
        except ReefError as e:  # a broken model directory: this model fails, the others go on serving
            log.warning("model %s cannot be served: %s", model, e.message)
            raise
        return engine

    async def scenario(self, name: str, *, recipe: str | None = None, model: str | None = None,
                       settings: dict[str, Any] | None = None) -> Scenario:
        check_scenario(name)  # before anything is stored: a refused name leaves no row behind
        if recipe is not None:
            load_recipe(recipe)  # one that cannot load is refused before the scenario exists
        if model is not None:
            self.config.model(model)
        created_before = self.store.scenarios.cached(name)
        scenario = await self.store.scenarios.ensure(
            name,
            recipe=recipe,
            model=model or self.config.default_model,
            default_recipe=self.config.default_recipe,
            settings=settings,
        )
        if not created_before and time.time() - scenario.created_at < 1:
            self.events.publish("scenario", scenario=scenario.to_dict())
        return scenario


def _telemetry(settings: TelemetrySettings, events: EventBus, store: RecordStore) -> Telemetry:
    """The exporter of ``[telemetry]``, imported only here: OpenTelemetry is the ``otel`` extra, and loading it costs
    a daemon that does not export its start time. Not installed: a refusal to start that says how to install it."""
    try:
        from daemon.telemetry import Telemetry
    except ImportError as e:
        if (e.name or "").startswith(("daemon", "recipes")):  # Reef's own module broken: not a missing extra
            raise
        raise BadRequest(f"config: [telemetry] needs OpenTelemetry, which is not installed ({e.name or e}): "
                         'pip install "reef[otel]" into Reef\'s environment, or run install.sh --otel') from None
    return Telemetry(settings, events, store)


Watch = Callable[[], contextlib.AbstractContextManager[Any]]
"""``web.Request.watch``: a block in which the client leaving cancels the task and raises ``ConnectionResetError``
(``web.ClientGone``); the serve path wraps its waits on the engine in it, so a client that went away is served no
further (its engine stream is closed: the embedded engine drops the sequence at its next step, a remote engine's
connection is closed) and its exchange is recorded ``cancelled``."""


def unwatched() -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


class Sink(Protocol):
    """Where a streamed answer's bytes go: the HTTP layer's prepared response (``web.StreamResponse``). A write
    raises ``ConnectionResetError`` when the client has gone."""

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self) -> None: ...


@dataclass
class Answer:
    """A whole answer: its body, encoded once (what the record stores is what the client gets), and its headers
    (the receipt, the release, ``Server-Timing``)."""

    body: bytes
    headers: dict[str, str]


@dataclass
class StreamedAnswer:
    """A streamed answer, begun: its headers (the receipt, before the answer exists: its record is opened) go out
    first; ``send`` then writes its events to the client's response, records the outcome and adds the receipt to
    the final event."""

    path: ServePath
    wire: WireFormat
    served: Served
    response_id: str
    created: int
    receipt: Receipt
    headers: dict[str, str]
    watch: Watch = unwatched

    async def send(self, sink: Sink) -> None:
        await self.path.send_stream(self, sink)

    async def close(self) -> None:
        """Let go of the engine's stream (however ``send`` ended, or when it never ran)."""
        await self.path.abandon(self.served)


Observe = Callable[[str, str, str | None, Mapping[str, str], list[Message], Completion], None]


class ServePath:
    """Serving one exchange: scenario, release and engine resolved, the engine's answer collected or streamed in
    the client's format, the exchange recorded durably, the receipt handed out.

    What it uses is named here, not the daemon: the record store, the release chains and canaries (which release
    serves), the event bus and metrics, the scenario and engine look-ups (``Reef.scenario``, ``Reef.engine``) and
    the learner's ``observe`` (a judging recipe's turn). ``daemon/app.py`` parses a request into an ``Exchange``,
    calls ``serve`` and maps what it returns (or the ``ReefError`` it raises) to a response."""

    def __init__(
        self,
        *,
        store: RecordStore,
        chains: Chains,
        canaries: Canaries,
        events: EventBus,
        metrics: Metrics,
        scenario: Callable[[str], Awaitable[Scenario]],
        engine: Callable[[str], Awaitable[Engine]],
        observe: Observe,
        residency: Residency | None = None,
    ) -> None:
        self.store = store
        self.chains = chains
        self.canaries = canaries
        self.events = events
        self.metrics = metrics
        self._scenario = scenario
        self._engine = engine
        self._observe = observe
        self.residency = residency  # told which release serves each request (``daemon/residency.py``)
        self.inflight: dict[str, Served] = {}  # receipt -> an exchange being served (``GET /reef/inflight``)

    # --- one request, start to finish ----------------------------------------------------------------------

    async def serve(
        self,
        wire: WireFormat,
        exchange: Exchange,
        *,
        scenario: str,
        run: str | None,
        headers: Mapping[str, str],
        request_text: str | None = None,
        watch: Watch = unwatched,
    ) -> Answer | StreamedAnswer:
        """Serve ``exchange`` (parsed from ``wire``'s request): a whole ``Answer``, recorded, or a begun
        ``StreamedAnswer`` to send. Raises ``ReefError`` before anything is sent (a failed exchange carries its
        receipt in ``data["record_id"]``), ``ConnectionResetError`` when the client left (``watch``: recorded
        ``cancelled``)."""
        served = await self.begin(exchange, scenario=scenario, run=run, headers=headers,
                                  pinned_release=headers.get("x-reef-release-id"), request_text=request_text,
                                  watch=watch)
        created = int(time.time())
        # the scenario's model answers whatever the request names ("gpt-9"): the answer says which, in its ``model``
        # field and a header, rather than echoing a name that did not answer
        answered = served.engine.info.model
        if exchange.model != answered:
            served.exchange = replace(exchange, model=answered)
        out = {"x-reef-agent-record-id": served.receipt, "x-reef-model": answered}
        if served.release_id:
            out["x-reef-release-id"] = served.release_id
        if not served.capture:
            out["x-reef-capture"] = "false"  # served and recorded, never trained on
        cap, asked = served.engine.info.output_cap, exchange.sampling.max_tokens
        if cap is not None and (asked is None or asked > cap):  # Reef's bound, not the client's (engines/prompts.py)
            out["x-reef-output-cap"] = str(cap)
        receipt = Receipt(served.receipt, served.release_id)
        if exchange.stream:
            # where a stream's first-token time went: the engine's first event, the opening record's write (run
            # beside it) and how long the first event waited for that write (what the receipt in the headers costs)
            out["Server-Timing"] = (
                f"engine;dur={((served.first_event_at or served.engine_started) - served.engine_started) * 1e3:.3f}, "
                f"record;dur={served.opening_ms or 0.0:.3f}, receipt-wait;dur={served.receipt_wait_ms or 0.0:.3f}"
            )
            return StreamedAnswer(self, wire, served, new_id(wire.ID_PREFIX), created, receipt, out, watch)
        try:
            return await self._whole(wire, served, created, receipt, out, watch)
        finally:
            await self.abandon(served)

    async def _whole(self, wire: WireFormat, served: Served, created: int, receipt: Receipt,
                     headers: dict[str, str], watch: Watch = unwatched) -> Answer:
        try:
            with watch():
                finish = await self.collect(served)
        except ConnectionResetError:  # the client left: nothing more is generated for it
            await self.abandon(served)
            await self.record(served, None, None, status="cancelled")
            raise
        completion = finish.completion
        if finish.body is not None:  # relayed as the upstream answered it (same format in and out)
            response = {**finish.body, "reef": receipt.to_dict()}
        else:
            response = wire.render_response(served.exchange, completion, response_id=new_id(wire.ID_PREFIX),
                                            created=created, receipt=receipt)
        payload = dumpb(response)  # encoded once: what the record stores is what the client gets
        await self.record(served, completion, response, response_text=payload.decode())
        headers["Server-Timing"] = (
            f"engine;dur={served.engine_ms:.3f}, record;dur={served.record_ms:.3f}, "
            f"total;dur={(time.perf_counter() - served.started) * 1e3:.3f}"
        )
        self.metrics.requests.labels(wire.FORMAT, "200").inc()
        self.metrics.latency.labels(wire.FORMAT).observe(time.perf_counter() - served.started)
        return Answer(payload, headers)

    async def collect(self, served: Served) -> Finish:
        """The engine's whole answer (its ``Finish``)."""
        if isinstance(served.first, Finish):  # the common case: the engine's first event is its whole answer
            return served.first
        # closed here, not left to the garbage collector: an async generator dropped unfinished costs the loop a
        # finalizer task (call_soon_threadsafe + create_task(aclose())) per request
        async with contextlib.aclosing(self.stream(served)) as events:
            async for event in events:
                if isinstance(event, Finish):
                    return event
        raise ReefError("engine ended without finishing")

    async def send_stream(self, answer: StreamedAnswer, sink: Sink) -> None:
        """Write a streamed answer's events to ``sink`` as the engine makes them, record the outcome, then end
        the stream with the receipt in its final event. A failure after the start ends the stream with the
        format's error event (recorded as error, or incomplete for a cut upstream); a client that leaves keeps
        what was produced, recorded as incomplete."""
        served, wire, receipt = answer.served, answer.wire, answer.receipt
        renderer = wire.StreamRenderer(served.exchange, response_id=answer.response_id, created=answer.created)
        completion: Completion | None = None
        final: tuple[str | None, str] | None = None
        # an upstream of the client's format: its bytes go out as they are (Relay events), not re-rendered
        pending = [] if isinstance(served.first, Relay) else renderer.start()
        events = self.stream(served)
        try:
            try:
                with answer.watch():
                    async for event in events:
                        if isinstance(event, Finish):
                            completion, final = event.completion, event.final
                            await events.aclose()  # finished: closed now rather than by a finalizer task
                            break
                        if isinstance(event, Relay):
                            pending.append(event.data)
                        else:
                            pending.extend(renderer.event(event))
                        await sink.write(b"".join(pending))
                        pending = []
            except ReefError as err:
                status = "incomplete" if err.data.get("incomplete") else "error"  # a cut upstream stream
                await self.record(served, None, None, status=status, error=err)
                await sink.write(b"".join(pending + renderer.error(err)))
                await sink.write_eof()
                return
            assert completion is not None
            response = wire.render_response(served.exchange, completion, response_id=answer.response_id,
                                            created=answer.created, receipt=receipt)
            try:
                await self.record(served, completion, response)
            except StorageError as err:
                await sink.write(b"".join(pending + renderer.error(err)))
                await sink.write_eof()
                return
            end = wire.relay_finish(final, receipt) if final is not None else renderer.finish(completion, receipt)
            await sink.write(b"".join(pending + end))
            await sink.write_eof()
            self.metrics.requests.labels(wire.FORMAT, "200").inc()
            self.metrics.latency.labels(wire.FORMAT).observe(time.perf_counter() - served.started)
        except ConnectionResetError:
            # the client left mid-stream: the engine's stream is closed (nothing more is generated for it) and the
            # exchange is recorded cancelled
            await self.abandon(served)
            if completion is None:
                await self.record(served, None, None, status="cancelled")

    async def count_tokens(self, exchange: Exchange, *, scenario: str, pinned_release: str | None) -> int:
        """How many tokens ``exchange``'s prompt is for the engine and release that would serve it."""
        scen = await self._scenario(scenario)
        engine = await self._engine(scen.model)
        release = await self.chains.resolve(scen, pinned_release)
        return await engine.count_tokens(exchange, await self._weights(scen, release))

    async def _weights(self, scen: Scenario, release: Release) -> ReleaseRef | None:
        """The weights an engine serves ``release`` with: None for a harness release (it lives in the agent; the
        engine serves its model's own weights)."""
        return None if release.kind == "harness" else await self.chains.ref(scen, release)

    # --- the steps -----------------------------------------------------------------------------------------

    async def begin(
        self,
        exchange: Exchange,
        *,
        scenario: str,
        run: str | None,
        headers: Mapping[str, str],
        pinned_release: str | None = None,
        request_text: str | None = None,
        watch: Watch = unwatched,
    ) -> Served:
        """Resolve scenario, release and engine and start generating; raises before anything is sent.

        The request is frozen here to one release: the scenario's head, or the release the client pinned."""
        started = time.perf_counter()
        asked = capture_header(headers.get("x-reef-capture"))
        scen = await self._scenario(scenario)
        if scen.archived:
            raise Archived(scen.name)
        engine = await self._engine(scen.model)
        release = None
        if pinned_release:  # a run on a canary's arm (a running one, or one ended since the run began)
            release = await self.canaries.pinned(scen, pinned_release)
        elif self.canaries.active:  # a share of new runs goes to a running canary (daemon/canary.py)
            release = await self.canaries.arm(scen, arm_key(headers, run))
        if release is None:
            release = await self.chains.resolve(scen, pinned_release)
        served = Served(
            exchange=exchange,
            scenario=scen,
            run=run,
            engine=engine,
            receipt=new_id("rec_"),
            release_id=release.release_id,
            content_id=release.content_id,
            started=started,
            events=no_events(),
            first=None,
            headers=safe_headers(headers),
            request_text=request_text,
            capture=asked and scen.capture,
        )
        # From here the exchange is frozen to ``release``: whatever fails is recorded as an error on it, before the
        # engine starts as after, so that a candidate whose checkout fails counts on its canary's arm (the error
        # guard reads the records) as one whose load or first step fails does.
        try:
            ref = await self._weights(scen, release)
            if ref is not None and self.residency is not None:
                self.residency.serves(scen.name, scen.model, ref.content_id, pinned=bool(pinned_release))
            if ref is not None and ref.path is not None and ref.content_id not in engine.resident:
                await self.chains.preload(scen, release, engine)
            served.engine_started = time.perf_counter()
            events = served.events = engine.generate(exchange, ref)
        except Exception as exc:
            err = reef_error(exc)
            await self._record_failure(served, err)
            if err is exc:
                raise
            raise err from exc
        self.inflight[served.receipt] = served
        # A stream's receipt goes out in its headers, before the answer exists: its record is opened first, durably,
        # so that the receipt names a record whatever happens next (kill -9, a full disk). The write runs while
        # the engine works on its first event, so a stream's time to first token pays for it only where the
        # engine answers faster than a commit (an instant upstream).
        opening = self._open_record(served) if exchange.stream else None
        if opening is not None:
            opening_started = time.perf_counter()
            opening.add_done_callback(lambda _: setattr(served, "opening_ms",
                                                        (time.perf_counter() - opening_started) * 1e3))
        try:
            with watch():  # a prompt's prefill can take minutes: a client that leaves meanwhile stops it
                first = served.first = await anext(events)
            served.first_event_at = time.perf_counter()
        except ConnectionResetError:  # the client left (``watch``): its exchange is recorded cancelled
            await _aclose(events)
            if opening is not None:
                served.opened = await _succeeded(opening)
            await self.record(served, None, None, status="cancelled")
            raise
        except Exception as exc:  # the engine refused it, or the upstream failed: recorded as an error
            await _aclose(events)
            if opening is not None:
                served.opened = await _succeeded(opening)
            err = reef_error(exc)
            await self._record_failure(served, err)
            if err is exc:
                raise
            raise err from exc
        except BaseException:
            self.inflight.pop(served.receipt, None)
            await _aclose(events)
            if opening is not None:
                opening.cancel()  # the write goes on; nobody saw its receipt (an honest incomplete record)
            raise
        if opening is not None:
            try:
                await opening  # a record that cannot be opened (disk full) is a 507 before any byte is sent
            except BaseException:
                await _aclose(events)
                raise
            served.opened = True
            now = time.perf_counter()
            if served.opening_ms is None:  # done before this task resumed: its callback has not run yet
                served.opening_ms = (now - opening_started) * 1e3
            served.receipt_wait_ms = (now - served.first_event_at) * 1e3
        if isinstance(first, Finish):
            served.finished_at = time.perf_counter()
        else:
            served.first_token_at = time.perf_counter()
        return served

    def _open_record(self, served: Served) -> asyncio.Future[None]:
        """Start the durable write of a stream's opening record: what is known before the first event."""
        return self.store.exchanges.open(self._exchange_record(served, served.engine.runtime_load_id))

    @staticmethod
    def _exchange_record(served: Served, runtime_load_id: str | None, **outcome: Any) -> ExchangeRecord:
        """The record of a served exchange: what is known from its start, and ``outcome`` (status, response,
        timings, usage, tokens) once it is known."""
        ex = served.exchange
        return ExchangeRecord(
            id=served.receipt,
            scenario=served.scenario.name,
            run=served.run,
            format=ex.format,
            engine=served.engine.info.name,
            model=served.engine.info.model,
            release_id=served.release_id,
            content_id=served.content_id,
            runtime_load_id=runtime_load_id,
            request=ex.body,
            request_json=served.request_text,
            headers=served.headers,
            capture=served.capture,
            **outcome,
        )

    async def _record_failure(self, served: Served, err: ReefError) -> None:
        """Store an exchange that failed before its first event; its receipt goes out with the error."""
        try:
            await self.record(served, None, None, status="error", error=err)
        except ReefError:
            log.exception("could not record a failed exchange")
            return
        err.data["record_id"] = served.receipt

    async def stream(self, served: Served) -> AsyncGenerator[EngineEvent, None]:
        """All events of a served exchange, the first one included; ends after ``Finish``."""
        assert served.first is not None
        yield served.first
        if isinstance(served.first, Finish):
            return
        async for event in served.events:
            if isinstance(event, Finish):
                served.finished_at = time.perf_counter()
                yield event
                return
            if served.first_token_at is None:
                served.first_token_at = time.perf_counter()
            yield event

    async def record(
        self,
        served: Served,
        completion: Completion | None,
        response: dict[str, Any] | None,
        *,
        status: str = "complete",
        error: ReefError | None = None,
        response_text: str | None = None,
    ) -> None:
        """Store the exchange durably; returns when the receipt may be handed out. ``response_text``: the
        response already encoded as JSON (what the client gets), stored as it is."""
        self.inflight.pop(served.receipt, None)
        now = time.perf_counter()
        ex = served.exchange
        timings = {
            "ttft_ms": None if served.first_token_at is None else round((served.first_token_at - served.started) * 1e3, 3),
            "total_ms": round((now - served.started) * 1e3, 3),
            "engine_ms": None if served.engine_ms is None else round(served.engine_ms, 3),
        }
        usage: dict[str, Any] | None = None
        if completion is not None:
            usage = {
                "input_tokens": completion.usage.input_tokens,
                "output_tokens": completion.usage.output_tokens,
            }
            if completion.upstream:
                usage["upstream"] = completion.upstream
            elif served.engine.info.name == "upstream":  # a provider that sent no usage: unknown, not 0 and 0
                usage = {"input_tokens": None, "output_tokens": None, "unknown": "the provider sent no usage"}
            if ex.tools and served.engine.info.carries_tools is False:  # the model's template left them out
                usage["tools_dropped"] = len(ex.tools)
        rec = self._exchange_record(
            served,
            completion.runtime_load_id if completion else served.engine.runtime_load_id,
            status=status,
            response=response if error is None else {"error": error.to_dict(), "partial": response},
            response_json=response_text if error is None else None,
            timings=timings,
            usage=usage,
            prompt_token_ids=completion.prompt_token_ids if completion else None,
            token_ids=completion.token_ids if completion else None,
            logprobs=completion.logprobs if completion else None,
        )
        t0 = time.perf_counter()
        if served.opened:  # a stream: its record exists since before the first byte; its outcome fills it in
            await self.store.exchanges.complete(rec)
        else:
            await self.store.exchanges.append(rec)
        served.record_ms = (time.perf_counter() - t0) * 1e3
        m = self.metrics
        m.records.labels("exchange").inc()
        if completion is not None:
            m.tokens.labels(rec.model, "input").inc(completion.usage.input_tokens)
            m.tokens.labels(rec.model, "output").inc(completion.usage.output_tokens)
            if completion.usage.cache_read_tokens:  # prompt tokens the engine's prefix cache supplied
                m.tokens.labels(rec.model, "cache_read").inc(completion.usage.cache_read_tokens)
        if timings["ttft_ms"] is not None:
            m.ttft.labels(rec.model).observe(timings["ttft_ms"] / 1e3)
        sampling = ex.sampling
        self.events.publish(
            "record",
            id=served.receipt,
            scenario=served.scenario.name,
            run=served.run,
            status=status,
            model=rec.model,
            release_id=served.release_id,
            runtime_load_id=rec.runtime_load_id,
            timings=timings,
            usage=usage,
            # what traces read (daemon/telemetry.py): when it began, what was asked, how it ended
            started_at=time.time() - (time.perf_counter() - served.started),
            format=ex.format,
            engine=rec.engine,
            request_model=(ex.body.get("model") if isinstance(ex.body, dict) else None) or ex.model or None,
            response_model=(completion.model or None) if completion is not None else None,
            sampling={k: v for k, v in (("max_tokens", sampling.max_tokens), ("temperature", sampling.temperature),
                                        ("top_p", sampling.top_p)) if v is not None},
            finish_reason=completion.stop_reason if completion is not None else None,
            error=None if error is None else {"type": error.type, "message": error.message},
            # the client's W3C trace context, as it sent it (checked where it is read): its trace, joined by the span
            traceparent=served.headers.get("traceparent"),
            tracestate=served.headers.get("tracestate"),
        )
        if status == "complete" and completion is not None:
            self._observe(served.scenario.name, served.receipt, served.run, served.headers, ex.messages,
                          completion)

    async def abandon(self, served: Served) -> None:
        self.inflight.pop(served.receipt, None)
        await _aclose(served.events)

    def in_flight(self, *, run: str | None = None, scenario: str | None = None) -> list[dict[str, Any]]:
        """The exchanges being served now (``daemon/inflight.py``)."""
        return in_flight(self.inflight.values(), run=run, scenario=scenario)


async def _succeeded(write: asyncio.Future[None]) -> bool:
    """Whether a record write went through; its failure (``StorageError``) is not raised here: the caller goes on
    to record the exchange's own error as well as it can."""
    try:
        await write
    except ReefError:
        return False
    return True


async def _aclose(events: AsyncIterator[EngineEvent]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            log.debug("closing an engine stream failed", exc_info=True)
