"""Ways a running canary meets the rest of the daemon (the first two found by an outside probe): the head it is
compared with moving under it, a run pinned to an ended canary after a restart, and reports that come after a
canary ended. A real daemon (the tiny model, a lessons scenario whose candidates are held for review) over real
sockets, killed with SIGKILL where the claim is a restart."""

from __future__ import annotations

from typing import Any

from tests.conftest import Daemon, assert_canonical_error
from tests.test_canary import canary_of, drive, held_candidate, one_run
from tests.test_records_pg import _until

ASK = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}


def test_a_canary_whose_head_moves_is_ended_with_the_reason(daemon_factory: Any) -> None:
    """A promote of another candidate moves the head while the canary runs: the canary ends as ``head-moved`` (its
    head arm would otherwise be counted against a release nobody is served), the candidate is not promoted, and a
    new canary can start against the new head. Bug caught: the judge comparing with the release it started on."""
    d: Daemon = daemon_factory()
    with d.unix() as c:
        head, cand = held_candidate(c, "hm", "be terse")
        other = c.post("/reef/scenarios/hm/evolve", json={"instruction": "cite the file"}).json()
        assert other["verdict"] == "pending", other
        c.post("/reef/scenarios/hm/canary", json={"release_id": cand, "share": 0.5}).raise_for_status()
        for _ in range(3):
            one_run(c, "hm", lambda rel: 1.0)
        moved = c.post("/reef/scenarios/hm/promote", json={"release_id": other["release_id"], "expected_head": head})
        assert moved.status_code == 201, moved.text
        _until("the canary to end", lambda: canary_of(c, "hm") is None)
        chain = c.get("/reef/scenarios/hm/releases", params={"all": "1"}).json()
        assert chain["head"] == moved.json()["release_id"]
        ended = next(j for j in chain["rejected"] if j["candidate"] == cand)
        assert ended["verdict"] == "canary-head-moved" and "the head moved" in ended["reason"], ended
        assert all(r["release_id"] != cand and r.get("source") != cand for r in chain["releases"])


def test_a_run_pinned_to_an_ended_canary_is_served_after_a_restart(daemon_factory: Any) -> None:
    """A run got the canary's harness and pins it; the canary is ended, the daemon killed and started again: the
    run's next request is still served by the release it pinned (read back from the chain), and a held candidate that
    never served as a canary is still refused. Bug caught: the ended canaries kept in memory only (a 400 after the
    restart)."""
    d: Daemon = daemon_factory()
    with d.unix() as c:
        head, cand = held_candidate(c, "hr", "be terse")
        _, never = held_candidate(c, "hr2", "be kind")
        c.post("/reef/scenarios/hr/canary", json={"release_id": cand, "share": 0.99}).raise_for_status()
        run = None
        for _ in range(20):
            start = c.post("/reef/runs", json={"adapter": "pi", "scenario": "hr"}).json()
            if start["release_id"] == cand:
                run = start["run"]
                break
        assert run is not None
        c.post("/reef/scenarios/hr/canary/end", json={}).raise_for_status()
    d.kill9()
    d.start()
    with d.unix() as c:
        r = c.post(f"/s/hr/r/{run}/v1/chat/completions", headers={"x-reef-release-id": cand}, json=ASK)
        assert r.status_code == 200, r.text
        assert r.headers["x-reef-release-id"] == cand
        assert_canonical_error(c.post("/s/hr2/v1/chat/completions", headers={"x-reef-release-id": never}, json=ASK),
                               400)


def test_a_canary_that_answers_nothing_ends_before_any_report(daemon_factory: Any) -> None:
    """End to end through the records: every answer on the canary's arm is one token long (the client asks for one:
    the stand-in for a candidate that stopped answering), the head's arm answers at length; no report is ever
    made. The canary ends as ``empty`` within 30 canary answers. Bug caught: the guard reading lengths from the wrong
    column, or only when scores exist."""
    d: Daemon = daemon_factory()
    with d.unix() as c:
        head, cand = held_candidate(c, "he", "be terse")
        c.post("/reef/scenarios/he/canary", json={"release_id": cand, "share": 0.5}).raise_for_status()
        on_canary = 0
        for _ in range(200):
            start = c.post("/reef/runs", json={"adapter": "pi", "scenario": "he"}).json()
            if canary_of(c, "he") is None:
                break
            rel = start["release_id"]
            on_canary += rel == cand
            assert on_canary <= 30, "the canary did not end within 30 of its answers"
            ask = {**ASK, "max_tokens": 1 if rel == cand else 24, "temperature": 0}
            r = c.post(f"/s/he/r/{start['run']}/v1/chat/completions", headers={"x-reef-release-id": rel}, json=ask)
            assert r.status_code == 200, r.text
        _until("the canary to end", lambda: canary_of(c, "he") is None)
        chain = c.get("/reef/scenarios/he/releases", params={"all": "1"}).json()
        ended = next(j for j in chain["rejected"] if j["candidate"] == cand)
        assert ended["verdict"] == "canary-empty" and "stopped answering" in ended["reason"], ended
        assert ended["metrics"]["canary_reports"] == 0 and chain["head"] == head


def test_reports_on_an_ended_canarys_exchanges_are_recorded_and_move_no_decision(daemon_factory: Any) -> None:
    """Runs on both arms of a canary go unreported while scripted reports end it (``canary-ended``: its arm scored 0,
    the head's 1). Then a new canary of another candidate starts against the same head, and the late runs are
    reported, scores that would have promoted the ended one: each report is recorded (201), the ended canary's
    rejection and figures and the head stay as they were, and the new canary counts none of them (its head arm
    shares the head: only exchanges made since it started count, whenever they are reported). Bugs caught: a canary's
    reports picked by when the report came rather than when its exchange was served (the late head reports counted
    against the new canary), reports on an ended canary's arm refused, an ended canary left in the store (the new
    one refused)."""
    d: Daemon = daemon_factory()
    with d.unix() as c:
        head, cand = held_candidate(c, "rx", "be terse")
        nxt = c.post("/reef/scenarios/rx/evolve", json={"instruction": "cite the file"}).json()
        assert nxt["verdict"] == "pending", nxt
        c.post("/reef/scenarios/rx/canary", json={"release_id": cand, "share": 0.5}).raise_for_status()
        late: dict[str, list[str]] = {head: [], cand: []}
        for _ in range(64):  # runs on each arm, reported only after the canary ended
            start = c.post("/reef/runs", json={"adapter": "pi", "scenario": "rx"}).json()
            r = c.post(f"/s/rx/r/{start['run']}/v1/chat/completions",
                       headers={"x-reef-release-id": start["release_id"]}, json=ASK)
            assert r.status_code == 200, r.text
            late[start["release_id"]].append(r.headers["x-reef-agent-record-id"])
            if min(len(v) for v in late.values()) >= 3:
                break
        assert min(len(v) for v in late.values()) >= 3, {k: len(v) for k, v in late.items()}
        drive(c, "rx", lambda rel: 0.0 if rel == cand else 1.0, lambda: canary_of(c, "rx") is None)
        before = c.get("/reef/scenarios/rx/releases", params={"all": "1"}).json()
        ended = next(j for j in before["rejected"] if j["candidate"] == cand)
        assert ended["verdict"] == "canary-ended" and before["head"] == head, ended
        started = c.post("/reef/scenarios/rx/canary", json={"release_id": nxt["release_id"], "share": 0.5})
        assert started.status_code == 201, started.text
        for rel, receipts in late.items():
            for rid in receipts:
                rep = c.post("/reef/report", json={"references": [rid], "score": 1.0 if rel == cand else 0.0})
                assert rep.status_code == 201, rep.text
        now = canary_of(c, "rx")
        assert now["release_id"] == nxt["release_id"] and now["base_id"] == head, now
        assert now["figures"]["head_reports"] == 0 and now["figures"]["canary_reports"] == 0, now["figures"]
        after = c.get("/reef/scenarios/rx/releases", params={"all": "1"}).json()
        assert after["head"] == head and after["rejected"] == before["rejected"]
        assert after["releases"] == before["releases"]
