"""Scoped tokens: what code that runs during an episode or an evaluation (a sandboxed agent, a check) may do.

The daemon's full token (and its main Unix socket, which needs none) can do everything: read every scenario's
records, report, create scenarios, steer releases. An episode of harness search runs a real coding agent, and
whatever that agent runs, on behalf of one scenario; it gets a scoped token instead, which allows only what a
wrapped run of that scenario needs:

- the scenario's provider routes (``/s/<scenario>/...``: chat completions, responses, messages, count_tokens,
  models, ``HEAD``), the ones that sample its serving model;
- ``POST /reef/runs`` whose body names that scenario (the wrapper's start: a run id and the scenario's harness);
- ``GET /reef/records?run=<run>`` for a run that this token started (the wrapper's receipts afterwards).

Everything else is ``Forbidden`` (403): proposing a harness change (``POST /reef/scenarios/{s}/proposals``)
included, even for the token's own scenario, since code running inside an evaluation must never steer the harness
it is scored on (a user's wrapped run proposes with the daemon's token, which it has). Choices:

- Held in memory only, by the digest of the token (a restart revokes them all; nothing to leak from disk).
- Each token has a deadline (the episode's time limit and a margin) and is revoked when the episode ends; one
  used after either is an unknown token (401), as is the full token on the scoped socket (``Config.scoped_socket``,
  the only socket a sandbox gets): there, every request needs a scoped token.
- The check is on the route the router matched (its pattern and path parameters), not on the raw path text, so no
  spelling of a path (``..``, percent-escapes, a trailing slash) reaches another route than the one checked.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from daemon.errors import Forbidden

PREFIX = "reef-scoped-"
MAX_TTL_S = 24 * 3600.0


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


@dataclass
class Scope:
    """What one scoped token allows: sampling, starting runs and reading those runs, of one scenario."""

    scenario: str
    expires: float  # time.monotonic() deadline
    runs: set[str] = field(default_factory=set)  # the runs started with this token (POST /reef/runs)

    def refusal(self, method: str, route: str, params: dict[str, str], query: dict[str, str]) -> str | None:
        """Why the request (its matched route) is refused, or None when this scope allows it."""
        if route.startswith("/s/{scenario}"):  # every route under the prefix is a provider (sampling) route
            if params.get("scenario") == self.scenario:
                return None
            return f"this token samples scenario {self.scenario!r} only, not {params.get('scenario')!r}"
        if (method, route) == ("POST", "/reef/runs"):
            return None  # the body is checked by ``serve``
        if (method, route) in (("GET", "/reef/records"), ("HEAD", "/reef/records")):
            run = query.get("run")
            if run is not None and run in self.runs and query.get("scenario") in (None, self.scenario):
                return None
            return "this token reads the records of the runs it started only (GET /reef/records?run=RUN)"
        return f"{method} {route} is not allowed with a token scoped to scenario {self.scenario!r}"

    async def serve(self, request: Any, handler: Callable[[Any], Awaitable[Any]],
                    read_json: Callable[[Any], Awaitable[Any]]) -> Any:
        """Answer ``request`` (routed) with ``handler`` when this scope allows it; else raise ``Forbidden``."""
        why = self.refusal(request.method, request.route, request.match_info, request.query)
        if why is None and request.route == "/reef/runs":
            body = await read_json(request)  # the handler reads the same body again (it is kept)
            named = body.get("scenario") if isinstance(body, dict) else None
            if named != self.scenario:
                why = f"this token starts runs of scenario {self.scenario!r} only, not {named!r}"
        if why is not None:
            raise Forbidden(why, scenario=self.scenario)
        response = await handler(request)
        if request.route == "/reef/runs" and getattr(response, "status", None) == 201:
            import orjson

            self.runs.add(orjson.loads(response.body)["run"])
        return response


class Scopes:
    """The live scoped tokens of one daemon (in memory)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._live: dict[bytes, Scope] = {}

    def mint(self, scenario: str, ttl_s: float) -> str:
        """A new token for ``scenario``, valid for ``ttl_s`` seconds (at most a day) unless revoked before."""
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl_s must be in (0, {MAX_TTL_S:.0f}], not {ttl_s!r}")
        self._sweep()
        token = PREFIX + secrets.token_urlsafe(32)
        self._live[_digest(token)] = Scope(scenario, self._clock() + ttl_s)
        return token

    def revoke(self, token: str) -> bool:
        """End ``token`` now; whether it was live."""
        return self._live.pop(_digest(token), None) is not None

    def get(self, token: str) -> Scope | None:
        """The scope of a live token; None for anything else (unknown, revoked, expired)."""
        if not token.startswith(PREFIX):
            return None
        scope = self._live.get(_digest(token))
        if scope is not None and scope.expires <= self._clock():
            del self._live[_digest(token)]
            return None
        return scope

    def __len__(self) -> int:
        self._sweep()
        return len(self._live)

    def _sweep(self) -> None:
        now = self._clock()
        for key in [k for k, s in self._live.items() if s.expires <= now]:
            del self._live[key]
