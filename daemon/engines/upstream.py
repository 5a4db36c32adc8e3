"""The upstream engine: serve a model entry from any OpenAI- or Anthropic-compatible provider.

A model entry of engine ``upstream`` names a base URL, a wire format (``openai-chat``, ``openai-responses``,
``anthropic``), the provider's model name and the environment variable holding the API key (``config.toml``
never holds the key; it is read from ``Config.secrets``, sent only in request headers, and never logged, stored
or put in an error message).

- **URL convention.** ``url`` is the provider's base URL; the engine appends ``/v1/chat/completions``,
  ``/v1/responses`` or ``/v1/messages`` (and ``/v1/messages/count_tokens``). A base that already ends in
  ``/v1`` means the same (``https://api.openai.com`` and ``https://api.openai.com/v1`` both work).
- **Same format in and out.** The client's body goes upstream unchanged apart from ``model`` (and, for a
  streaming chat request, ``stream_options.include_usage``, so that usage can be recorded; the client sees the
  usage chunk only if it asked for it), and, for a chat upstream, message content given as a list of text parts
  only, which goes as one string (``join_text_parts``).
- **Text parts joined** (``join_text_parts``, on unless the entry says ``false``; the ``openai`` preset does): the
  agents send content as lists of text parts, and a local server's chat template often takes strings only
  (SmolLM2's under llama-cpp-python's server: ``'...' + message['content']`` fails on a list, an HTTP 500, after
  which pi and Claude Code retried a dozen times). A content whose parts are all ``{type: text, text}`` is joined
  with ``\n`` between parts, as vLLM and llama.cpp's own server do with such content, so the model sees the text it
  would have seen there; a part with anything else (an image, a ``cache_control``) keeps its message as sent.
  Chosen over a retry on the refusal: servers refuse it in several shapes (a 500 naming a Python ``TypeError``, a
  422 from request validation, a stream that ends empty), none of which says "list content" reliably, and joining
  text-only parts loses nothing, so it is done up front, once per request, with no second request. The upstream's stream is parsed into neutral events as its bytes arrive
  and each event is yielded at once; the daemon re-renders them in the client's format and adds the receipt.
- **Different formats.** ``daemon/protocols/<format>.render_request`` translates the neutral exchange into the
  upstream's request, ``parse_response`` / ``StreamParser`` read the answer back (choices documented there).
- **Anthropic needs ``max_tokens``**: a client that gave none gets the entry's ``max_new_tokens`` when the config
  sets it, else 4096 (``daemon.protocols.anthropic.DEFAULT_MAX_TOKENS``).
- **Connections.** One pool of kept-alive connections per engine (``daemon/engines/http.py``, a lean HTTP/1.1
  client: aiohttp's client cost several times the rest of a relayed request in CPU), created in ``start`` and
  closed in ``close``. Timeouts: ``connect_timeout_s`` to get a connection; ``timeout_s`` for the
  whole answer when not streaming, and for the first byte and any silence between chunks when streaming (a
  healthy long stream is never cut).
- **Failures.** Retried (twice, quickly) only when the request cannot have reached the upstream: connection
  refused, DNS failure, connect timeout. An upstream 4xx is relayed with the upstream's status and message in
  the client's error format, except 401/403: those mean Reef's own key is wrong, not the client's, and become
  502 naming the key's variable. A 5xx becomes 502 (``UpstreamError``), a timeout 504 (``UpstreamTimeout``),
  both naming the upstream. A stream cut after it started (connection lost, silence past the timeout, an error
  event, an end without the final event) raises an error flagged ``incomplete``: the client's stream ends with
  its provider's error event and the record is stored as incomplete.
- **Usage and metrics.** ``Completion.usage`` follows the neutral convention (input counts cached tokens);
  ``Completion.upstream`` is the provider's usage object verbatim. ``/metrics``: ``reef_upstream_seconds``
  (time to response headers) and ``reef_upstream_errors`` (by kind: connect, timeout, http_<status>,
  stream_cut, stream_error, malformed), per model.
- **count_tokens.** An Anthropic upstream is asked (``/v1/messages/count_tokens``); for the OpenAI formats, which
  have no such endpoint, the count is an estimate: the characters of the prompt's text, tool calls and tool
  definitions divided by 4, rounded up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from yarl import URL

from daemon.engines import http
from daemon.engines.base import Engine, EngineInfo
from daemon.engines.entry import ModelEntry, check_base_url
from daemon.errors import BadRequest, ReefError, UpstreamError, UpstreamTimeout
from daemon.exchange import Completion, EngineEvent, Exchange, Finish, Relay, TextDelta
from daemon.protocols import anthropic
from daemon.protocols.base import WireFormat
from daemon.protocols.formats import FORMATS
from daemon.protocols.sse import SSEDecoder, dumpb, dumps, loads, missing_events, sse

log = logging.getLogger("reef.upstream")

_PROTOCOLS: dict[str, WireFormat] = FORMATS
_CONNECT_RETRY_DELAYS = (0.05, 0.25)
_MAX_ERROR_BODY = 64 * 1024
_ERROR_TYPES = {404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}
# what Anthropic's count_tokens refuses: generation-only fields of a Messages request
_NOT_FOR_COUNTING = {"max_tokens", "stream", "metadata", "stop_sequences", "temperature", "top_p", "top_k",
                     "service_tier", "container"}
# client headers an upstream of the client's own format gets (never credentials: the key is Reef's own)
_FORWARD = {
    "anthropic": ("anthropic-beta", "anthropic-version", "x-claude-code-session-id"),
    "openai-chat": ("openai-beta", "session_id", "x-session-affinity", "x-session-id"),
    "openai-responses": ("openai-beta", "session_id", "x-session-affinity", "x-session-id"),
}


class UpstreamRejected(BadRequest):
    """An upstream 4xx, relayed with the upstream's status (``data["status"]``) and message."""

    def __init__(self, message: str, status: int, **data: Any) -> None:
        super().__init__(message, status=status, **data)
        self.type = _ERROR_TYPES.get(status, "invalid_request_error")


def _cut(err: ReefError, partial: str) -> ReefError:
    """Flag an error raised after the stream started: the record is stored as incomplete."""
    err.data["incomplete"] = True
    if partial:
        err.data["partial_text"] = partial
    return err


def _error_message(raw: bytes) -> str:
    """The message of a provider's error body (OpenAI or Anthropic shape), else its text."""
    text = raw[:_MAX_ERROR_BODY].decode("utf-8", "replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500] or "no message"
    if isinstance(body, dict):
        err = body.get("error")
        message = err.get("message") if isinstance(err, dict) else None
        if isinstance(message, str):
            return message
        for value in (err, body.get("message"), body.get("detail")):
            if isinstance(value, str) and value:
                return value
        detail = body.get("detail")  # FastAPI's request validation (llama-cpp-python's server): a list of errors
        if isinstance(detail, list) and detail and all(isinstance(d, dict) for d in detail):
            return "; ".join(f"{'.'.join(str(x) for x in d.get('loc') or ())}: {d.get('msg')}" for d in detail[:5])
    return text[:500]


def join_text_parts(body: dict[str, Any]) -> dict[str, Any]:
    """A chat body whose message contents made of text parts only (``{type: text, text}``) are one string each,
    ``\n`` between parts; other contents stay as sent. Returns ``body`` itself when nothing changed."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return body
    joined: list[Any] | None = None
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and content and all(
                isinstance(p, dict) and p.keys() == {"type", "text"} and p["type"] == "text"
                and isinstance(p["text"], str) for p in content):
            if joined is None:
                joined = list(messages)
            joined[i] = {**m, "content": "\n".join(p["text"] for p in content)}
    return body if joined is None else {**body, "messages": joined}


def estimate_tokens(ex: Exchange) -> int:
    """A prompt's size without a tokenizer: characters / 4, rounded up (an image counts as 1,000 tokens)."""
    chars = 0
    images = 0
    for m in ex.messages:
        for p in m.parts:
            chars += len(p.text) + len(p.arguments or "") + len(p.name or "")
            images += p.type == "image"
    for t in ex.tools:
        chars += len(t.name) + len(t.description) + len(dumps(t.parameters))
    return max(1, math.ceil(chars / 4)) + 1000 * images


class UpstreamEngine(Engine):
    def __init__(self, entry: ModelEntry, secrets: Mapping[str, str], metrics: Any = None) -> None:
        where = f"model {entry.name!r}"
        if entry.format not in _PROTOCOLS:
            raise BadRequest(f"{where}: format must be one of {', '.join(_PROTOCOLS)}, got {entry.format!r}")
        if not entry.url:
            raise BadRequest(f"{where}: an upstream model needs url (the provider's base URL)")
        check_base_url(entry.url, where, keyed=entry.api_key_env is not None)  # no credentials in it, https for a key
        base = URL(entry.url.rstrip("/"))
        if base.scheme not in ("http", "https") or not base.host:
            raise BadRequest(f"{where}: url must be an http(s) URL, got {entry.url!r}")
        base_path = base.path[:-3] if base.path.endswith("/v1") else base.path
        base = base.with_path(base_path.rstrip("/"))
        self.entry = entry
        self.format = entry.format
        self.proto = _PROTOCOLS[entry.format]
        self.url = str(base) + self.proto.PATH
        self._target = base.raw_path.rstrip("/") + self.proto.PATH
        self._count_target = base.raw_path.rstrip("/") + "/v1/messages/count_tokens"
        self._base_query = base.raw_query_string
        assert base.host is not None and base.port is not None
        self._origin = (base.scheme, base.host, base.port)
        # what error messages and logs say: no credentials, no query string
        shown = str(base.with_user(None).with_password(None).with_query(None)) + self.proto.PATH
        self.label = f"{entry.name!r} ({entry.upstream_model or 'the client model'} at {shown})"
        self.shown_url = shown
        headers = {"User-Agent": "reef", "Content-Type": "application/json",
                   "Accept": "application/json, text/event-stream"}
        if entry.api_key_env:
            key = secrets.get(entry.api_key_env)
            if not key:
                raise BadRequest(
                    f"{where}: the API key variable {entry.api_key_env} is not set in the daemon's environment"
                    " (Reef reads variables whose names end in _API_KEY, _KEY or _TOKEN)"
                )
            if entry.format == "anthropic":
                headers["x-api-key"] = key
            else:
                headers["Authorization"] = f"Bearer {key}"
        if entry.format == "anthropic":
            headers["anthropic-version"] = "2023-06-01"
        self._headers = headers  # holds the key: never logged, never in an error
        self._header_lines = http.header_lines(headers)
        self.max_tokens = entry.max_new_tokens or anthropic.DEFAULT_MAX_TOKENS
        self.metrics = metrics
        self.info = EngineInfo(name="upstream", model=entry.name, accepts_images=True)
        self._pool: http.Pool | None = None
        self._latency = None if metrics is None else metrics.upstream_latency.labels(entry.name)

    def __repr__(self) -> str:  # never show the headers
        return f"UpstreamEngine({self.label})"

    # --- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._pool is None:
            scheme, host, port = self._origin
            self._pool = http.Pool(scheme, host, port, connect_timeout=self.entry.connect_timeout_s)

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    # --- serving --------------------------------------------------------------------------------------------

    def request_body(self, ex: Exchange) -> dict[str, Any]:
        """What goes upstream: the client's own body when the formats match, else a translation (also for an
        exchange built in the daemon, which has no body); a chat body's text parts joined (``join_text_parts``)."""
        body = self._request_body(ex)
        if self.format == "openai-chat" and self.entry.join_text_parts:
            body = join_text_parts(body)
        return body

    def _request_body(self, ex: Exchange) -> dict[str, Any]:
        model = self.entry.upstream_model or ex.model
        if ex.format == self.format and ex.body:
            body = dict(ex.body)
            body["model"] = model
            if self.format == "openai-chat" and ex.stream:
                options = body.get("stream_options")
                body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
            return body
        if self.format == "anthropic":
            return anthropic.render_request(ex, model=model, stream=ex.stream, max_tokens=self.max_tokens)
        return self.proto.render_request(ex, model=model, stream=ex.stream)

    def _headers_for(self, ex: Exchange) -> str:
        """Reef's header lines (with the key), and the client's own ``_FORWARD`` headers when the formats match
        (in place of Reef's of the same name)."""
        if ex.format != self.format or not ex.headers:
            return self._header_lines
        extra = {name: value for name in _FORWARD[self.format] if (value := ex.headers.get(name))}
        if not extra:
            return self._header_lines
        own = {k: v for k, v in self._headers.items() if k.lower() not in extra}
        return http.header_lines({**own, **extra})

    def generate(self, exchange: Exchange, release: Any = None) -> AsyncIterator[EngineEvent]:
        # ``release`` (the release the request is frozen to) changes nothing upstream: no weights to pick
        return self._generate(exchange)

    async def _generate(self, ex: Exchange) -> AsyncIterator[EngineEvent]:
        same = ex.format == self.format
        data = dumpb(self.request_body(ex))
        resp = await self._post(self._target, data, stream=ex.stream, headers=self._headers_for(ex),
                                query=ex.query if same else "")
        try:
            if not ex.stream or not resp.content_type.endswith("event-stream"):
                body = await self._read_json(resp)
                completion = self.proto.parse_response(body)
                if ex.stream:  # an upstream that answered a stream request in one piece
                    for ev in missing_events(completion, "", "", 0):
                        yield ev
                    yield Finish(completion)
                else:
                    yield Finish(completion, body=body if same else None)
                return
            events = self._relay(resp, ex) if same else self._translate(resp)
            async for ev in events:
                yield ev
        finally:
            resp.release()

    async def _translate(self, resp: http.Response) -> AsyncIterator[EngineEvent]:
        """An upstream stream of another format: its events, as they arrive, for the daemon to re-render."""
        parser = self.proto.StreamParser()
        decoder = SSEDecoder()
        text: list[str] = []
        started = False
        try:
            async for chunk in resp.iter_chunks(self.entry.timeout_s):
                for event, payload in decoder.feed(chunk):
                    for ev in parser.feed(event, payload):
                        started = True
                        if isinstance(ev, TextDelta):
                            text.append(ev.text)
                        yield ev
            for event, payload in decoder.close():
                for ev in parser.feed(event, payload):
                    started = True
                    yield ev
        except ReefError as e:
            raise self._stream_error(e, started, text) from None
        except (TimeoutError, http.HTTPClientError, OSError) as e:
            self._count("timeout" if isinstance(e, TimeoutError) else "stream_cut")
            raise self._stream_failure(e, started, "".join(text)) from None
        yield Finish(self._finish(parser, started, text))

    async def _relay(self, resp: http.Response, ex: Exchange) -> AsyncIterator[EngineEvent]:
        """An upstream stream of the client's own format: its bytes, event by event as they arrive, parsed on the
        side for the record. The final event is held back (``Finish.final``) for the receipt. The only change: a
        chat client that did not ask for usage does not get the usage Reef asked for."""
        parser: Any = self.proto.StreamParser()  # chat's also has chunk (the last one read) and final()
        decoder = SSEDecoder()
        chat = self.format == "openai-chat"
        strip_usage = chat and not ex.stream_usage
        text: list[str] = []
        final: tuple[str | None, str] | None = None
        started = False
        try:
            chunks = resp.iter_chunks(self.entry.timeout_s)
            eof = False
            while not eof:
                try:
                    frames = decoder.frames(await anext(chunks))
                except StopAsyncIteration:
                    eof, frames = True, decoder.close_frames()
                out: list[bytes] = []
                for raw, event, payload in frames:
                    if payload is None:  # keep-alive comments go through too
                        out.append(raw)
                        continue
                    if chat and payload == "[DONE]":
                        parser.feed(event, payload)
                        continue
                    was_done = parser.done
                    for ev in parser.feed(event, payload):
                        if isinstance(ev, TextDelta):
                            text.append(ev.text)
                    if parser.done and not was_done and not chat:
                        final = (event, payload)
                        continue
                    if chat and ("reef" in parser.chunk or strip_usage and isinstance(parser.chunk.get("usage"), dict)):
                        raw = self._chat_chunk(parser.chunk, strip_usage)
                    out.append(raw)
                if out:
                    started = True
                    yield Relay(b"".join(out))
        except ReefError as e:
            raise self._stream_error(e, started, text) from None
        except (TimeoutError, http.HTTPClientError, OSError) as e:
            self._count("timeout" if isinstance(e, TimeoutError) else "stream_cut")
            raise self._stream_failure(e, started, "".join(text)) from None
        completion = self._finish(parser, started, text)
        yield Finish(completion, final=parser.final() if chat else final)

    @staticmethod
    def _chat_chunk(chunk: dict[str, Any], strip_usage: bool) -> bytes:
        """A chat chunk without the usage the client did not ask for, and without an upstream Reef's receipt (the
        client gets this daemon's); nothing when that was all it carried."""
        drop = {"reef", "usage"} if strip_usage and isinstance(chunk.get("usage"), dict) else {"reef"}
        if not chunk.get("choices"):
            return b""
        return sse({k: v for k, v in chunk.items() if k not in drop})

    def _finish(self, parser: Any, started: bool, text: list[str]) -> Completion:
        if not parser.done:
            self._count("stream_cut")
            err = UpstreamError(f"upstream {self.label} ended its stream before the answer was complete",
                                upstream=self.shown_url)
            raise _cut(err, "".join(text)) if started else err
        completion: Completion = parser.finish()
        return completion

    def _stream_error(self, e: ReefError, started: bool, text: list[str]) -> ReefError:
        """An error event in the stream, or a malformed one."""
        self._count("stream_error")
        err = type(e)(f"upstream {self.label}: {e.message}", **{**e.data, "upstream": self.shown_url})
        log.warning("%s", err.message)
        return _cut(err, "".join(text)) if started else err

    def _stream_failure(self, e: BaseException, started: bool, partial: str) -> ReefError:
        err: ReefError
        if isinstance(e, TimeoutError):
            err = UpstreamTimeout(
                f"upstream {self.label} sent nothing for {self.entry.timeout_s:g} s in the middle of its stream",
                upstream=self.shown_url,
            )
        else:
            err = UpstreamError(f"upstream {self.label}: connection lost mid-stream ({type(e).__name__})",
                                upstream=self.shown_url)
        log.warning("%s", err.message)
        return _cut(err, partial) if started else err

    async def count_tokens(self, exchange: Exchange, release: Any = None) -> int:
        if self.format != "anthropic":
            return estimate_tokens(exchange)
        if exchange.format == "anthropic":
            body = {k: v for k, v in exchange.body.items() if k not in _NOT_FOR_COUNTING}
        else:
            rendered = anthropic.render_request(exchange, model="", stream=False)
            body = {k: v for k, v in rendered.items() if k not in _NOT_FOR_COUNTING}
        body["model"] = self.entry.upstream_model or exchange.model
        same = exchange.format == self.format
        resp = await self._post(self._count_target, dumpb(body), stream=False,
                                headers=self._headers_for(exchange), query=exchange.query if same else "")
        try:
            answer = await self._read_json(resp)
        finally:
            resp.release()
        n = answer.get("input_tokens") if isinstance(answer, dict) else None
        if not isinstance(n, int):
            self._count("malformed")
            raise UpstreamError(f"upstream {self.label} answered count_tokens without input_tokens",
                                upstream=self.shown_url)
        return n

    # --- HTTP -------------------------------------------------------------------------------------------------

    def _count(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.upstream_errors.labels(self.entry.name, kind).inc()

    async def _post(self, target: str, data: bytes, *, stream: bool, headers: str | None = None,
                    query: str = "") -> http.Response:
        """Send one request; returns the response once its headers are in and its status is 2xx.

        ``query``: the client's query string (Claude Code's ``?beta=true``), added to the URL."""
        if self._pool is None:
            await self.start()
        assert self._pool is not None
        if query or self._base_query:
            target = f"{target}?{'&'.join(q for q in (self._base_query, query) if q)}"
        head = http.request_head("POST", target, self._pool.host_header, headers or self._header_lines, len(data))
        t0 = time.perf_counter()
        for attempt, delay in enumerate((*_CONNECT_RETRY_DELAYS, None)):
            try:
                resp, _ = await self._pool.request(head, data, timeout=self.entry.timeout_s)
                if not stream:  # timeout_s is for the whole answer
                    resp.deadline = time.monotonic() + self.entry.timeout_s - (time.perf_counter() - t0)
                break
            except http.TLSFailed as e:
                self._count("connect")
                raise UpstreamError(f"cannot reach upstream {self.label}: {e}", upstream=self.shown_url) from None
            except http.ConnectFailed as e:
                # the request never left: safe to try again
                if delay is not None:
                    log.info("upstream %s: connect failed (%s), retry %d", self.label, e, attempt + 1)
                    await asyncio.sleep(delay)
                    continue
                self._count("connect")
                raise UpstreamError(f"cannot reach upstream {self.label}: {e}", upstream=self.shown_url) from None
            except TimeoutError:
                self._count("timeout")
                raise UpstreamTimeout(
                    f"upstream {self.label} did not answer within {self.entry.timeout_s:g} s", upstream=self.shown_url
                ) from None
            except (http.HTTPClientError, OSError) as e:
                self._count("connect")
                raise UpstreamError(f"upstream {self.label} failed: {type(e).__name__}: {e}",
                                    upstream=self.shown_url) from None
        if self._latency is not None:
            self._latency.observe(time.perf_counter() - t0)
        if resp.status < 400:
            return resp
        try:
            raw = await resp.read(self.entry.timeout_s)
        except (TimeoutError, http.HTTPClientError, OSError):
            raw = b""
        finally:
            resp.release()
        self._count(f"http_{resp.status}")
        message = _error_message(raw)
        # when to try again, as the upstream said (relayed to the client, whose SDK waits that long)
        retry = {k: v for k in ("retry-after", "retry-after-ms") if (v := resp.headers.get(k))}
        log.warning("upstream %s answered HTTP %d: %s", self.label, resp.status, message[:300])
        if resp.status in (401, 403):
            raise UpstreamError(
                f"upstream {self.label} refused Reef's credentials (HTTP {resp.status}: {message}); check the key"
                f" in {self.entry.api_key_env or 'api_key_env (none configured)'}",
                upstream=self.shown_url, upstream_status=resp.status,
            )
        if resp.status < 500:
            raise UpstreamRejected(f"{message} (upstream {self.label}: HTTP {resp.status})", resp.status,
                                   upstream_status=resp.status, retry_after=retry or None)
        raise UpstreamError(f"upstream {self.label} answered HTTP {resp.status}: {message}",
                            upstream=self.shown_url, upstream_status=resp.status, retry_after=retry or None)

    async def _read_json(self, resp: http.Response) -> Any:
        try:
            raw = await resp.read(self.entry.timeout_s)
        except TimeoutError:
            self._count("timeout")
            raise UpstreamTimeout(f"upstream {self.label} did not answer within {self.entry.timeout_s:g} s",
                                  upstream=self.shown_url) from None
        except (http.HTTPClientError, OSError) as e:
            self._count("stream_cut")
            raise UpstreamError(f"upstream {self.label}: connection lost while reading the answer"
                                f" ({type(e).__name__})", upstream=self.shown_url) from None
        try:
            return loads(raw)
        except ValueError:
            self._count("malformed")
            raise UpstreamError(f"upstream {self.label} answered something that is not JSON: {raw[:200]!r}",
                                upstream=self.shown_url) from None
