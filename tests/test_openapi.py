"""``GET /openapi.json``: the document names every route of the route table (and nothing else), it is open like
``/healthz``, and Schemathesis fuzzes a real daemon from it: no 5xx anywhere, every 4xx in the canonical shape.

The fuzzing daemon is the usual one (the tiny model, over a real TCP socket, with the token) with
``max_tokens_limit = 8`` on its model, so that a generated ``max_tokens`` of two billion costs eight tokens: the
number of examples is bounded, not the routes or the values they get.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from daemon import app, openapi, web
from tests.conftest import Daemon, assert_canonical_error, make_home

pytestmark = pytest.mark.slow

# examples per operation in the fuzzing phase (positive and negative data): the module takes about a minute on a busy
# 2-core machine. REEF_FUZZ_EXAMPLES=500 hunts longer, with the coverage phase on the provider routes too.
EXAMPLES = int(os.environ.get("REEF_FUZZ_EXAMPLES", "10"))
DEEP = "REEF_FUZZ_EXAMPLES" in os.environ

# What is not fuzzed, and why (nothing else is left out):
EXCLUDED = {
    # a server-sent event stream that ends only when the daemon stops or drops the subscriber: every call would
    # hang until the client's timeout (its guards and its 4xx are tested in tests/test_web.py and test_events*)
    ("GET", "/reef/events"),
}


@pytest.fixture(scope="module")
def fuzzed(tiny_model: Path) -> Iterator[Daemon]:
    home, port, env = make_home(tiny_model)
    with (home / "config.toml").open("a") as f:
        f.write("max_tokens_limit = 8\n")  # [models.tiny] is the last table make_home writes
    d = Daemon(home=home, port=port, env=env).start()
    d.wait_loaded()
    yield d
    d.stop()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def served(fuzzed: Daemon) -> dict[str, Any]:
    """The document as the daemon serves it, fetched over TCP without a token."""
    with httpx.Client(base_url=fuzzed.url, timeout=60) as c:
        resp = c.get("/openapi.json")
    assert resp.status_code == 200, resp.text[:500]
    return dict(resp.json())


def _operations(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m.upper(), path) for path, ops in doc["paths"].items() for m in ops}


def test_the_document_is_the_route_table(served: dict[str, Any]) -> None:
    """Bug caught: a route added to (or removed from) daemon/app.py without its description in daemon/openapi.py;
    a document that lists a method the route does not take, or misses one it does."""
    routes = app.router().routes()
    assert _operations(served) == set(routes)
    assert openapi.undescribed(routes) == []
    assert openapi.unused(routes) == []
    for path, ops in served["paths"].items():
        for method, op in ops.items():
            assert "x-reef-undescribed" not in op, (method, path)
            declared = {p["name"] for p in op["parameters"] if p["in"] == "path"}
            assert declared == set(re.findall(r"\{(\w+)\}", path)), (method, path)
            assert "default" in op["responses"], (method, path)
    assert served["openapi"] == "3.1.0"
    schemathesis.openapi.from_dict(served).validate()  # the OpenAPI 3.1 meta-schema


def test_a_route_without_description_is_named() -> None:
    """Bug caught: the check that keeps the document whole passing when a route has no description (the document
    is made from the table, so the route is there, marked, and ``undescribed`` names it); and a description of no
    route (a route removed) left behind unnoticed."""
    r = app.router()
    r.add("POST", "/reef/scenarios/{name}/frobnicate", lambda request: None)  # type: ignore[arg-type, return-value]
    assert openapi.undescribed(r.routes()) == [("POST", "/reef/scenarios/{name}/frobnicate")]
    op = openapi.document(r.routes(), "test")["paths"]["/reef/scenarios/{name}/frobnicate"]["post"]
    assert op["x-reef-undescribed"] is True
    fewer = [route for route in app.router().routes() if route != ("GET", "/reef/status")]
    assert openapi.unused(fewer) == [("GET", "/reef/status")]
    # a provider route is described once for its three forms: dropping one form leaves the description in use
    assert openapi.unused([rt for rt in app.router().routes() if rt != ("POST", "/s/{scenario}/v1/responses")]) == []


def test_routes_lists_every_method() -> None:
    """Bug caught: ``Router.routes`` keeping one method per path (GET and POST share /reef/scenarios)."""
    r = web.Router()
    r.add("GET", "/a", None)  # type: ignore[arg-type]
    r.add("POST", "/a", None)  # type: ignore[arg-type]
    r.add("GET", "/b/{x}", None)  # type: ignore[arg-type]
    r.add("POST", "/b/{x}", None)  # type: ignore[arg-type]
    assert sorted(r.routes()) == [("GET", "/a"), ("GET", "/b/{x}"), ("POST", "/a"), ("POST", "/b/{x}")]


def test_the_document_is_open_like_healthz(fuzzed: Daemon, served: dict[str, Any]) -> None:
    """The document needs no token on TCP (like /healthz; it names nothing of the user's), the routes beside it
    still do, and the Host check still applies to it. Bug caught: /openapi.json behind the token (a client generator
    cannot read it), or its opening widened to other paths."""
    with httpx.Client(base_url=fuzzed.url, timeout=60) as c:
        assert c.get("/openapi.json").status_code == 200
        assert_canonical_error(c.get("/reef/status"), 401)
        assert_canonical_error(c.get("/openapi.json/"), 401)
        assert_canonical_error(c.get("/openapi.json", headers={"Host": "evil.example"}), 400)
        body = c.get("/openapi.json").text
    assert fuzzed.token not in body and str(fuzzed.home) not in body
    # the scoped socket (a sandbox's only way in) answers it as it answers /healthz, and nothing else without a token
    with fuzzed.unix() as c:
        c.post("/reef/tokens", json={"scenario": "sandboxed", "ttl_s": 60}).raise_for_status()
    transport = httpx.HTTPTransport(uds=str(fuzzed.home / "scoped.sock"))
    with httpx.Client(base_url="http://localhost", transport=transport, timeout=60) as c:
        assert c.get("/openapi.json").json()["paths"] == served["paths"]
        assert c.get("/healthz").status_code == 200
        assert_canonical_error(c.get("/reef/status"), 401)


# --- Schemathesis against the real daemon ---------------------------------------------------------------------


@pytest.fixture
def api_schema(fuzzed: Daemon, served: dict[str, Any]) -> Any:
    from schemathesis.config import SchemathesisConfig

    # the provider bodies are large open schemas: Schemathesis' coverage phase (every boundary of every field) makes
    # hundreds of cases a route there and costs most of a minute of CPU; they get the fuzzing phase, as all routes do
    config = SchemathesisConfig.from_dict({"operations": [] if DEEP else [
        {"include-path-regex": "/v1/", "phases": {"coverage": {"enabled": False}}}]})
    return schemathesis.openapi.from_dict(served, config=config)


schema = schemathesis.pytest.from_fixture("api_schema")  # the fixture's own filters are not kept: exclude here
for _method, _path in EXCLUDED:
    schema = schema.exclude(method=_method, path=_path)


def canonical_error(ctx: Any, response: Any, case: Any) -> bool:
    """Every 4xx in the canonical shape of its route: the provider's (Anthropic's under /v1/messages) or Reef's."""
    if 400 <= response.status_code < 500 and case.method != "HEAD":
        shape = "anthropic" if "/v1/messages" in case.path else "reef"
        assert_canonical_error(response, response.status_code, shape)
    return True


@schema.parametrize()
@pytest.mark.timeout(3600 if DEEP else 300)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz(case: Any, fuzzed: Daemon) -> None:
    """No 5xx on any route from anything the schema (or its negation) allows, every 4xx canonical, every answer
    in the shape and type the document says."""
    response = case.call(base_url=fuzzed.url, headers={"Authorization": f"Bearer {fuzzed.token}"}, timeout=60)
    case.validate_response(response, checks=[schemathesis.checks.not_a_server_error, status_code_conformance,
                                             content_type_conformance, response_schema_conformance, canonical_error])



# --- what Schemathesis found (each fixed in the product; the test names the bug) -----------------------------------


def test_count_tokens_on_a_harness_scenario(fuzzed: Daemon) -> None:
    """Found by the fuzzer: ``count_tokens`` on a scenario whose head is a harness release (every wrapped agent's
    scenario, recipe ``lessons``: Claude Code counts tokens) was a 500 "has no checked-out artifact to load": the
    harness release was handed to the engine as weights, where serving the same request hands it none."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "count these words"}]}
    with fuzzed.http() as c:
        assert c.post("/reef/scenarios", json={"name": "counted-harness", "recipe": "lessons"}).status_code == 201
        plain = c.post("/v1/messages/count_tokens", json=body)
        harness = c.post("/s/counted-harness/v1/messages/count_tokens", json=body)
        served = c.post("/s/counted-harness/v1/messages", json={**body, "max_tokens": 2})
    assert harness.status_code == 200, harness.text
    assert harness.json() == plain.json() and plain.json()["input_tokens"] == served.json()["usage"]["input_tokens"]


def test_the_document_says_which_routes_need_the_token(fuzzed: Daemon, served: dict[str, Any]) -> None:
    """Every operation the document marks open (``security: []``) answers without a token, and every other one is
    a 401 without it, in its route's error shape. Bug caught: a route opened by mistake (or the document claiming
    a token where none is asked)."""
    assert openapi.OPEN_PATHS == {"/healthz", "/openapi.json"}  # widening it is a decision: change this with the docs
    names = {"scenario": "default", "name": "default", "run": "r1", "receipt": "rec_x", "release": "abcd"}
    with httpx.Client(base_url=fuzzed.url, timeout=60) as c:
        for path, ops in served["paths"].items():
            if ("GET", path) in EXCLUDED:
                continue  # a stream; its 401 is in tests/test_hardening.py
            url = re.sub(r"\{(\w+)\}", lambda m: names[m[1]], path)
            for method, op in ops.items():
                resp = c.request(method.upper(), url)
                if op.get("security") == []:
                    assert resp.status_code == 200, (method, path)
                elif method == "head":
                    assert resp.status_code == 401, (method, path)
                else:
                    assert_canonical_error(resp, 401, "anthropic" if "/v1/messages" in path else "reef")
