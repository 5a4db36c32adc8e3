"""A page per release (``GET /reef/releases/<id>/page``): one self-contained HTML document that says why the release
was made, what changed, what the gate said, and where it stands on its chain.

- Why: the receipts its manifest lists as consumed (exchanges a weights recipe trained on, or the reports a harness
  recipe learned from), each with the scores and written feedback reported on it (the first ``MAX_RECEIPTS``).
- What changed: the diff to its parent (``daemon/releases/diff.py``): a unified diff per text file (a harness), per
  tensor the norm of the change and of the old tensor (weights, a LoRA adapter against the model its parent serves).
- The gate: which gate, the outcome, and its figures (``daemon.gate.describe``, the line ``reef releases show``
  prints, and the raw metrics).
- The chain: parent, child, candidates held on it, head or not, rolled back or restored by later releases, and an
  inline SVG plot of the gate score of every release of the scenario (``score_of``).

Self-contained: inline CSS and SVG, no script, no external asset, no link out; a Content-Security-Policy that
allows no script and no fetch says so to the browser too. Everything that comes from the chain or the record store
(metadata, feedback, diffs, tensor names) is user data and is escaped; ``gather`` reads, ``render`` only formats.
"""

from __future__ import annotations

import html
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from daemon.errors import NotFound, ReefError
from daemon.gate import describe

MAX_RECEIPTS = 50  # receipts read back and shown; the page says how many more the release consumed
MAX_REPORTS_PER_RECEIPT = 5
MAX_CHAIN = 500  # releases of the scenario read for the plot and the chain (newest first)
MAX_TENSORS = 200  # tensor rows shown per weights file
MAX_FEEDBACK_CHARS = 4000
SCORE_KEY = "eval_reward"  # what every evaluating gate records as the candidate's mean (daemon/gate.py judge)

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"


@dataclass
class PageData:
    """What the page shows, read once: the release (``Release.to_dict``), its chain and its inputs."""

    release: dict[str, Any]
    head: str | None
    chain: list[dict[str, Any]]  # the scenario's releases, oldest first (up to MAX_CHAIN of the newest)
    diff: dict[str, Any]
    adapter: dict[str, Any] | None = None
    inputs: list[dict[str, Any]] = field(default_factory=list)  # records of the consumed receipts
    missing: list[str] = field(default_factory=list)  # receipts not in this record store
    pending: list[dict[str, Any]] = field(default_factory=list)  # candidates held on this release
    rejected_on: int = 0  # candidates turned away with this release as their base
    evaluation: dict[str, Any] | None = None  # ``reef eval``'s table as known (daemon/evaluation.py), or None
    evaluation_error: str | None = None
    generated_at: float = 0.0
    canary: dict[str, Any] | None = None  # the scenario's running canary, when this release is one of its arms
    spend: dict[str, Any] | None = None  # a weights scenario's learning spend (daemon/spend.py ``Spend.view``)


async def gather(reef: Any, release_id: str, scenario: str | None = None) -> PageData:
    """Read what the page of ``release_id`` shows from ``reef``'s chains and record store. An unknown release (or
    one of another scenario than ``scenario``) is a ``NotFound``."""
    chains, store = reef.chains, reef.store
    rel = await chains.release(release_id)
    if scenario is not None and rel.scenario != scenario:
        raise NotFound(f"release {release_id} is not a release of scenario {scenario!r}", release_id=release_id)
    history = await chains.history(rel.scenario, MAX_CHAIN)
    adapter = await chains.adapter(rel.release_id)
    data = PageData(release=rel.to_dict(), head=await chains.head_id(rel.scenario),
                    chain=[r.to_dict() for r in reversed(history)], diff=await chains.diff(rel.release_id),
                    adapter=adapter.to_dict() if adapter is not None else None, generated_at=time.time())
    data.pending = [p.to_dict() for p in await chains.pending(rel.scenario) if p.parent == rel.release_id]
    data.rejected_on = sum(r.base == rel.release_id for r in await chains.rejections(rel.scenario, MAX_CHAIN))
    evaluations = getattr(reef, "evaluations", None)
    if evaluations is not None:  # what is known (recorded, cached, reported): a page never measures
        try:
            data.evaluation = await evaluations.evaluate(rel.scenario, measure=False)
        except ReefError as e:
            data.evaluation_error = e.message
    canaries = getattr(reef, "canaries", None)
    live = await canaries.status(rel.scenario) if canaries is not None else None
    if live is not None and rel.release_id in (live["release_id"], live["base_id"]):
        data.canary = live
    learner = getattr(reef, "learner", None)
    if learner is not None:
        from daemon import learning_spend

        data.spend = (await learning_spend.status(learner, rel.scenario)).get(rel.scenario)
    for receipt in rel.receipts[:MAX_RECEIPTS]:
        try:
            data.inputs.append(await store.exchanges.get(receipt, full=False))
        except NotFound:
            data.missing.append(receipt)
    return data


# --- reading the chain ---------------------------------------------------------------------------------------


def score_of(chain: list[dict[str, Any]], i: int) -> tuple[float | None, str]:
    """The gate score of ``chain[i]`` (oldest first) and where it comes from: its own gate's (``eval_reward``: the
    candidate's mean on the gate's tasks; a rollback or promote carries its source's), or else, for a release a
    train step was judged against, that step's ``base_reward`` (the same tasks, this release serving); else None."""
    own = _number(chain[i]["metrics"].get(SCORE_KEY))
    if own is not None:
        how = {"rollback": "the restored release's gate score", "promote": "its gate score as a candidate"}
        return own, how.get(chain[i]["operation"], "its gate score")
    if i + 1 < len(chain) and chain[i + 1]["operation"] == "train":
        base = _number(chain[i + 1]["metrics"].get("base_reward"))
        if base is not None:
            return base, f"its score as the base of step {chain[i + 1]['step']}'s gate"
    return None, "no gate score"


def standing(data: PageData) -> dict[str, Any]:
    """The release's place on its chain: parent, child, head, and the later releases that rolled it back (restored
    an older release over it) or restored it."""
    rel = data.release
    by_id = {r["release_id"]: r for r in data.chain}
    later = [r for r in data.chain if r["step"] > rel["step"]]
    child = next((r for r in later if r["parent"] == rel["release_id"]), None)
    rolled_back_by = restored_by = None
    for r in later:
        if r["operation"] != "rollback" or r.get("source") is None:
            continue
        src = by_id.get(r["source"])
        if r["source"] == rel["release_id"] or (src is not None and src["content_id"] == rel["content_id"]):
            restored_by = restored_by or r
        elif src is not None and src["step"] < rel["step"] and rolled_back_by is None:
            rolled_back_by = r
    on_chain = rel["release_id"] in by_id
    return {"head": data.head == rel["release_id"], "on_chain": on_chain, "child": child,
            "rolled_back_by": rolled_back_by, "restored_by": restored_by,
            "parent": by_id.get(rel.get("parent") or "")}


# --- rendering -------------------------------------------------------------------------------------------------


def e(value: Any) -> str:
    """Text for HTML (element content or a quoted attribute)."""
    return html.escape("" if value is None else str(value), quote=True)


def render(data: PageData) -> str:
    rel = data.release
    title = f"Release {rel['release_id'][:12]} of {rel['scenario']} (step {rel['step']})"
    body = "\n".join((
        f"<h1>{e(title)}</h1>",
        _summary(data),
        _section("Why it was made", "why", _why(data)),
        _section("What changed", "changed", _changed(data)),
        _section("The gate", "gate", _gate(data)),
        _section("Its place on the chain", "chain", _chain(data)),
        _section("Evaluation: learning curve, forgetting, transfer", "eval", _evaluation(data)),
        _section("Its live canary", "canary", _canary(data)) if data.canary else "",
        _section("Learning spend", "spend", _spend(data)) if data.spend else "",
    ))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
            "<meta name=\"referrer\" content=\"no-referrer\">"
            f"<title>{e(title)}</title><style>{_CSS}</style></head>\n<body>\n{body}\n"
            f"<footer>Reef release page, made {e(_when(data.generated_at))}</footer>\n</body></html>\n")


def _canary(data: PageData) -> str:
    """The running canary this release is an arm of, in the daemon's words (``daemon/canary.describe``)."""
    c = data.canary or {}
    side = "the candidate" if c.get("release_id") == data.release["release_id"] else "the head it is compared with"
    return (f"<p>This release is {e(side)} of a running canary; figures as of this page.</p>\n<pre>"
            + e("\n".join(c.get("lines") or [])) + "</pre>")


def _spend(data: PageData) -> str:
    """The trainer time this release's step took and the scenario's spend (``reef status``'s figures)."""
    s = data.spend or {}

    def n(v: Any) -> str:
        f = _number(v)
        return "-" if f is None else f"{f:.4g}"

    op = data.release.get("operation")
    # (a rollback carries the metrics of the release it restores: its trainer time is that step's, spent once)
    own = (data.release.get("metrics") or {}).get("trainer_seconds") if op in ("train", "promote") else None
    cap, cost = s.get("max_trainer_hours"), s.get("seconds_per_point")
    rows = [("this release's step", f"{n(own)} s of trainer time" if own is not None
             else f"no trainer time (a {op})" if op not in ("train", "promote") else "no trainer time"),
            ("the scenario today", f"{n(s.get('trainer_seconds_today'))} s"
             + (f" of max_trainer_hours {n(cap)} a day" if cap is not None else " (no cap: max_trainer_hours)")
             + (f"; capped until {s['resumes_at']}" if s.get("capped") else "")),
            ("the scenario in all", f"{n(s.get('trainer_seconds_total'))} s"),
            ("cost per point of reward", f"{n(cost)} trainer seconds per +0.01 of batch reward"
             if cost is not None else "not yet (two released steps, the latest with a higher batch reward)")]
    return _table(rows, "spend")


def _section(heading: str, ident: str, inner: str) -> str:
    return f"<section id=\"{ident}\"><h2>{e(heading)}</h2>\n{inner}\n</section>"


def _summary(data: PageData) -> str:
    rel = data.release
    rows = [("release", rel["release_id"]), ("scenario", rel["scenario"]), ("step", rel["step"]),
            ("operation", rel["operation"]), ("kind", rel["kind"]), ("recipe", rel["recipe"]),
            ("content", rel["content_id"]), ("made", _when(rel["created_at"])),
            ("message", (rel.get("message") or "").splitlines()[0] if rel.get("message") else "")]
    if data.adapter:
        rows.append(("LoRA adapter on", f"base {data.adapter.get('base_content_id')} (release "
                                        f"{data.adapter.get('base_release_id')})"))
    return _table(rows, "summary")


def _why(data: PageData) -> str:
    rel = data.release
    receipts = rel.get("receipts") or []
    if rel["operation"] == "init":
        return "<p>The first release of the chain: the scenario's starting artifact, made on its first use.</p>"
    if rel["operation"] == "rollback":
        return (f"<p>A rollback: it publishes again the content of release <code>{e(rel.get('source'))}</code>; "
                "it consumed nothing.</p>")
    if not receipts:
        return "<p>It lists no receipts it consumed.</p>"
    out = [f"<p>It consumed {consumed(receipts, data.inputs)}"
           + (f"; the first {MAX_RECEIPTS} are shown" if len(receipts) > MAX_RECEIPTS else "") + ".</p>",
           "<ol class=\"inputs\">"]
    for rec in data.inputs:
        out.append(f"<li class=\"input\">{_input(rec)}</li>")
    out.append("</ol>")
    if data.missing:
        out.append(f"<p class=\"note\">Not in this daemon's record store: {e(', '.join(data.missing))}</p>")
    return "\n".join(out)


def plural(n: int, word: str) -> str:
    """``1 report``, ``2 reports``: a count said as a person says it (never ``1 report(s)``)."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def consumed(ids: list[str], inputs: list[dict[str, Any]]) -> str:
    """What a release's manifest lists, said by kind: the reports a harness recipe learned from (and how many
    receipts they were on, where they were read back) and the exchanges a weights recipe trained on."""
    reports = [i for i in ids if i.startswith("rep_")]
    exchanges = [i for i in ids if not i.startswith("rep_")]
    parts = []
    if reports:
        on = {str(r) for rec in inputs if rec.get("kind") == "report"
              for r in (rec.get("report") or {}).get("references") or []}
        parts.append(plural(len(reports), "report") + (f" on {plural(len(on), 'receipt')}" if on else ""))
    if exchanges:
        parts.append(plural(len(exchanges), "exchange"))
    return " and ".join(parts)


def _input(rec: dict[str, Any]) -> str:
    head = f"<code>{e(rec.get('id'))}</code> {e(rec.get('kind'))}"
    if rec.get("run"):
        head += f", run <code>{e(rec['run'])}</code>"
    if rec.get("forgotten_at"):
        head += " <em>(forgotten)</em>"
    if rec.get("kind") == "report":
        body = rec.get("report") or {}
        refs = [str(r) for r in body.get("references") or []]
        on = f" on {', '.join(f'<code>{e(r)}</code>' for r in refs[:5])}{' and more' if len(refs) > 5 else ''}"
        return head + (on if refs else "") + f"<div class=\"report\">{_report(body)}</div>"
    reports = rec.get("reports") or []
    if rec.get("release_id"):
        head += f", served by <code>{e(str(rec['release_id'])[:12])}</code>"
    if not reports:
        return head + " <span class=\"note\">(no report on it)</span>"
    items = "".join(f"<li>{_report(r.get('report') or {})}</li>" for r in reports[-MAX_REPORTS_PER_RECEIPT:])
    return head + f"<ul class=\"reports\">{items}</ul>"


def _report(body: dict[str, Any]) -> str:
    parts = []
    if body.get("score") is not None:
        parts.append(f"<span class=\"score\">score {e(body['score'])}</span>")
    fb = body.get("feedback")
    if fb is not None:
        text = fb if isinstance(fb, str) else json.dumps(fb, ensure_ascii=False, sort_keys=True)
        if len(text) > MAX_FEEDBACK_CHARS:
            text = text[:MAX_FEEDBACK_CHARS] + "…"
        parts.append(f"<blockquote class=\"feedback\">{e(text)}</blockquote>")
    meta = body.get("metadata")
    if isinstance(meta, dict) and meta.get("kind") == "instruction":
        parts.append("<span class=\"note\">(an instruction)</span>")
    return " ".join(parts) or "<span class=\"note\">(empty report)</span>"


def _changed(data: PageData) -> str:
    diff = data.diff or {}
    base = diff.get("base")
    out = [f"<p>Against its parent <code>{e(base)}</code>.</p>" if base else
           "<p>The first release: everything is new.</p>"]
    files = diff.get("files") or []
    if not files:
        out.append("<p>No file changed (the same content as its parent).</p>")
    for f in files:
        out.append(f"<div class=\"file {e(f.get('status'))}\"><h3>{_sign(f.get('status'))} <code>{e(f.get('path'))}"
                   f"</code> <small>{e(f.get('kind'))}, {e(f.get('status'))}</small></h3>{_file_body(f)}</div>")
    return "\n".join(out)


def _sign(status: Any) -> str:
    return {"added": "+", "removed": "−"}.get(str(status), "~")


def _file_body(f: dict[str, Any]) -> str:
    if f.get("kind") == "text":
        lines = []
        for line in str(f.get("diff") or "").splitlines():
            cls = ("hunk" if line.startswith("@@") else "meta" if line.startswith(("+++", "---"))
                   else "add" if line.startswith("+") else "del" if line.startswith("-") else "ctx")
            lines.append(f"<span class=\"{cls}\">{e(line)}</span>")
        more = "<p class=\"note\">(the diff is cut short)</p>" if f.get("truncated") else ""
        return f"<pre class=\"diff\">{''.join(lines)}</pre>{more}"  # each line a block: no newline between
    if f.get("kind") == "safetensors":
        return _tensors(f)
    sizes = f"{e(f.get('old_size'))} → {e(f.get('new_size'))} bytes"
    return f"<p>{sizes}" + (f"; not read: {e(f['error'])}" if f.get("error") else "") + "</p>"


def _tensors(f: dict[str, Any]) -> str:
    tensors = f.get("tensors") or []
    rows = []
    for t in tensors[:MAX_TENSORS]:
        rows.append("<tr class=\"tensor\">" + "".join(f"<td>{c}</td>" for c in (
            f"<code>{e(t.get('name'))}</code>", e(t.get("status")), e("×".join(map(str, t.get("shape") or [])) or "-"),
            _num(t.get("diff_norm")), _num(t.get("old_norm") if "old_norm" in t else t.get("norm")),
            _num(t.get("relative")), _num(t.get("max_abs")))) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("tensor", "change", "shape", "|Δ|", "|w| before (added: after)",
                                              "|Δ| / |w|", "max |Δ|"))
    out = f"<table class=\"tensors\"><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    notes = []
    if len(tensors) > MAX_TENSORS:
        notes.append(f"{len(tensors) - MAX_TENSORS} more changed tensors not shown")
    if f.get("unchanged_tensors"):
        notes.append(f"{f['unchanged_tensors']} tensors unchanged")
    return out + (f"<p class=\"note\">{e('; '.join(notes))}</p>" if notes else "")


def _gate(data: PageData) -> str:
    rel = data.release
    m = rel.get("metrics") or {}
    gate = (rel.get("settings") or {}).get("gate")
    op = rel["operation"]
    verdict = {
        "train": f"Published: the candidate passed the gate{f' {gate!r}' if gate else ''}.",
        "promote": "Held for review by its gate (or a canary), then promoted.",
        "rollback": "A rollback: published by hand, not gated (the figures below are those of the release it "
                    "restores).",
        "init": "The first release: not gated.",
    }.get(op, op)
    if m.get("watchdog"):
        verdict += f" The reward-hacking watchdog held it: {m['watchdog']}."
    out = [f"<p class=\"verdict\">{e(verdict)}</p>"]
    from daemon.gating.heldout import describe as heldout_line

    for line in (describe(m), heldout_line(m)):
        if line:
            out.append(f"<p class=\"figures\">{e(line)}</p>")
    score = _number(m.get(SCORE_KEY))
    base = _number(m.get("base_reward"))
    if score is not None or base is not None:
        out.append(f"<p class=\"means\">candidate mean {_num(score)}, serving head's mean {_num(base)} on the same "
                   "tasks</p>")
    if m:
        out.append("<details><summary>all metrics</summary>"
                   + _table(sorted((k, json.dumps(v, ensure_ascii=False)) for k, v in m.items()), "metrics")
                   + "</details>")
    else:
        out.append("<p class=\"note\">No gate figures recorded (a gate that publishes without evaluating).</p>")
    if data.rejected_on:
        out.append(f"<p>{data.rejected_on} later candidate(s) on top of it were turned away by the gate.</p>")
    return "\n".join(out)


def _chain(data: PageData) -> str:
    rel, st = data.release, standing(data)
    items = []
    if not st["on_chain"]:
        items.append("not on the chain (a pending candidate, or older than the part of the chain read)")
    items.append("the head: it serves the scenario now" if st["head"] else f"not the head (the head is "
                 f"{(data.head or '-')[:12]})")
    items.append(f"parent: {_ref(st['parent'], rel.get('parent'))}")
    items.append(f"child: {_ref(st['child'], None)}" if st["child"] else "child: none yet")
    if st["rolled_back_by"]:
        r = st["rolled_back_by"]
        items.append(f"rolled back by step {r['step']} ({r['release_id'][:12]}), which restored "
                     f"{str(r.get('source'))[:12]}")
    else:
        items.append("not rolled back")
    if st["restored_by"]:
        items.append(f"restored by the rollback at step {st['restored_by']['step']} "
                     f"({st['restored_by']['release_id'][:12]})")
    if rel["operation"] == "rollback":
        items.append(f"it restores {str(rel.get('source'))[:12]}")
    for p in data.pending:
        items.append(f"candidate held for review on it: {p['release_id'][:12]} (step {p['step']})")
    lis = "".join(f"<li>{e(i)}</li>" for i in items)
    return f"<ul class=\"standing\">{lis}</ul>\n{plot(data.chain, rel['release_id'])}"


def _evaluation(data: PageData) -> str:
    """``reef eval``'s table of the chain as known (this release marked): held-out reward, probe accuracy,
    forgetting against the base, transfer; what is not measured yet says so."""
    from daemon.evaluation import FIGURES, cell

    ev = data.evaluation
    if ev is None:
        return f"<p class=\"note\">No evaluation: {e(data.evaluation_error or 'not available')}.</p>"
    mine = data.release["release_id"]
    head = "".join(f"<th>{h}</th>" for h in ("step", "release", "operation", "held-out reward", "probe accuracy",
                                             "forgetting", "transfer"))
    rows = []
    for r in ev["rows"]:
        cls = " class=\"this\"" if r["release_id"] == mine else ""
        cells = [e(r["step"]), f"<code>{e(r['release_id'][:12])}</code>", e(r["operation"]),
                 *(e(cell(r[k], signed=k == "forgetting")) for k in FIGURES)]
        rows.append(f"<tr{cls}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    mine_row = next((r for r in ev["rows"] if r["release_id"] == mine), None)
    notes = [f"held-out reward: {ev['reward_how']}", f"probes: {ev['probes_how']}; forgetting: probe accuracy "
             f"minus the base's (step {ev['base']['step']})"]
    if mine_row is not None:
        notes += [f"{k} of this release: {r['reason']}" for k in FIGURES if (r := mine_row[k])["status"] != "ok"
                  and not (k == "transfer" and ev.get("transfer") is None)]
    notes.append(f"reef eval -s {ev['scenario']} measures what is missing (and --transfer OTHER another "
                 "scenario's held-out prompts)")
    return (f"<table class=\"eval\"><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            + "".join(f"<p class=\"note\">{e(n)}</p>" for n in notes))


def _ref(r: dict[str, Any] | None, fallback: str | None) -> str:
    if r is None:
        return (fallback or "none")[:12] if fallback else "none"
    return f"step {r['step']} {r['operation']} ({r['release_id'][:12]})"


# --- the plot ----------------------------------------------------------------------------------------------------

_W, _H, _ML, _MR, _MT, _MB = 640, 220, 48, 16, 16, 36


def plot(chain: list[dict[str, Any]], current: str) -> str:
    """An inline SVG of the gate score of each release of ``chain`` (oldest first) with one: one ``circle.point``
    per release that has a score (``score_of``), at x by position on the chain; ``current`` drawn larger."""
    scored = [(i, r, *score_of(chain, i)) for i, r in enumerate(chain)]
    points = [(i, r, s, how) for i, r, s, how in scored if s is not None]
    if not points:
        return ("<p class=\"noplot\">No release of this chain has a gate score (its gate publishes without "
                "evaluating), so there is nothing to plot.</p>")
    lo, hi = min(p[2] for p in points), max(p[2] for p in points)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    n = len(chain)

    def x(i: int) -> float:
        return _ML + (_W - _ML - _MR) * (i / (n - 1) if n > 1 else 0.5)

    def y(s: float) -> float:
        return _MT + (_H - _MT - _MB) * (1 - (s - lo) / (hi - lo))

    out = [f"<svg class=\"plot\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{_W}\" height=\"{_H}\" "
           f"viewBox=\"0 0 {_W} {_H}\" role=\"img\" aria-label=\"gate score per release\">",
           f"<line class=\"axis\" x1=\"{_ML}\" y1=\"{_H - _MB}\" x2=\"{_W - _MR}\" y2=\"{_H - _MB}\"/>",
           f"<line class=\"axis\" x1=\"{_ML}\" y1=\"{_MT}\" x2=\"{_ML}\" y2=\"{_H - _MB}\"/>",
           f"<text class=\"tick\" x=\"{_ML - 6}\" y=\"{y(hi) + 4:.1f}\" text-anchor=\"end\">{hi:.3g}</text>",
           f"<text class=\"tick\" x=\"{_ML - 6}\" y=\"{y(lo) + 4:.1f}\" text-anchor=\"end\">{lo:.3g}</text>",
           f"<text class=\"tick\" x=\"{(_W + _ML) / 2:.0f}\" y=\"{_H - 6}\" text-anchor=\"middle\">release step "
           f"(oldest to newest); y: gate score ({SCORE_KEY})</text>"]
    for i, r, _, _ in scored:
        out.append(f"<text class=\"tick\" x=\"{x(i):.1f}\" y=\"{_H - _MB + 14}\" text-anchor=\"middle\">"
                   f"{e(r['step'])}</text>")
    out.append("<polyline class=\"line\" points=\""
               + " ".join(f"{x(i):.1f},{y(s):.1f}" for i, _, s, _ in points) + "\"/>")
    for i, r, s, how in points:
        this = r["release_id"] == current
        cls = ("point this" if this else "point") + (f" {r['operation']}" if r["operation"] != "train" else "")
        label = f"step {r['step']} {r['operation']} {r['release_id'][:12]}: {s:.4g} ({how})"
        out.append(f"<circle class=\"{e(cls)}\" cx=\"{x(i):.1f}\" cy=\"{y(s):.1f}\" r=\"{6 if this else 4}\" "
                   f"data-step=\"{e(r['step'])}\" data-score=\"{s:.6g}\"><title>{e(label)}</title></circle>")
    out.append("</svg>")
    unscored = [r for _, r, s, _ in scored if s is None]
    note = (f"<p class=\"note\">{len(unscored)} release(s) without a gate score: steps "
            f"{e(', '.join(str(r['step']) for r in unscored))}</p>") if unscored else ""
    return "\n".join(out) + note


# --- small helpers ---------------------------------------------------------------------------------------------


def _table(rows: Any, cls: str) -> str:
    body = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows)
    return f"<table class=\"{cls}\">{body}</table>"


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _num(v: Any) -> str:
    f = _number(v)
    return "-" if f is None else e(f"{f:.4g}")


def _when(ts: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(ts)))
    except (TypeError, ValueError, OverflowError):
        return "-"


_CSS = """
body{font:15px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;
color:#1d2430;background:#fbfbfd}
h1{font-size:1.4em}h2{font-size:1.15em;border-bottom:1px solid #d8dce4;padding-bottom:.2em;margin-top:1.6em}
h3{font-size:1em;margin:.8em 0 .3em}code{font:13px ui-monospace,SFMono-Regular,Menlo,monospace}
table{border-collapse:collapse;margin:.4em 0}th,td{text-align:left;padding:.15em .7em .15em 0;vertical-align:top}
table.tensors td,table.tensors th{border-bottom:1px solid #eceef3;font-size:13px}
pre.diff{background:#f3f4f8;padding:.6em;overflow-x:auto;font:13px ui-monospace,Menlo,monospace}
pre.diff span{display:block;white-space:pre-wrap}.add{background:#e4f6e4}.del{background:#fbe5e5}
.hunk{color:#6a4bb6}.meta{color:#667}
blockquote.feedback{margin:.3em 0 .3em 1em;padding:.3em .7em;border-left:3px solid #9bb;background:#f2f6f6;
white-space:pre-wrap}
.note{color:#667}.verdict{font-weight:600}.figures{font-family:ui-monospace,Menlo,monospace;font-size:13px}
svg.plot{background:#fff;border:1px solid #d8dce4;margin-top:.6em}.axis{stroke:#99a}.tick{font-size:11px;fill:#556}
.line{fill:none;stroke:#3b6fd4;stroke-width:1.5}.point{fill:#3b6fd4}.point.rollback{fill:#d48a3b}
table.eval td,table.eval th{border-bottom:1px solid #eceef3;font-size:13px}table.eval tr.this{background:#fdf1d8}
.point.this{fill:#d43b5a;stroke:#1d2430;stroke-width:1.5}footer{margin-top:3em;color:#889;font-size:12px}
"""
