"""Agent-proposed harness changes: a running agent (or its wrapper) proposes to add, replace or retire one rule or
skill of its own scenario's harness, with a reason (``POST /reef/scenarios/{s}/proposals``, ``reef-pi propose``).

What becomes of a proposal:

- Refused at the door (4xx, nothing written): a malformed body (400); a scenario whose recipe learns no harness
  (400); a replace or retire of a rule or skill the serving harness lacks (404 naming it and what there is), an add
  of one it has (409); a body over ``MAX_BYTES`` (413); a ``run`` whose records are another scenario's (400); a
  token scoped to an episode (403, ``daemon/scopes.py``: code running in an evaluation never steers); the scenario
  archived or its learning paused (409 naming which). Refused, not queued: a proposal is the agent's judgement of
  the harness it runs with now; held across a pause it would be applied to whatever harness serves when learning
  resumes, long after the run that could say why has ended. The agent (and its user) hear it at once and can
  propose again.
- Screened, with the screens every harness-search candidate passes (``recipes/harness_search/mutations.py``:
  secrets and instructions to send them anywhere, paths outside the layout, the harness policy of
  ``daemon/harness_policy.py`` (tools, hooks, permissions, MCP servers or environment granted in frontmatter,
  agents' settings files, control characters, instructions to turn off a sandbox), executable content, size caps
  from the recipe's settings). What only a person may admit (a tool grant) is held for review whatever the gate. One that fails is written down on the chain as rejected, its reason naming the screen
  (``screened out by the secrets screen: ...``).
- Gated: the candidate goes through the scenario's recipe's gate like any of its own candidates (the recipe's
  ``assess`` evaluates it as the recipe evaluates its own: lessons' ``compare`` answers its tasks under both
  trees; harness-search runs its paired episodes) and is published, held for review, or written down as rejected
  with the gate's figures. One that cannot be evaluated (the evaluation raised; the gate needs scores that no
  evaluation gave) is written down as failed with the reason, never as a loss.

Every outcome's manifest (release or rejection) carries ``origin``: ``{"kind": "proposal", "id", "at", "op",
"target", "reason", "run", "receipt"}``, the receipt being the newest exchange of the run that proposed it. A recipe that
steps inline (``lessons``) answers the verdict in the request; one that runs episodes (``harness-search``) judges
in the background and answers ``queued`` (``reef releases list --all`` shows the verdict). The route's side (the
run's receipt, inline or queued) is ``daemon/harness.py``'s ``propose``; the learning loop's, ``Learner.propose``.

``GET /reef/scenarios/{s}/proposals`` (``reef scenarios proposals``) lists them with their verdicts (``listing``): read
from the chain (releases, held candidates, the rejection log, each by its ``origin``) and, for those not judged yet,
from the learner's memory (``pending``: a restart forgets them, as it forgets the judging itself).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from daemon.errors import BadRequest, Conflict, NotFound
from daemon.layout import SKILL_NAME
from daemon.names import check_run
from daemon.records import new_id

if TYPE_CHECKING:
    from daemon.records import Scenario
    from recipes.base import Candidate, Recipe
    from recipes.harness_search.mutations import Limits, Mutation

MAX_BYTES = 64 * 1024  # a proposal's text; a larger body is refused (413) before any screen reads it
OPS = {"add": "create", "replace": "update", "retire": "remove"}  # the proposal's words -> the mutation's
KINDS = ("rule", "skill")
MAX_REASON = 500  # as a harness-search mutation's


class Screened(Exception):
    """A proposal that does not pass a screen: ``screen`` names it (``mutations.SCREENS``), ``reason`` says why."""

    def __init__(self, screen: str, reason: str) -> None:
        super().__init__(reason)
        self.screen, self.reason = screen, reason


@dataclass(frozen=True)
class Proposal:
    """One proposed change: ``op`` add | replace | retire, ``kind`` rule | skill, ``name`` the rule's id (or its exact
    text) or the skill's name (None: a new rule gets an id from its text), ``text`` the rule or the skill's
    SKILL.md, ``reason`` why, ``run`` the run that proposes it."""

    op: str
    kind: str
    name: str | None
    text: str | None
    reason: str
    run: str | None = None
    id: str = ""
    at: float = 0.0  # when it came (seconds since the epoch)


def parse(body: dict[str, Any]) -> Proposal:
    """A ``Proposal`` from a request body; ``BadRequest`` (``PayloadTooLarge`` for the size) naming what is wrong."""
    from daemon.errors import PayloadTooLarge

    known = {"op", "kind", "name", "text", "reason", "run"}
    extra = sorted(set(body) - known)
    if extra:
        raise BadRequest(f"unknown keys {', '.join(extra)} (known: {', '.join(sorted(known))})", param=extra[0])
    op, kind = body.get("op"), body.get("kind")
    if not isinstance(op, str) or op not in OPS:  # a list or an object is no op (and no dict key)
        raise BadRequest(f"op must be one of {', '.join(OPS)}, not {op!r}", param="op")
    if not isinstance(kind, str) or kind not in KINDS:
        raise BadRequest(f"kind must be one of {', '.join(KINDS)}, not {kind!r}", param="kind")
    reason = body.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise BadRequest("reason is required: why the harness should change (text)", param="reason")
    if len(reason) > MAX_REASON:
        raise BadRequest(f"reason is {len(reason)} characters; the limit is {MAX_REASON}", param="reason")
    name, text = body.get("name"), body.get("text")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise BadRequest("name must be text: a rule's id (or its exact text), or a skill's name", param="name")
    if text is not None and not isinstance(text, str):
        raise BadRequest("text must be text", param="text")
    size = len((text or "").encode()) + len((name or "").encode())
    if size > MAX_BYTES:
        raise PayloadTooLarge(f"the proposal is {size} bytes; the limit is {MAX_BYTES}", param="text")
    if op == "retire":
        if text is not None:
            raise BadRequest("retire takes no text: name the rule or skill to retire", param="text")
    elif text is None or not text.strip():
        raise BadRequest(f"{op} {kind} needs text: the {'rule' if kind == 'rule' else 'SKILL.md of the skill'}",
                         param="text")
    if name is None and not (op == "add" and kind == "rule"):
        raise BadRequest(f"{op} {kind} needs a name: the {'rule id (or its exact text)' if kind == 'rule' else 'skill'}"
                         " to " + op, param="name")
    if kind == "skill" and name is not None and not SKILL_NAME.fullmatch(name):
        raise BadRequest(f"skill name {name!r} is not a-z, 0-9 and - (at most 63 characters)", param="name")
    run = body.get("run")
    if run is not None:
        check_run(run)
    return Proposal(op, kind, name.strip() if name else None, text, reason.strip(), run, new_id("prop_"), time.time())


def check_open(scenario: Scenario) -> None:
    """Refuse (409, naming why) a proposal while the scenario is archived or its learning is paused."""
    if scenario.archived:
        raise Conflict(f"scenario {scenario.name!r} is archived: it serves no agent and learns nothing; "
                       f"reef scenarios unarchive {scenario.name} first", scenario=scenario.name, why="archived")
    if scenario.paused:
        raise Conflict(f"scenario {scenario.name!r} has its learning paused, so no proposal is judged now; "
                       f"reef scenarios resume {scenario.name}, then propose again", scenario=scenario.name,
                       why="paused")


def limits_of(recipe: Recipe) -> Limits:
    """The screens' size caps: the recipe's own (harness-search's ``limits()``), or its rules caps (lessons'
    ``max_chars``, ``max_rules_bytes``), else the mutations' defaults. One change per proposal."""
    from dataclasses import replace

    from recipes.harness_search.mutations import Limits

    own = getattr(recipe, "limits", None)
    limits = own() if callable(own) else None
    if isinstance(limits, Limits):
        return replace(limits, max_mutations=1)
    s, d = recipe.settings, Limits()
    return Limits(max_mutations=1, max_rule_chars=int(getattr(s, "max_chars", d.max_rule_chars)),
                  max_file_bytes=int(getattr(s, "max_rules_bytes", d.max_file_bytes)))


def mutation(tree: dict[str, bytes], p: Proposal) -> Mutation:
    """The proposal as a mutation of ``tree``: a named rule resolved to its id (or from its exact text), a skill's
    text made a SKILL.md. A replace or retire of what is not there is a ``NotFound`` naming it, an add of what is
    there a ``Conflict``; nothing is written either way."""
    from recipes.harness_search.mutations import Mutation, entries, rule_id, rules
    from recipes.lessons import render_skill

    if p.kind == "rule":
        have = rules(tree)[1]
        ids = [i for i, _ in have]
        if p.name is None:
            target = rule_id(" ".join((p.text or "").split()))
        else:
            by_text = {" ".join(t.split()): i for i, t in have}
            target = p.name if p.name in ids else by_text.get(" ".join(p.name.split()), p.name)
        shown = ", ".join(ids[:20]) + (f" and {len(ids) - 20} more" if len(ids) > 20 else "") if ids else "none"
    else:
        target = p.name or ""
        names = sorted(entries(tree)["skill"])
        shown = ", ".join(names) or "none"
        ids = names
    if p.op == "add" and target in ids:
        raise Conflict(f"{p.kind} {target!r} is in the harness already; propose a replace of it instead",
                       target=target)
    if p.op != "add" and target not in ids:
        raise NotFound(f"there is no {p.kind} {p.name!r} in the serving harness to {p.op} (its {p.kind}s: {shown})",
                       target=p.name)
    if p.kind == "rule" and p.name is not None and p.op == "add" and not SKILL_NAME.fullmatch(target):
        raise BadRequest(f"a new rule's name {p.name!r} is not a-z, 0-9 and - (at most 63 characters); or leave it "
                         "out and the rule gets an id from its text", param="name")
    text, files = None, None
    if p.op != "retire":
        if p.kind == "rule":
            text = " ".join((p.text or "").split())
        else:
            body = p.text or ""
            files = {"SKILL.md": body if body.lstrip().startswith("---") else render_skill(target, body)}
    return Mutation(OPS[p.op], p.kind, target, p.reason, text=text, files=files)


def candidate(tree: dict[str, bytes], m: Mutation, limits: Limits) -> Candidate:
    """The candidate tree with ``m`` applied, through the screens; ``Screened`` naming the screen it fails."""
    from recipes.base import Candidate
    from recipes.harness_search.mutations import Refused, apply

    try:
        applied = apply(tree, [m], limits)
    except Refused as e:
        raise Screened(e.screen or "form", e.reason) from None
    details: dict[str, Any] = {"mutations": applied.mutations, "origin": "retire" if m.op == "remove" and
                               m.kind == "skill" else "proposal"}
    if applied.executable:
        details["executable"] = applied.executable
    if applied.review:
        details["review"] = applied.review
    summary = f"agent proposal: {m.op} {m.kind} {m.id}"
    return Candidate(tree=applied.tree, metrics={"proposal": 1}, details={**details, "summary": summary})


def origin(p: Proposal, m: Mutation | None, receipt: str | None) -> dict[str, Any]:
    """What every outcome's manifest says about the proposal that made it."""
    return {"kind": "proposal", "id": p.id, "at": p.at, "op": p.op, "target": f"{p.kind} {m.id if m else p.name}",
            "reason": p.reason, "run": p.run, "receipt": receipt,
            **({"text": (p.text or "")[:2000]} if p.text is not None else {})}


def listing(releases: list[Any], held: list[Any], rejections: list[Any],
            judging: list[tuple[Proposal, str | None]]) -> list[dict[str, Any]]:
    """Every proposal of a scenario with its verdict, newest first (proposal ids sort by time): ``admitted`` (its
    ``release_id``, ``step``), ``held`` for review (``candidate``), ``screened`` (``screen``), ``rejected`` by the
    gate (``metrics``: its figures), ``failed`` (could not be evaluated), ``unchanged`` (nothing to judge), another
    rejection log verdict as written (``canary-...``), or ``pending`` (received, not yet decided). A release that
    republishes a proposal's content (a rollback to it) is not a second verdict; what is decided wins over a pending
    entry read in the same instant."""
    out: dict[str, dict[str, Any]] = {}

    def put(o: Any, decided_at: float | None, **verdict: Any) -> None:
        if not isinstance(o, dict) or o.get("kind") != "proposal" or not o.get("id") or o["id"] in out:
            return
        out[o["id"]] = {"id": o["id"], "at": o.get("at") or decided_at, "op": o.get("op"), "target": o.get("target"),
                        "reason": o.get("reason"), "run": o.get("run"), "receipt": o.get("receipt"),
                        "decided_at": decided_at, **verdict}

    for r in releases:
        if r.operation in ("train", "promote"):
            put(r.origin, r.created_at, verdict="admitted", release_id=r.release_id, step=r.step,
                reviewed=r.operation == "promote", metrics=r.metrics)
    for j in rejections:
        screen = (j.metrics or {}).get("screen")
        verdict = {"rejected": "screened" if screen else "rejected", "skipped": "unchanged"}.get(j.verdict, j.verdict)
        put(j.origin, j.created_at, verdict=verdict, why=j.reason, metrics=j.metrics,
            **({"screen": screen} if screen else {}), **({"candidate": j.candidate} if j.candidate else {}))
    for r in held:
        put(r.origin, r.created_at, verdict="held", candidate=r.release_id, step=r.step, metrics=r.metrics)
    for p, receipt in judging:
        put({"kind": "proposal", "id": p.id, "at": p.at, "op": p.op, "target": f"{p.kind} {p.name or '(new)'}",
             "reason": p.reason, "run": p.run, "receipt": receipt}, None, verdict="pending")
    return sorted(out.values(), key=lambda e: e["id"], reverse=True)
