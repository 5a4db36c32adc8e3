"""Scoped tokens as a unit (``daemon/scopes.py``): what one allows, route by route, when it ends, and what a start
of a run with it records. The same limits through a real daemon and a real sandbox are in
tests/test_sandbox_escape.py; these run in milliseconds, so that every mutant of the module meets them
(``bench/mutation.py scopes``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from daemon.errors import Forbidden
from daemon.scopes import MAX_TTL_S, PREFIX, Scope, Scopes


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def same(text: str) -> str:
    """An equal string that is another object (as one parsed from a request is): ``is`` would tell them apart."""
    return "".join(list(text))


def test_a_scope_samples_its_own_scenario_only() -> None:
    scope = Scope("mine", expires=0)
    for route in ("/s/{scenario}/v1/chat/completions", "/s/{scenario}/r/{run}/v1/messages", "/s/{scenario}"):
        assert scope.refusal("POST", route, {"scenario": same("mine")}, {}) is None
        for other in ("theirs", "aaa", "min", "mine2"):  # after it, before it, a prefix of it, it as a prefix
            why = scope.refusal("POST", route, {"scenario": other}, {})
            assert why == f"this token samples scenario 'mine' only, not {other!r}"
        assert scope.refusal("POST", route, {}, {}) == "this token samples scenario 'mine' only, not None"
    # a provider route without the prefix is not a sampling route of this scenario
    assert scope.refusal("POST", "/v1/chat/completions", {}, {}) == (
        "POST /v1/chat/completions is not allowed with a token scoped to scenario 'mine'")


def test_a_scope_reads_the_records_of_its_own_runs_only() -> None:
    scope = Scope("mine", expires=0, runs={"run-1"})
    for method in ("GET", "HEAD"):
        assert scope.refusal(method, "/reef/records", {}, {"run": "run-1"}) is None
        assert scope.refusal(method, "/reef/records", {}, {"run": "run-1", "scenario": "mine"}) is None
    refused = "this token reads the records of the runs it started only (GET /reef/records?run=RUN)"
    assert scope.refusal("GET", "/reef/records", {}, {"run": "run-2"}) == refused  # another run
    assert scope.refusal("GET", "/reef/records", {}, {}) == refused  # every run
    assert scope.refusal("GET", "/reef/records", {}, {"run": "run-1", "scenario": "theirs"}) == refused
    assert scope.refusal("POST", "/reef/records", {}, {"run": "run-1"}) == (
        "POST /reef/records is not allowed with a token scoped to scenario 'mine'")


def test_a_scope_refuses_every_other_route_naming_it() -> None:
    scope = Scope("mine", expires=0)
    assert scope.refusal("POST", "/reef/runs", {}, {}) is None  # the body is checked when served
    assert scope.refusal("GET", "/reef/runs", {}, {}) == "GET /reef/runs is not allowed with a token scoped to " \
                                                         "scenario 'mine'"
    for method, route in (("POST", "/reef/scenarios/{name}/proposals"), ("POST", "/reef/report"),
                          ("GET", "/reef/scenarios"), ("POST", "/reef/scenarios/{name}/rollback")):
        why = scope.refusal(method, route, {"name": "mine"}, {})
        assert why == f"{method} {route} is not allowed with a token scoped to scenario 'mine'"


def request(method: str, route: str, body: Any = None, **params: str) -> Any:
    return SimpleNamespace(method=method, route=route, match_info=params, query={}, body=body)


def test_serving_a_run_start_checks_the_body_and_records_the_run() -> None:
    scope = Scope("mine", expires=0)
    seen: list[Any] = []

    async def handler(req: Any) -> Any:
        seen.append(req)
        return SimpleNamespace(status=201, body=orjson.dumps({"run": f"run-{len(seen)}"}))

    async def read_json(req: Any) -> Any:
        return req.body

    async def go() -> None:
        with pytest.raises(Forbidden, match="starts runs of scenario 'mine' only, not 'theirs'") as e:
            await scope.serve(request("POST", "/reef/runs", {"scenario": "theirs"}), handler, read_json)
        assert e.value.status == 403 and not seen
        for body in (None, ["mine"], {"name": "mine"}):
            with pytest.raises(Forbidden, match="not None"):
                await scope.serve(request("POST", "/reef/runs", body), handler, read_json)
        assert not seen and scope.runs == set()
        await scope.serve(request("POST", "/reef/runs", {"scenario": same("mine")}), handler, read_json)
        assert scope.runs == {"run-1"}
        # a route whose handler answers the same (a read of the records): its body is not read, no run recorded
        listing = request("GET", "/reef/records", None)
        listing.query = {"run": "run-1"}
        await scope.serve(listing, handler, read_json)
        assert scope.runs == {"run-1"} and seen[-1] is listing
        del seen[-1]
        # a route refused before its handler runs: nothing is served, nothing recorded
        with pytest.raises(Forbidden, match="samples scenario 'mine' only"):
            await scope.serve(request("POST", "/s/{scenario}/v1/messages", scenario="theirs"), handler, read_json)
        assert len(seen) == 1
        # a sampling request of its scenario is served, and records no run
        await scope.serve(request("POST", "/s/{scenario}/v1/messages", scenario="mine"), handler, read_json)
        assert len(seen) == 2 and scope.runs == {"run-1"}

    asyncio.run(go())


def test_a_run_start_that_is_not_created_records_no_run() -> None:
    scope = Scope("mine", expires=0)

    async def go() -> None:
        for status in (200, 400, 409):
            async def handler(req: Any, status: int = status) -> Any:
                return SimpleNamespace(status=status, body=orjson.dumps({"run": "run-x"}))

            async def read_json(req: Any) -> Any:
                return req.body

            await scope.serve(request("POST", "/reef/runs", {"scenario": "mine"}), handler, read_json)
        assert scope.runs == set()

    asyncio.run(go())


def test_tokens_are_minted_with_a_bounded_life_and_end_at_their_deadline_or_revoke() -> None:
    clock = Clock()
    scopes = Scopes(clock)
    for ttl in (0, -1, MAX_TTL_S + 1, 86_401, float("nan")):
        with pytest.raises(ValueError, match="ttl_s must be in"):
            scopes.mint("s", ttl)
    assert len(scopes) == 0
    long = scopes.mint("s", MAX_TTL_S)  # exactly a day is allowed
    assert MAX_TTL_S == 86_400 and long.startswith(PREFIX) and len(long) == len(PREFIX) + 43  # 32 random bytes
    short = scopes.mint("s", 0.5)  # a fraction of a second is a life too
    assert scopes.revoke(short)
    token = scopes.mint("s", 10)
    assert token != long and len(scopes) == 2
    scope = scopes.get(token)
    assert scope is not None and scope.scenario == "s" and scope.expires == clock.now + 10
    clock.now += 9.999
    assert scopes.get(token) is scope
    clock.now += 0.001  # at the deadline: over
    assert scopes.get(token) is None and len(scopes) == 1
    late = scopes.mint("s", 10)
    clock.now += 11  # past the deadline: over too
    assert scopes.get(late) is None
    assert scopes.get(long) is not None
    assert scopes.revoke(long) is True and scopes.revoke(long) is False
    assert scopes.get(long) is None and len(scopes) == 0


def test_only_live_scoped_tokens_are_known() -> None:
    clock = Clock()
    scopes = Scopes(clock)
    token = scopes.mint("s", 10)
    assert scopes.get(token[len(PREFIX):]) is None  # the same secret without the prefix
    assert scopes.get(PREFIX + "x" * 43) is None  # a well-formed unknown one
    assert scopes.get("") is None and scopes.revoke("nope") is False
    assert scopes.get(token + "\ud800") is None  # a lone surrogate is hashed, never a crash


def test_expired_tokens_are_swept_when_another_is_minted_or_counted() -> None:
    clock = Clock()
    scopes = Scopes(clock)
    old = scopes.mint("s", 5)
    clock.now += 5
    scopes.mint("s", 5)  # sweeps the expired one out of memory
    assert list(scopes._live.values())[0].expires == clock.now + 5 and len(scopes._live) == 1
    assert scopes.get(old) is None
    clock.now += 4
    assert len(scopes) == 1
    clock.now += 1.5  # past its deadline
    assert len(scopes) == 0 and not scopes._live
