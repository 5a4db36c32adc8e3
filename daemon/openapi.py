"""``GET /openapi.json``: an OpenAPI 3.1 document of every route the daemon has, made from its route table.

``document(routes)`` walks the router's ``(method, pattern)`` pairs (``web.Router.routes``) and describes each from
``ROUTES`` below, so a route added in ``daemon/app.py`` is in the document at once; one without a description is
listed with ``x-reef-undescribed`` (``undescribed`` names them) and ``tests/test_openapi.py`` fails until it has one.
Reef's own routes are described exactly: path and query parameters, the body each handler checks, the main answer,
the error shape. Provider routes are described as far as Reef checks them (the fields the wire formats read, with
the limits ``daemon/protocols`` enforces; everything else in a body is the provider's and passes through).

The document is open wherever ``/healthz`` is (``OPEN_PATHS``: no token on TCP, nor on the scoped socket): it is the
same for every daemon of this version and names nothing of the user's (no scenario, model, path or token), and client
generators and fuzzers read it before they hold a token. The ``Host`` check still applies.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from daemon.protocols.schemas import CHAT, COUNT_TOKENS, MESSAGES, RESPONSES

OPEN_PATHS = frozenset({"/healthz", "/openapi.json"})  # answered without a token (the Host check applies)
PREFIXES = ("/s/{scenario}/r/{run}", "/s/{scenario}")  # the base-URL forms of the provider routes

# --- schema helpers ----------------------------------------------------------------------------------------------

S: dict[str, Any] = {"type": "string"}
I: dict[str, Any] = {"type": "integer"}  # noqa: E741
N: dict[str, Any] = {"type": "number"}
B: dict[str, Any] = {"type": "boolean"}
O: dict[str, Any] = {"type": "object"}  # noqa: E741
ANY: dict[str, Any] = {}


def ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(props: dict[str, Any], required: Iterable[str] = (), *, closed: bool = False) -> dict[str, Any]:
    """A JSON object schema; ``closed``: the handler refuses keys it does not know."""
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required := list(required):
        out["required"] = required
    if closed:
        out["additionalProperties"] = False
    return out


def arr(items: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"type": "array", "items": items, **kw}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


# the one check of names (daemon/names.py) as a pattern: 1-64 of A-Z a-z 0-9 . _ -, from a letter or digit, no
# "..", not ending in "." or ".lock"
SCENARIO_NAME = {"type": "string", "pattern": r"^(?!.*\.\.)(?!.*\.lock$)(?!.*\.$)[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"}
RUN_NAME = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"}
PATH_PARAMS = {"scenario": ref("ScenarioName"), "name": ref("ScenarioName"), "run": ref("RunName"),
               "receipt": {"type": "string", "description": "a receipt (record id, rec_...)"},
               "release": {"type": "string", "pattern": "^[0-9a-fA-F]{4,40}$",
                           "description": "a release id (a git commit id, or an unambiguous prefix of it)"}}

SCHEMAS: dict[str, Any] = {
    "Error": obj({"error": obj({"type": S, "message": S, "param": nullable(S)}, ["type", "message"])}, ["error"]),
    "OpenAIError": obj({"error": obj({"type": S, "message": S, "code": nullable(S), "param": nullable(S)},
                                     ["type", "message"])}, ["error"]),
    "AnthropicError": obj({"type": {"const": "error"}, "error": obj({"type": S, "message": S}, ["type", "message"])},
                          ["type", "error"]),
    "ScenarioName": SCENARIO_NAME,
    "RunName": RUN_NAME,
    "Scenario": obj({"name": S, "recipe": S, "model": S, "created_at": N, "settings": O, "capture": B, "paused": B,
                     "archived": B, "warning": nullable(O)}, ["name", "recipe", "model", "created_at", "settings", "capture", "paused",
                                      "archived"]),
    "Release": obj({"release_id": S, "content_id": S, "scenario": S, "step": I, "operation": S, "kind": S,
                    "recipe": S, "parent": nullable(S), "source": nullable(S), "metrics": O, "receipts": arr(S),
                    "settings": O, "created_at": N, "message": S},
                   ["release_id", "content_id", "scenario", "step", "operation", "kind", "recipe", "parent",
                    "created_at"]),
    "Record": obj({"seq": I, "id": S, "kind": {"enum": ["exchange", "report"]}, "scenario": S, "run": nullable(S),
                   "created_at": N, "status": nullable(S), "release_id": nullable(S)},
                  ["id", "kind", "scenario", "created_at"]),
    "Records": obj({"records": arr(ref("Record")), "next_after": nullable(I)}, ["records", "next_after"]),
    "InFlight": obj({"receipt": S, "scenario": S, "run": nullable(S), "model": S, "stream": B, "elapsed_s": N,
                     "prompt_tokens": nullable(I), "output_tokens": nullable(I), "output_cap": nullable(I)},
                    ["receipt", "scenario", "elapsed_s", "output_tokens"]),
    "Report": obj({"report_id": S, "scenario": S, "created_at": N, "score": nullable(N), "feedback": ANY,
                   "references": arr(S), "metadata": nullable(O)}, ["report_id", "scenario", "created_at"]),
}

# --- the description of each route ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One route: what it does, its query parameters (``required`` among them), its JSON body, its main answer
    (``status``, ``answer`` in ``media``), the errors worth naming (the rest fall under ``default``)."""

    summary: str
    answer: dict[str, Any] | None = None  # None: no body (HEAD)
    status: int = 200
    media: tuple[str, ...] = ("application/json",)
    body: dict[str, Any] | None = None
    query: dict[str, Any] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    errors: dict[int, str] = field(default_factory=dict)
    tag: str = "reef"


CHAT_ANSWER = obj({"id": S, "object": S, "model": S, "choices": arr(O), "usage": O, "reef": O},
                  ["id", "choices"])
RESPONSES_ANSWER = obj({"id": S, "object": S, "model": S, "output": arr(O), "status": S, "usage": O, "reef": O},
                       ["id", "output"])
MESSAGES_ANSWER = obj({"id": S, "type": S, "role": S, "model": S, "content": arr(O), "stop_reason": nullable(S),
                       "usage": O, "reef": O}, ["id", "content"])
MODELS = obj({"object": S, "data": arr(obj({"id": S, "object": S, "created": I, "owned_by": S}, ["id"])),
              "has_more": B, "first_id": nullable(S), "last_id": nullable(S)}, ["data"])
SSE = "text/event-stream"
SSE_EVENT = obj({"event": S, "data": S, "id": S}, ["data"])  # one event of a stream (as OpenAPI 3.2's itemSchema)
_SAMPLE_ERRORS = {400: "a body the format refuses (naming the field), a bad scenario or run name, a prompt longer "
                       "than the model's context", 404: "x-reef-release-id not on the scenario's chain"}

PROVIDER: dict[tuple[str, str], Op] = {
    ("POST", "/v1/chat/completions"): Op("OpenAI chat completions, whole or streamed (stream: true)", CHAT_ANSWER,
                                         media=("application/json", SSE), body=CHAT, errors=_SAMPLE_ERRORS,
                                         tag="provider"),
    ("POST", "/v1/responses"): Op("OpenAI Responses, whole or streamed", RESPONSES_ANSWER,
                                  media=("application/json", SSE), body=RESPONSES, errors=_SAMPLE_ERRORS,
                                  tag="provider"),
    ("POST", "/v1/messages"): Op("Anthropic Messages, whole or streamed (also ?beta=true)", MESSAGES_ANSWER,
                                 media=("application/json", SSE), body=MESSAGES, errors=_SAMPLE_ERRORS,
                                 query={"beta": S}, tag="provider"),
    ("POST", "/v1/messages/count_tokens"): Op("Anthropic token count of a Messages request, by the scenario's model",
                                              obj({"input_tokens": I}, ["input_tokens"]), body=COUNT_TOKENS,
                                              query={"beta": S}, errors={400: "a body the format refuses"},
                                              tag="provider"),
    ("GET", "/v1/models"): Op("the configured models (OpenAI and Anthropic list shapes in one)", MODELS,
                              tag="provider"),
    ("HEAD", ""): Op("a client's pre-connect on its base URL", tag="provider"),
    ("HEAD", "/"): Op("a client's pre-connect on its base URL", tag="provider"),
}

CREATED = 201
SCENARIO_404 = {404: "no such scenario"}
STEER = obj({"release_id": {"type": "string", "minLength": 1}, "expected_head": nullable(S)}, ["release_id"])
TASK = obj({"receipt": {"type": "string", "minLength": 1}, "check": {"type": "string", "minLength": 1},
            "workspace": S, "id": S, "time_limit_s": N, "check_timeout_s": N}, ["receipt", "check"], closed=True)
UNIT = {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}
CANARY = obj({"release_id": {"type": "string", "minLength": 1}, "share": UNIT, "alpha": UNIT, "max_error_rate": UNIT,
              "max_reports": {"type": "integer", "minimum": 1}, "min_exchanges": {"type": "integer", "minimum": 1},
              "max_latency_ratio": {"type": "number", "minimum": 1}, "max_empty_excess": UNIT,
              "min_length_ratio": UNIT, "max_loop_excess": UNIT, "guard_answers": {"type": "integer", "minimum": 1},
              "max_answers": nullable({"type": "integer", "minimum": 1}),
              "max_hours": nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 10 ** 6})}, ["release_id"],
             closed=True)
IMPORT_ITEM = obj({"id": {"type": "string", "pattern": "^rec_[A-Za-z0-9_-]{1,96}$"}, "scenario": ref("ScenarioName"),
                   "prompt": arr(obj({"role": S, "content": S}, ["role", "content"]), minItems=1),
                   "completion": arr(obj({"role": S, "content": S}, ["role", "content"]), minItems=1),
                   "score": N, "feedback": {"anyOf": [S, O, arr(ANY)]}, "model": {"type": "string", "minLength": 1,
                                                                                   "maxLength": 200},
                   "run": ref("RunName"), "created_at": {"type": "number", "minimum": 0}}, ["prompt", "completion"])
LISTING = {"after": {"type": "integer", "minimum": 0, "maximum": 2**62}, "limit": {"type": "integer", "minimum": 1,
                                                                                     "maximum": 1000},
           "run": ref("RunName"), "kind": {"enum": ["exchange", "report"]}, "order": {"enum": ["asc", "desc"]}}
RELEASE_VIEW = {"allOf": [ref("Release"), obj({"head": S, "adapter": nullable(O), "diff": O}, ["head"])]}
SWITCHED = ref("Scenario")
FIGURE = obj({"status": {"enum": ["ok", "n/a", "failed"]}, "value": N, "n": I, "source": S, "reason": S}, ["status"])
EVAL = obj({"scenario": S, "recipe": S, "kind": S, "head": nullable(S), "transfer": nullable(S), "base": O,
            "reward_how": nullable(S), "probes_how": nullable(S), "transfer_how": nullable(S),
            "rows": arr(obj({"release_id": S, "step": I, "operation": S, "content_id": S, "head": B,
                             "reward": FIGURE, "probes": FIGURE, "forgetting": FIGURE, "transfer": FIGURE},
                            ["release_id", "step", "reward", "probes", "forgetting", "transfer"])),
            "measured": I, "cached": I, "seconds": N}, ["scenario", "rows"])
EVAL_QUERY = {"last": {"type": "integer", "minimum": 1, "maximum": 100_000}, "transfer": ref("ScenarioName")}


def _reef_routes() -> dict[tuple[str, str], Op]:
    from adapters import ADAPTERS

    adapter = {"enum": list(ADAPTERS)}
    return {
        ("GET", "/"): Op("what this server is, and its main routes", obj({"name": S, "api": arr(S)}, ["name"])),
        ("GET", "/healthz"): Op("liveness and model loads (no token)", obj({"ok": B, "pid": I, "uptime_s": N,
                                                                           "models": O}, ["ok", "models"])),
        ("GET", "/openapi.json"): Op("this document (no token)", O),
        ("GET", "/metrics"): Op("Prometheus metrics", S, media=("text/plain",)),
        ("POST", "/reef/report"): Op(
            "a report (score, feedback or both) on one or more receipts; report_id makes a retry idempotent",
            ref("Report"), CREATED, body=obj({
                "score": N, "feedback": {"anyOf": [S, O, arr(ANY)]},
                "references": arr({"type": "string", "minLength": 1}, minItems=1, maxItems=10_000),
                "metadata": obj({"training": obj({"eligible": B})}), "report_id": {"type": "string", "minLength": 1,
                                                                                   "maxLength": 200,
                                                                                   "not": {"pattern": "^import:"}},
                "scenario": ref("ScenarioName")}, ["references"], closed=True)
            | {"anyOf": [{"required": ["score"]}, {"required": ["feedback"]}]},
            errors={404: "unknown receipts (named)", 409: "same report_id, another body"}),
        ("GET", "/reef/scenarios"): Op("every scenario with its counts", obj({"scenarios": arr(ref("Scenario"))},
                                                                            ["scenarios"])),
        ("POST", "/reef/scenarios"): Op(
            "create a scenario (or take the existing one when the binding is the same)",
            {"allOf": [ref("Scenario"), obj({"head": S}, ["head"])]}, CREATED,
            body=obj({"name": ref("ScenarioName"), "recipe": S, "model": S, "base_release": S, "settings": O,
                      "capture": B, "paused": B}, ["name"]),
            errors={404: "base_release unknown", 409: "the scenario is bound to another recipe"}),
        ("GET", "/reef/scenarios/{name}"): Op("one scenario, with its recipe's own status", ref("Scenario"),
                                              errors=SCENARIO_404),
        ("GET", "/reef/scenarios/{name}/records"): Op("a scenario's records, a page at a time", ref("Records"),
                                                      query=LISTING),
        ("GET", "/reef/records"): Op("records of every scenario (or one), a page at a time", ref("Records"),
                                     query={**LISTING, "scenario": ref("ScenarioName")}),
        ("GET", "/reef/records/export"): Op(
            "exchanges with their reports as JSON Lines (the export shape of docs/your-data.md), streamed", S,
            media=("application/x-ndjson",), query={"scenario": ref("ScenarioName"), "since": N},
            errors=SCENARIO_404),
        ("POST", "/reef/records/import"): Op(
            "exchanges in the export shape, stored in one transaction, idempotent by id",
            obj({"imported": I, "skipped": I, "reports": I}), CREATED,
            body=obj({"items": arr(IMPORT_ITEM, minItems=1, maxItems=1000), "scenario": ref("ScenarioName"),
                      "first_line": I}, ["items"]),
            errors={409: "an item's report would take a report_id another report holds (param names the item)"}),
        ("GET", "/reef/records/{receipt}"): Op("one record in full", ref("Record"), errors={404: "no such receipt"}),
        ("POST", "/reef/records/forget"): Op(
            "forget exchanges (by receipt or run): their content goes, the fact stays",
            obj({"forgotten": arr(S), "scenarios": arr(S), "releases": O}, ["forgotten", "scenarios"]),
            body=obj({"receipts": arr({"type": "string", "minLength": 1}, maxItems=100_000),
                      "runs": arr({"type": "string", "minLength": 1}, maxItems=100_000), "scrub": B}),
            errors={404: "unknown receipts (named)"}),
        ("GET", "/reef/scenarios/{name}/releases"): Op(
            "a scenario's release chain (all=1: with held and rejected candidates)",
            obj({"scenario": S, "head": S, "releases": arr(ref("Release")), "forgotten": O, "canary": nullable(O),
                 "pending": arr(O), "rejected": arr(O)}, ["scenario", "head", "releases"]),
            query={"limit": {"type": "integer", "minimum": 1, "maximum": 100_000}, "all": S}, errors=SCENARIO_404),
        ("GET", "/reef/scenarios/{name}/releases/{release}"): Op(
            "one release of the scenario, with its diff to its parent", RELEASE_VIEW, query={"diff": S},
            errors={404: "no such release in this scenario"}),
        ("GET", "/reef/scenarios/{name}/eval"): Op(
            "reef eval: per release, the held-out reward, probe accuracy against the base and transfer, from what "
            "is known (recorded at the gate, cached, reported); measures nothing", EVAL, query=EVAL_QUERY,
            errors={**SCENARIO_404, 400: "a transfer scenario that does not exist, or is this one"}),
        ("POST", "/reef/scenarios/{name}/eval"): Op(
            "reef eval, measuring what is missing through the engine: JSON Lines of progress, then the result",
            S, media=("application/x-ndjson",), query=EVAL_QUERY,
            errors={**SCENARIO_404, 400: "a transfer scenario that does not exist, or is this one"}),
        ("POST", "/reef/scenarios/{name}/rollback"): Op(
            "publish an earlier release's content as the new head", ref("Release"), CREATED, body=STEER,
            errors={**SCENARIO_404, 409: "the head moved (names both)"}),
        ("POST", "/reef/scenarios/{name}/promote"): Op(
            "publish a candidate held for review", ref("Release"), CREATED, body=STEER,
            errors={**SCENARIO_404, 409: "the head moved, or the release serves as a canary"}),
        ("POST", "/reef/scenarios/{name}/bundle"): Op(
            "publish one release holding a weights release's adapter, a harness release's files and the evidence for "
            "both (daemon/releases/bundle.py), on a scenario that does not train", ref("Release"), CREATED,
            body=obj({"weights": {"type": "string", "minLength": 1}, "harness": {"type": "string", "minLength": 1},
                      "expected_head": nullable(S)}, ["weights", "harness"], closed=True),
            errors={**SCENARIO_404, 400: "the scenario learns or serves a harness, a release is not an adapter or a "
                    "harness, or the harness holds what the policy refuses or holds for review",
                    409: "the head moved, or the bundle equals the head"}),
        ("GET", "/reef/releases/{release}"): Op("one release, with its diff (diff=0: without)", RELEASE_VIEW,
                                                query={"diff": S}, errors={404: "no such release"}),
        ("GET", "/reef/releases/{release}/page"): Op(
            "one release as a self-contained HTML page: why, what changed, the gate's verdict, its place on the chain",
            S, media=("text/html",), errors={404: "no such release"}),
        ("GET", "/reef/scenarios/{name}/releases/{release}/page"): Op(
            "one release of the scenario as a self-contained HTML page", S, media=("text/html",),
            errors={404: "no such release in this scenario"}),
        ("POST", "/reef/scenarios/{name}/proposals"): Op(
            "an agent's proposed change to its own harness: screened and gated like any candidate (202: queued for "
            "a recipe that evaluates in the background)",
            obj({"proposal": S, "scenario": S, "op": S, "kind": S, "verdict": S}, ["proposal", "verdict"]), CREATED,
            body=obj({"op": {"enum": ["add", "replace", "retire"]}, "kind": {"enum": ["rule", "skill"]}, "name": S,
                      "text": S, "reason": {"type": "string", "minLength": 1}, "run": S}, ["op", "kind", "reason"],
                     closed=True),
            errors={**SCENARIO_404, 409: "the scenario is paused or archived, or the rule or skill exists",
                    413: "the proposal is too large"}),
        ("GET", "/reef/scenarios/{name}/proposals"): Op(
            "the scenario's agent proposals with their verdicts (admitted, held, screened, rejected with the gate's "
            "figures, failed, pending), newest first, a page at a time",
            obj({"scenario": S, "proposals": arr(obj({
                "id": S, "at": nullable(N), "op": nullable(S), "target": nullable(S), "reason": nullable(S),
                "run": nullable(S), "receipt": nullable(S), "decided_at": nullable(N), "verdict": S,
                "release_id": S, "candidate": S, "step": I, "screen": S, "why": S, "metrics": O, "reviewed": B},
                ["id", "verdict"])), "next_after": nullable(S)}, ["scenario", "proposals", "next_after"]),
            query={"limit": {"type": "integer", "minimum": 1, "maximum": 1000}, "after": S},
            errors={**SCENARIO_404, 400: "after names no proposal of the scenario"}),
        ("POST", "/reef/runs"): Op(
            "a wrapped agent's run: its id and the scenario's harness in the agent's layout",
            obj({"run": S, "scenario": S, "recipe": S, "model": S, "kind": S, "release_id": nullable(S), "step": I,
                 "files": O}, ["run", "scenario"]), CREATED,
            body=obj({"adapter": adapter, "scenario": ref("ScenarioName"), "installed_release": S}, ["adapter"])),
        ("GET", "/reef/scenarios/{name}/harness"): Op(
            "the current release's harness files (adapter: rendered in that agent's layout)",
            obj({"scenario": S, "release_id": S, "step": I, "adapter": nullable(S), "files": O},
                ["scenario", "files"]), query={"adapter": adapter}, errors=SCENARIO_404),
        ("POST", "/reef/scenarios/{name}/evolve"): Op(
            "a direct instruction, stored as a report and learned from at once",
            obj({"report_id": S, "verdict": S}, ["report_id", "verdict"]), CREATED,
            body=obj({"instruction": {"type": "string", "minLength": 1, "maxLength": 10_000, "pattern": r"\S"},
                      "skill": {"type": "string", "pattern": "^[a-z0-9][a-z0-9-]{0,62}$"}}, ["instruction"])),
        ("POST", "/reef/scenarios/{name}/tasks"): Op(
            "a recorded run's prompt as a harness-search task", obj({"scenario": S, "task": O, "tasks": arr(S)},
                                                                    ["task"]), CREATED, body=TASK,
            errors={404: "no such scenario or receipt", 409: "a task of that id exists"}),
        ("POST", "/reef/scenarios/{name}/model"): Op(
            "move a scenario without weights to another configured model",
            {"allOf": [ref("Scenario"), obj({"previous_model": S})]},
            body=obj({"model": {"type": "string", "minLength": 1}}, ["model"]),
            errors={**SCENARIO_404, 409: "a weights chain cannot move"}),
        ("POST", "/reef/scenarios/{name}/pause"): Op("pause the scenario's learning", SWITCHED,
                                                     errors=SCENARIO_404),
        ("POST", "/reef/scenarios/{name}/resume"): Op("resume the scenario's learning (clears an early warning)",
                                                      SWITCHED, errors=SCENARIO_404),
        ("POST", "/reef/scenarios/{name}/accept-warning"): Op(
            "accept the scenario's early warning: learning goes on, no warning again until its settings change",
            SWITCHED, errors={**SCENARIO_404, 409: "no early warning stands"}),
        ("POST", "/reef/scenarios/{name}/settings"): Op(
            "change the scenario's recipe settings (null: back to the default); clears an early warning", SWITCHED,
            body=obj({"settings": O}, ["settings"]), errors={**SCENARIO_404, 400: "a setting the recipe refuses"}),
        ("POST", "/reef/scenarios/{name}/capture"): Op("turn the scenario's capture on or off", SWITCHED,
                                                       body=obj({"capture": B}, ["capture"]), errors=SCENARIO_404),
        ("POST", "/reef/scenarios/{name}/archive"): Op("archive the scenario: neither served nor trained", SWITCHED,
                                                       errors={**SCENARIO_404, 409: "a step is out"}),
        ("POST", "/reef/scenarios/{name}/unarchive"): Op("bring an archived scenario back", SWITCHED,
                                                         errors=SCENARIO_404),
        ("POST", "/reef/scenarios/{name}/canary"): Op(
            "serve a held candidate to a share of new runs, judged live", O, CREATED, body=CANARY,
            errors={404: "no such scenario or held candidate", 409: "a canary runs already"}),
        ("GET", "/reef/scenarios/{name}/canary"): Op("the running canary and its figures", O,
                                                     errors={404: "no such scenario, or no canary"}),
        ("POST", "/reef/scenarios/{name}/canary/end"): Op(
            "end the canary: promote its candidate or discard it", O, body=obj({"promote": B}),
            errors={404: "no such scenario, or no canary"}),
        ("GET", "/reef/harness/install"): Op("a POSIX shell installer of the reef-<adapter> wrapper", S,
                                             media=("text/x-shellscript",),
                                             query={"adapter": adapter, "scenario": ref("ScenarioName")},
                                             required=("adapter",)),
        ("GET", "/reef/status"): Op("the daemon's state: models, counts, learning, events", obj({
            "pid": I, "home": S, "uptime_s": N, "listen": O, "default_model": S, "models": O, "records": I,
            "reports": I, "scenarios": I, "learning": O, "spend": O, "events": O, "inflight": arr(ref("InFlight"))},
            ["pid", "models", "records"])),
        ("GET", "/reef/inflight"): Op("the exchanges being served now: elapsed time and tokens so far",
                                      obj({"inflight": arr(ref("InFlight"))}, ["inflight"]),
                                      query={"run": ref("RunName"), "scenario": ref("ScenarioName")}),
        ("GET", "/reef/events"): Op("server-sent events: records, reports, steps, verdicts, releases, loads (resume "
                                    "with Last-Event-ID or after)", S, media=(SSE,),
                                    query={"after": I}),
        ("POST", "/reef/tokens"): Op(
            "mint a token scoped to one scenario (held in memory, expiring)",
            obj({"token": S, "scenario": S, "ttl_s": N, "socket": S}, ["token", "scenario", "ttl_s"]), CREATED,
            body=obj({"scenario": ref("ScenarioName"), "ttl_s": {"type": "number", "exclusiveMinimum": 0,
                                                                 "maximum": 86400}}, ["scenario"])),
        ("POST", "/reef/tokens/revoke"): Op("revoke a scoped token", obj({"revoked": B}, ["revoked"]),
                                            body=obj({"token": S}, ["token"])),
    }


ROUTES: dict[tuple[str, str], Op] = _reef_routes()

# --- the document --------------------------------------------------------------------------------------------------


def describe(method: str, pattern: str) -> tuple[Op | None, str]:
    """The description of one route, and the prefix it was found under (provider routes are described once for the
    plain path and its base-URL forms)."""
    for prefix in PREFIXES:
        if pattern.startswith(prefix) and (op := PROVIDER.get((method, pattern[len(prefix):]))) is not None:
            return op, prefix
    return PROVIDER.get((method, pattern)) or ROUTES.get((method, pattern)), ""


def undescribed(routes: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The routes with no description (a route added without one)."""
    return [(m, p) for m, p in routes if describe(m, p)[0] is None]


def unused(routes: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The descriptions of no route (one left behind by a route removed)."""
    routes = list(routes)
    used = {(m, p) for m, p in routes} | {(m, p[len(pre):]) for m, p in routes for pre in PREFIXES
                                          if p.startswith(pre)}
    return sorted(k for k in (*ROUTES, *PROVIDER) if k not in used)


def _error_ref(pattern: str) -> dict[str, Any]:
    from daemon.protocols import formats

    wire = formats.for_path(pattern)
    if wire is None:
        return ref("Error")
    return ref("AnthropicError" if wire is formats.ANTHROPIC else "OpenAIError")


def _operation(method: str, pattern: str) -> dict[str, Any]:
    op, prefix = describe(method, pattern)
    if op is None:
        return {"summary": "(undescribed)", "x-reef-undescribed": True,
                "parameters": [_path_param(n) for n in re.findall(r"\{(\w+)\}", pattern)],
                "responses": {"default": {"description": "undescribed"}}}
    params = [_path_param(n) for n in re.findall(r"\{(\w+)\}", pattern)]
    params += [{"name": k, "in": "query", "required": k in op.required, "schema": v} for k, v in op.query.items()]
    if op.tag == "provider" and method == "POST":
        if not prefix:
            params += [{"name": "x-reef-scenario", "in": "header", "required": False, "schema": ref("ScenarioName"),
                        "description": "the scenario (default: default)"},
                       {"name": "x-reef-run", "in": "header", "required": False, "schema": ref("RunName")}]
        params.append({"name": "x-reef-release-id", "in": "header", "required": False, "schema": S,
                       "description": "serve with this release of the scenario's chain instead of its head"})
    ok: dict[str, Any] = {"description": op.summary}
    if op.answer is not None:
        ok["content"] = {m: {"schema": op.answer if m == "application/json" else SSE_EVENT if m == SSE else S}
                         for m in op.media}
    if op.tag == "provider" and method == "POST":
        ok["headers"] = {h: {"schema": S, "description": d} for h, d in (
            ("x-reef-agent-record-id", "the receipt (in a stream: in its final event too)"),
            ("x-reef-release-id", "the release that served it"),
            ("x-reef-model", "the model that answered: the scenario's, whatever the request's model names"))}
    error = {"description": "the canonical error shape",
             "content": {"application/json": {"schema": _error_ref(pattern)}}}
    responses: dict[str, Any] = {str(op.status): ok}
    responses.update({str(code): {**error, "description": why} for code, why in sorted(op.errors.items())})
    responses["default"] = error
    out: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(method, pattern), "tags": [op.tag],
                           "parameters": params, "responses": responses}
    if op.body is not None:
        out["requestBody"] = {"required": True, "content": {"application/json": {"schema": op.body}}}
    if pattern in OPEN_PATHS:
        out["security"] = []
    return out


def _path_param(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": PATH_PARAMS.get(name, S)}


def _operation_id(method: str, pattern: str) -> str:
    words = re.sub(r"[{}]", "", pattern).replace(".", "_").strip("/").replace("/", "_").replace("-", "_")
    return f"{method.lower()}_{words or 'root'}"


def document(routes: Iterable[tuple[str, str]], version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes`` (``web.Router.routes()``)."""
    paths: dict[str, dict[str, Any]] = {}
    for method, pattern in routes:
        paths.setdefault(pattern, {})[method.lower()] = _operation(method, pattern)
    return {
        "openapi": "3.1.0",
        "info": {"title": "Reef", "version": version, "description": (
            "The Reef daemon's HTTP API. Provider routes take the provider's own body (the fields Reef checks are "
            "described; the rest passes through) and answer in its format, errors too; Reef routes answer JSON, "
            "errors as {\"error\": {\"type\", \"message\", ...}}. TCP needs the token (Authorization: Bearer or "
            "x-api-key) except /healthz and /openapi.json; the Unix socket needs none. Every GET route answers "
            "HEAD too. The Host header must be a loopback name.")},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": SCHEMAS, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
        "security": [{"bearer": []}, {"apiKey": []}],
        "tags": [{"name": "provider", "description": "OpenAI- and Anthropic-format routes (also under "
                                                     "/s/{scenario} and /s/{scenario}/r/{run})"},
                 {"name": "reef", "description": "Reef's own routes"}],
    }
