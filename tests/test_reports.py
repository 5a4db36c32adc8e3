"""Reports on receipts, scenarios, the event stream and metrics, through the real HTTP API."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx

from tests.conftest import Daemon, assert_canonical_error


def serve_one(c: httpx.Client, scenario: str = "default", run: str | None = None) -> str:
    headers = {"x-reef-scenario": scenario}
    if run:
        headers["x-reef-run"] = run
    resp = c.post("/v1/chat/completions", headers=headers,
                  json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-reef-agent-record-id"]


def test_report_validation(daemon: Daemon) -> None:
    with daemon.http() as c:
        receipt = serve_one(c, "rep-a")
        for body, param in (
            ({"score": "1", "references": [receipt]}, "score"),
            ({"score": True, "references": [receipt]}, "score"),
            ({"score": 1, "references": []}, "references"),
            ({"score": 1, "references": "x"}, "references"),
            ({"score": 1, "references": [1]}, "references"),
            ({"references": [receipt]}, "score"),
            ({"feedback": 5, "references": [receipt]}, "feedback"),
            ({"feedback": "x" * 300_000, "references": [receipt]}, "feedback"),
            ({"score": 1, "references": [receipt], "metadata": "x"}, "metadata"),
            ({"score": 1, "references": [receipt], "surprise": 1}, "surprise"),
        ):
            err = assert_canonical_error(c.post("/reef/report", json=body), 400)
            if param:
                assert err.get("param") == param, (body, err)
        # 1e400 parses as infinity: not a finite score
        resp = c.post("/reef/report", content=b'{"score":1e400,"references":["%s"]}' % receipt.encode())
        assert assert_canonical_error(resp, 400)["param"] == "score"


def test_report_unknown_and_foreign_receipts_are_404_naming_them(daemon: Daemon) -> None:
    with daemon.http() as c:
        mine = serve_one(c, "rep-b")
        theirs = serve_one(c, "rep-c")
        err = assert_canonical_error(
            c.post("/reef/report", json={"score": 1, "references": [mine, "rec_nope"]}), 404)
        assert "rec_nope" in err["message"] and err["receipts"] == ["rec_nope"]
        err = assert_canonical_error(
            c.post("/reef/report", json={"score": 1, "references": [mine, theirs], "scenario": "rep-b"}), 404)
        assert theirs in err["message"]
        err = assert_canonical_error(c.post("/reef/report", json={"score": 1, "references": [mine, theirs]}), 404)
        assert theirs in err["message"]


def test_report_id_makes_retries_idempotent(daemon: Daemon) -> None:
    with daemon.http() as c:
        receipt = serve_one(c, "rep-d")
        body = {"score": 1, "feedback": {"why": "ok"}, "references": [receipt], "report_id": "retry-1"}
        first = c.post("/reef/report", json=body)
        assert first.status_code == 201
        again = c.post("/reef/report", json=body)
        assert again.status_code == 201 and again.json() == first.json()
        err = assert_canonical_error(c.post("/reef/report", json={**body, "score": 0}), 409)
        assert "retry-1" in err["message"]
        rec = c.get(f"/reef/records/{receipt}").json()
        assert len(rec["reports"]) == 1 and rec["reports"][0]["report"]["feedback"] == {"why": "ok"}


def test_report_id_retry_with_any_other_field_changed_is_409(daemon: Daemon) -> None:
    """The idempotency check covers the whole body, not just the score: a retry that changes only the feedback,
    only the metadata or only the references is a different report, refused with 409, and stores nothing."""
    with daemon.http() as c:
        receipt, other = serve_one(c, "rep-e"), serve_one(c, "rep-e")
        body = {"score": 1, "feedback": "tests pass", "metadata": {"source": "ci"}, "references": [receipt],
                "report_id": "retry-2"}
        first = c.post("/reef/report", json=body)
        assert first.status_code == 201, first.text
        for changed in (
            {"feedback": "tests fail"},
            {"feedback": {"why": "tests pass"}},
            {"feedback": None},
            {"metadata": {"source": "human"}},
            {"metadata": None},
            {"references": [other]},
            {"references": [receipt, other]},
        ):
            retry = {**body, **changed}
            err = assert_canonical_error(c.post("/reef/report", json=retry), 409)
            assert "retry-2" in err["message"], (changed, err)
        again = c.post("/reef/report", json=body)
        assert again.status_code == 201 and again.json() == first.json()
        for r in (receipt, other):
            reports = c.get(f"/reef/records/{r}").json()["reports"]
            assert len(reports) == (1 if r == receipt else 0), (r, reports)
        stored = c.get(f"/reef/records/{receipt}").json()["reports"][0]["report"]
        assert stored["feedback"] == "tests pass" and stored["metadata"] == {"source": "ci"}


def test_scenarios_api_and_recipe_binding(daemon: Daemon) -> None:
    with daemon.http() as c:
        created = c.post("/reef/scenarios", json={"name": "scen-x", "recipe": "record"})
        assert created.status_code == 201 and created.json()["recipe"] == "record"
        assert c.post("/reef/scenarios", json={"name": "scen-x", "recipe": "record"}).status_code == 201
        err = assert_canonical_error(c.post("/reef/scenarios", json={"name": "scen-x", "recipe": "lessons"}), 409)
        assert "record" in err["message"] and "lessons" in err["message"]
        # a module:Class from no recipe directory is refused before any binding is looked at
        err = assert_canonical_error(c.post("/reef/scenarios", json={"name": "scen-x", "recipe": "other:Recipe"}), 400)
        assert "'other' is in neither" in err["message"]
        assert_canonical_error(c.post("/reef/scenarios", json={"name": "scen-y", "recipe": "no such"}), 400)
        assert_canonical_error(c.post("/reef/scenarios", json={"name": "../x"}), 400)
        assert_canonical_error(c.get("/reef/scenarios/never-made"), 404)
        serve_one(c, "scen-x")
        shown = c.get("/reef/scenarios/scen-x").json()
        assert shown["records"] == 1 and shown["model"] == "tiny"
        names = [s["name"] for s in c.get("/reef/scenarios").json()["scenarios"]]
        assert "scen-x" in names
        page = c.get("/reef/scenarios/scen-x/records", params={"limit": 10}).json()
        assert len(page["records"]) == 1
        assert c.get("/reef/scenarios/scen-x/records", params={"after": page["next_after"]}).json()["records"] == []
        assert_canonical_error(c.get("/reef/scenarios/scen-x/records", params={"limit": "x"}), 400)


def test_cli_scenarios_and_status(daemon: Daemon) -> None:
    out = daemon.cli("scenarios", "create", "cli-scen", "--json")
    assert json.loads(out.stdout)["name"] == "cli-scen"
    assert "cli-scen" in daemon.cli("scenarios", "list").stdout
    assert json.loads(daemon.cli("scenarios", "show", "cli-scen", "--json").stdout)["recipe"] == "record"
    status = json.loads(daemon.cli("status", "--json").stdout)
    assert status["default_model"] == "tiny"
    bad = daemon.cli("report", "rec_missing", "--score", "1", check=False)
    assert bad.returncode == 4 and "rec_missing" in bad.stderr and "Traceback" not in bad.stderr


def report_events(c: httpx.Client, scenario: str, want: int) -> list[dict[str, Any]]:
    """The ``report`` events of ``scenario`` on ``/reef/events`` from its start (``after=0``): read until ``want``
    of them are in, or the read times out."""
    seen: list[dict[str, Any]] = []
    with c.stream("GET", "/reef/events", params={"after": 0}, timeout=5) as resp:
        try:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event.get("kind") == "report" and event.get("scenario") == scenario:
                        seen.append(event)
                        if len(seen) >= want:
                            break
        except httpx.ReadTimeout:  # fewer than wanted: the caller's assertion says so
            pass
    return seen


def test_imported_reports_are_counted_and_announced_like_any_other(daemon: Daemon) -> None:
    """Reports that come with imported exchanges (``POST /reef/records/import``) are one each on
    ``reef_records_total{kind="report"}`` and one ``report`` event each, as ``daemon.reports`` does for every
    path; a re-import stores nothing and counts nothing."""
    turn = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}
    items = [{**turn, "id": "rec_imp_a", "score": 1.0},
             {**turn, "id": "rec_imp_b", "score": 0.0, "feedback": "too short"},
             {**turn, "id": "rec_imp_c"}]  # no score, no feedback: an exchange without a report
    with daemon.http() as c:
        before = reports_counted(c)
        resp = c.post("/reef/records/import", json={"items": items, "scenario": "imports-counted"})
        assert resp.status_code == 201, resp.text
        assert resp.json() == {"imported": 3, "skipped": 0, "reports": 2, "tokens_dropped": 0}
        assert reports_counted(c) == before + 2
        events = report_events(c, "imports-counted", 2)
        assert sorted(tuple(e["references"]) for e in events) == [("rec_imp_a",), ("rec_imp_b",)], events
        by_ref = {e["references"][0]: e for e in events}
        assert by_ref["rec_imp_a"]["score"] == 1.0 and by_ref["rec_imp_b"]["feedback"] == "too short"
        assert all(e["source"] == "import" and e["id"].startswith("rep_") for e in events)
        for e in events:  # each event names the report record stored
            assert c.get(f"/reef/records/{e['id']}").json()["kind"] == "report"
        again = c.post("/reef/records/import", json={"items": items, "scenario": "imports-counted"})
        assert again.json() == {"imported": 0, "skipped": 3, "reports": 0, "tokens_dropped": 0}
        assert reports_counted(c) == before + 2


def test_events_stream_records_and_reports(daemon: Daemon) -> None:
    seen: list[dict[str, Any]] = []
    ready = threading.Event()

    def follow() -> None:
        with daemon.http() as c, c.stream("GET", "/reef/events", timeout=30) as resp:
            ready.set()
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    if any(e["kind"] == "report" for e in seen):
                        return

    t = threading.Thread(target=follow)
    t.start()
    ready.wait(10)
    with daemon.http() as c:
        receipt = serve_one(c, "events")
        c.post("/reef/report", json={"score": 1, "references": [receipt]})
    t.join(30)
    kinds = [e["kind"] for e in seen]
    assert "record" in kinds and "report" in kinds
    rec = next(e for e in seen if e["kind"] == "record" and e["id"] == receipt)
    assert rec["scenario"] == "events"


def test_metrics(daemon: Daemon) -> None:
    with daemon.http() as c:
        serve_one(c, "metrics")
        text = c.get("/metrics").text
    assert "reef_requests_total" in text and "reef_records_total" in text and "reef_tokens_total" in text
    assert "reef_request_seconds_bucket" in text and "reef_errors_total" in text


def reports_counted(c: httpx.Client) -> float:
    """``reef_records_total{kind="report"}`` on ``/metrics`` (0 before the first report)."""
    for line in c.get("/metrics").text.splitlines():
        if line.startswith('reef_records_total{kind="report"}'):
            return float(line.split()[-1])
    return 0.0


def test_every_path_that_stores_a_report_counts_it_once(daemon: Daemon) -> None:
    """An explicit report, a direct instruction and a judge's verdict are each one report on the metric: all three
    go through ``daemon.reports.accept_report``."""
    with daemon.http() as c:
        receipt = serve_one(c, "counted")
        before = reports_counted(c)
        assert c.post("/reef/report", json={"score": 1, "references": [receipt]}).status_code == 201
        assert reports_counted(c) == before + 1

        resp = c.post("/reef/scenarios", json={"name": "counted-harness", "recipe": "lessons"})
        assert resp.status_code == 201, resp.text
        out = c.post("/reef/scenarios/counted-harness/evolve", json={"instruction": "keep diffs small"})
        assert out.status_code == 201, out.text
        assert reports_counted(c) == before + 2

        resp = c.post("/reef/scenarios", json={"name": "counted-judged", "recipe": "openclaw-rl"})
        assert resp.status_code == 201, resp.text
        msgs: list[dict[str, Any]] = [{"role": "user", "content": 'Say "apple".'}]
        first = c.post("/s/counted-judged/v1/chat/completions",
                       json={"model": "tiny", "max_tokens": 2, "messages": msgs})
        assert first.status_code == 200, first.text
        msgs += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "thanks, next one"}]
        assert c.post("/s/counted-judged/v1/chat/completions",
                      json={"model": "tiny", "max_tokens": 2, "messages": msgs}).status_code == 200
        judged = first.headers["x-reef-agent-record-id"]
        deadline = time.monotonic() + 60
        while not c.get(f"/reef/records/{judged}").json()["reports"]:  # the judge runs beside the request
            assert time.monotonic() < deadline, "no verdict on the judged turn"
            time.sleep(0.1)
        assert reports_counted(c) == before + 3
