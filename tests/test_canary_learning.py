"""The canary as the learning loop's default for weights recipes (issue 43): a candidate the gate and the held-out
check pass serves half of new runs beside the head, the next step trains ahead and waits for its verdict, and the
canary's bounds end it when its scores cannot: ``canary_answers`` answers with no report on its arm promote it on
its guards, and ``canary_hours`` without a verdict promote it too, so a scenario with no live traffic does not stall
learning. A real daemon (the tiny model) and a cheap weights recipe (``tests/test_watchdog.DRIFTING``: every step
nudges each weight) over real sockets."""

from __future__ import annotations

from typing import Any

import pytest

from daemon.errors import BadRequest
from recipes import load_recipe
from tests.conftest import Daemon
from tests.test_canary import canary_of
from tests.test_learning import events_of
from tests.test_recipes import recipe_dir, with_recipe_paths  # noqa: F401 - the fixture, used by name
from tests.test_records_pg import _until

ASK = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def drifting(daemon_factory: Any, recipe_dir: Any) -> Daemon:  # noqa: F811
    from tests.test_watchdog import DRIFTING

    (recipe_dir / "drifting.py").write_text(DRIFTING)
    return with_recipe_paths(daemon_factory, recipe_dir)


def report_on_head(c: Any, name: str, head: str, n: int = 2) -> None:
    """``n`` exchanges pinned to the head, each reported: a batch for the drifting recipe, none on the canary's arm."""
    for _ in range(n):
        r = c.post(f"/s/{name}/v1/chat/completions", headers={"x-reef-release-id": head}, json=ASK)
        assert r.status_code == 200 and r.headers["x-reef-release-id"] == head, r.text
        rep = c.post("/reef/report", json={"references": [r.headers["x-reef-agent-record-id"]], "score": 1.0})
        assert rep.status_code == 201, rep.text


def test_weights_recipes_have_a_canary_by_default_and_gate_review_none() -> None:
    """Every weights recipe's settings give half of new runs to a canary with its bounds; gate review leaves the
    decision to a person (no canary), and both set at once are still refused. Bug caught: the default share 0."""
    for name in ("online-rl", "sao", "ttt-discover", "openclaw-rl"):
        s = load_recipe(name).parse_settings({})
        assert (s.canary_share, s.canary_answers, s.canary_hours) == (0.5, 50, 24.0), name
        assert load_recipe(name).parse_settings({"gate": "review"}).canary_share == 0.0
        assert load_recipe(name).parse_settings({"canary_share": 0}).canary_share == 0
    rl = load_recipe("online-rl")
    for bad in ({"canary_share": 0.3, "gate": "review"}, {"canary_answers": 0}, {"canary_hours": 0.0},
                {"canary_hours": float("inf")}, {"canary_share": 1}, {"canary_share": -0.1},  # 1: all new runs
                {"canary_share": float("nan")}):
        with pytest.raises(BadRequest) as e:
            rl.parse_settings(bad)
        assert e.value.data["param"].startswith("settings.canary_"), bad


def test_a_candidate_serves_as_a_canary_learning_waits_and_goes_on_from_the_promoted_head(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    """Default settings but for the answers bound (12, to keep the test short): the first step's candidate is held
    and serves half of new runs as a canary (the head stays); reports made meanwhile train ahead of it (on top of
    its candidate) and that step waits for its verdict; runs nobody reports reach the bound and promote it
    (``quiet``, on the chain with the figures); then the candidate trained ahead goes on against the promoted head
    and is a canary in its turn. Bugs caught: the default share 0 (straight to the head), the step not waiting for
    the verdict (it is judged against the old head and held for review: no canary could start), the bound never
    firing, the step idling while the canary runs (no train.start ahead of it)."""
    d = drifting(daemon_factory, recipe_dir)
    with d.http() as c:
        made = c.post("/reef/scenarios", json={"name": "lw", "recipe": "drifting:Drifting",
                                               "settings": {"falling": False, "canary_answers": 12}})
        assert made.status_code == 201, made.text
        head = made.json()["head"]
        assert c.get("/reef/scenarios/lw").json()["effective_settings"]["canary_share"] == 0.5
        report_on_head(c, "lw", head)
        first = _until("the first canary", lambda: canary_of(c, "lw"), 300)
        assert first["base_id"] == head and first["share"] == 0.5
        assert first["settings"]["max_answers"] == 12 and first["settings"]["max_hours"] == 24.0
        chain = c.get("/reef/scenarios/lw/releases", params={"all": "1"}).json()
        assert chain["head"] == head and [p["release_id"] for p in chain["pending"]] == [first["release_id"]]
        report_on_head(c, "lw", head)  # a second batch, while the canary runs: it trains ahead, then waits
        ahead = events_of(c, "lw", "train.start", 2)[1]
        assert ahead["ahead_of"] == first["release_id"] and not ahead["from_head"], ahead
        _until("the loop to wait on the canary", lambda: c.get("/reef/status").json()["learning"].get("lw") == "canary")
        assert canary_of(c, "lw")["release_id"] == first["release_id"]  # trained while it still runs
        arms = set()
        for i in range(200):  # runs nobody reports on: the canary's answers reach its bound
            if canary_of(c, "lw") is None:
                break
            r = c.post(f"/s/lw/r/run_{i:04d}/v1/chat/completions", json=ASK)
            assert r.status_code == 200, r.text
            arms.add(r.headers["x-reef-release-id"])
        _until("the canary's end", lambda: (x := canary_of(c, "lw")) is None or x["release_id"] != first["release_id"])
        assert {head, first["release_id"]} <= arms
        chain = c.get("/reef/scenarios/lw/releases", params={"all": "1"}).json()
        promoted = next(r for r in chain["releases"] if r["operation"] == "promote")
        assert promoted["source"] == first["release_id"] and promoted["metrics"]["canary_verdict"] == "quiet"
        assert promoted["metrics"]["canary_reports"] == 0 and promoted["metrics"]["canary_answers"] >= 12
        second = _until("the next candidate's canary", lambda: canary_of(c, "lw"), 300)
        assert second["base_id"] == promoted["release_id"] != first["base_id"]
        chain = c.get("/reef/scenarios/lw/releases", params={"all": "1"}).json()
        assert [p["release_id"] for p in chain["pending"]] == [second["release_id"]], chain["pending"]
        assert chain["pending"][0]["metrics"]["trained_ahead_of"] == first["release_id"]
        assert not [j for j in chain["rejected"] if "no canary could start" in (j.get("reason") or "")]


def test_a_scenario_with_no_traffic_promotes_its_canary_at_the_time_bound(daemon_factory: Any,
                                                                          recipe_dir: Any) -> None:  # noqa: F811
    """No run ever comes after the candidate: at ``canary_hours`` (a second here) the canary is promoted as
    ``expired`` with its figures, and learning goes on from it: the next step continues the lineage (its weights
    and the trainer's optimizer) from the promoted head. Bugs caught: a canary with no traffic running forever; the
    step after a promotion starting from the head with a fresh optimizer (``daemon/lineage.py``)."""
    d = drifting(daemon_factory, recipe_dir)
    with d.http() as c:
        made = c.post("/reef/scenarios", json={"name": "lq", "recipe": "drifting:Drifting",
                                               "settings": {"falling": False, "canary_hours": 0.0003}})
        head = made.json()["head"]
        report_on_head(c, "lq", head)
        chain = _until("the canary's promotion", lambda: (x := c.get("/reef/scenarios/lq/releases").json())[
            "head"] != head and x, 300)
        top = chain["releases"][0]
        assert top["operation"] == "promote" and top["metrics"]["canary_verdict"] == "expired", top
        assert top["metrics"]["canary_answers"] == 0 and top["metrics"]["canary_reports"] == 0
        assert top["source"] != head and top["parent"] == head
        report_on_head(c, "lq", top["release_id"])  # the next batch, after the promotion
        starts = events_of(c, "lq", "train.start", 2)
        # the lineage follows the promoted head (the canary's candidate, its optimizer kept), not a fresh start
        assert [e["from_head"] for e in starts] == [True, False] and starts[1]["base"] == top["release_id"], starts


def test_the_detectable_difference_is_the_one_decided_in_that_many_pairs() -> None:
    """``betting.detectable(n)`` is the difference the bettors decide in a median of about ``n`` pairs: checked by
    simulation (pass/fail scores around 0.5 at 40, 100 and 300 pairs, continuous ones at 30; 200 seeded canaries
    each), within the stake's
    learning overhead (the median lies from 0.85 n to 1.4 n); fewer pairs than any difference needs give None. Bugs
    caught: the stake's cap left out of the growth (continuous scores: 0.19 then looks decidable in 30 pairs, where
    it takes about 50), the bisection's halves swapped."""
    import random
    import statistics

    from daemon.betting import Bettors, detectable, pairs_needed

    assert detectable(5, 0.5, 0.05) is None and detectable(0, 0.5, 0.05) is None
    assert 0.19 < detectable(105, 0.5, 0.05) < 0.2 and 0.29 < detectable(48, 0.5, 0.05) < 0.31  # bench/canary.py
    rng = random.Random(7)

    def draw(mean: float, sd: float | None) -> float:  # pass/fail, or continuous (sd) clipped to [0, 1]
        return float(rng.random() < mean) if sd is None else min(1.0, max(0.0, rng.gauss(mean, sd)))

    # pass/fail (variance of a difference 0.5), and continuous scores of sd 0.25, where the stake's cap binds
    for n, var, sd in ((40, 0.5, None), (100, 0.5, None), (300, 0.5, None), (30, 0.12, 0.25)):
        diff = detectable(n, var, 0.05)
        assert diff is not None and abs(pairs_needed(diff, var, 0.05) - n) < 0.5
        taken = []
        for _ in range(200):
            b, k = Bettors(0.05), 0
            while b.evidence().verdict is None and k < 20 * n:
                b.add(draw(0.5 + diff / 2, sd) - draw(0.5 - diff / 2, sd))
                k += 1
            taken.append(k)
        assert 0.85 * n <= statistics.median(taken) <= 1.4 * n, (n, diff, statistics.median(taken))


def test_a_running_canary_is_shown_with_each_arm_in_status_releases_list_and_its_pages(daemon: Daemon) -> None:
    """A canary whose arm is scored 1 and whose head is scored 0: ``reef status``, ``reef releases list``, the
    release pages of both arms and the TUI's line show its share, each arm's reports, mean, interval and guard
    figures on the right arm, the intervals by betting (each arm's, and the difference's that decides), and the
    smallest difference it can still decide. Bugs caught: the arms swapped in the figures or the lines, the lines
    left out of a view, the intervals shown still Hoeffding's (or at alpha, not alpha / 2, for an arm)."""
    from reef_cli.tui.format import canary_line
    from tests.test_canary import held_candidate, one_run

    with daemon.unix() as c:
        head, cand = held_candidate(c, "cd", "be terse")
        c.post("/reef/scenarios/cd/canary", json={"release_id": cand, "share": 0.5, "max_reports": 10_000}
               ).raise_for_status()
        seen = set()
        while len(seen) < 2 or (canary_of(c, "cd")["figures"]["head_reports"] < 2):
            seen.add(one_run(c, "cd", lambda rel: 1.0 if rel == cand else 0.0)[1])
        status = canary_of(c, "cd")
        f, lines = status["figures"], status["lines"]
        assert f["canary_mean"] == 1.0 and f["head_mean"] == 0.0 and f["detectable"] is not None
        assert lines[0].startswith(f"canary {cand[:12]} serves 50% of new runs beside {head[:12]}")
        assert lines[1].startswith(f"  canary arm: {f['canary_reports']} reports, mean 1.000 [")
        assert lines[2].startswith(f"  head arm:   {f['head_reports']} reports, mean 0.000 [")
        assert f"{f['canary_answers']} answers" in lines[1] and f"{f['head_answers']} answers" in lines[2]
        # the intervals are by betting: each arm's at alpha / 2, the difference's the decision's own (at alpha)
        from daemon.betting import interval, mean_interval, pairs

        for arm, score, line in (("canary", 1.0, lines[1]), ("head", 0.0, lines[2])):
            want = [round(x, 4) for x in mean_interval([score] * f[f"{arm}_reports"], 0.025)]  # type: ignore[union-attr]
            assert f[f"{arm}_interval"] == want and f"[{want[0]:.2f}, {want[1]:.2f}]" in line, (arm, f, line)
        diff = interval(pairs([0.0] * f["head_reports"], [1.0] * f["canary_reports"]), 0.05)
        assert diff is not None and f["difference_interval"] == [round(x, 4) for x in diff]
        assert lines[3].startswith(f"  difference canary - head +1.000 [{diff[0]:+.2f}, {diff[1]:+.2f}] over "
                                   f"{f['pairs']} paired reports"), lines[3]
        assert f"decides a difference of {f['detectable']:.2f} or more by its end" in lines[4]
        shown = c.get("/reef/status").json()["canaries"]
        assert [(s["scenario"], s["release_id"]) for s in shown] == [("cd", cand)]
        pages = {rel: c.get(f"/reef/releases/{rel}/page").text for rel in (cand, head)}
    out = daemon.cli("status").stdout
    assert f"canary   cd: canary {cand[:12]}" in out and "canary arm:" in out and "head arm:" in out, out
    listed = daemon.cli("releases", "list", "-s", "cd").stdout
    assert f"canary {cand[:12]} serves 50%" in listed and "mean 1.000" in listed and "canary-end" in listed, listed
    for rel, page in pages.items():
        assert "Its live canary" in page and "canary arm:" in page, rel
        assert ("the candidate" if rel == cand else "the head it is compared with") in page
    tui = canary_line(status, [])
    assert "canary arm:" in tui and "mean 1.000" in tui.split("canary arm:")[1].split("\n")[0]


def test_after_an_ended_canary_learning_starts_again_from_the_head(daemon_factory: Any,
                                                                   recipe_dir: Any) -> None:  # noqa: F811
    """A canary ended (by hand here; a guard or the scores alike) turns its candidate away: the step that trained
    ahead of it (on top of it) is discarded, written down as skipped without its receipts, and its batch trains
    again from the head, not on top of the candidate live traffic refused. The drifting recipe adds 1e-3 times the
    batch's mean score to every weight, so the next candidate differs from the head by 0.001 (from the head) or
    0.002 (on top of the ended one). Bugs caught: the lineage kept after the end, the candidate trained ahead
    served, its batch consumed by the discarded step."""
    d = drifting(daemon_factory, recipe_dir)
    with d.http() as c:
        made = c.post("/reef/scenarios", json={"name": "le", "recipe": "drifting:Drifting",
                                               "settings": {"falling": False}})
        head = made.json()["head"]
        report_on_head(c, "le", head)
        first = _until("the first canary", lambda: canary_of(c, "le"), 300)
        report_on_head(c, "le", head)  # trains ahead of the canary, then waits for its verdict
        assert events_of(c, "le", "train.start", 2)[1]["ahead_of"] == first["release_id"]
        _until("the loop to wait on the canary", lambda: c.get("/reef/status").json()["learning"].get("le") == "canary")
        assert c.post("/reef/scenarios/le/canary/end", json={}).json()["verdict"] == "ended"
        second = _until("the next candidate's canary", lambda: (x := canary_of(c, "le")) and x["release_id"] !=
                        first["release_id"] and x, 300)
        assert second["base_id"] == head
        chain = c.get("/reef/scenarios/le/releases", params={"all": "1"}).json()
        discarded = [j for j in chain["rejected"] if "trained ahead of canary" in (j.get("reason") or "")]
        assert len(discarded) == 1 and discarded[0]["receipts"] == [], chain["rejected"]
        assert len(chain["pending"][0]["receipts"]) == 2  # the discarded step's batch, learned from again

        def moved(rel: str) -> float:
            files = c.get(f"/reef/scenarios/le/releases/{rel}").json()["diff"]["files"]
            return max(t["max_abs"] for f in files for t in (f.get("tensors") or []) if "max_abs" in t)

        assert moved(first["release_id"]) == pytest.approx(1e-3, rel=0.05)
        assert moved(second["release_id"]) == pytest.approx(1e-3, rel=0.05)


def test_a_restart_mid_canary_keeps_its_arms_and_counts_and_learning_waits_for_its_verdict(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    """The first candidate serves as a canary (answers bound 12), a second batch of reports waits, runs nobody
    reports give both arms answers; then kill -9 and a start. After the restart the canary runs on against the same
    head with the same settings and counts, the loop looks again and waits (``canary``: nothing trained meanwhile),
    and the verdict reached after the restart (``quiet``, at the bound, on answers served after it) sends the
    waiting batch to training from the promoted head, as a canary in its turn. Bugs caught: the canaries not read
    back at start (no canary after a restart: the batch trains against the old head), the loop starting before them
    (its first look trains the waiting batch), the loop not waiting, the end not telling the loop (the batch waits
    for a report that never comes)."""
    d = drifting(daemon_factory, recipe_dir)
    with d.http() as c:
        made = c.post("/reef/scenarios", json={"name": "lk", "recipe": "drifting:Drifting",
                                               "settings": {"falling": False, "canary_answers": 12}})
        head = made.json()["head"]
        report_on_head(c, "lk", head)
        first = _until("the first canary", lambda: canary_of(c, "lk"), 300)
        report_on_head(c, "lk", head)  # the next batch waits while the canary runs
        _until("the loop to wait on the canary", lambda: c.get("/reef/status").json()["learning"].get("lk") == "canary")
        arms: dict[str, int] = {}
        for i in range(60):  # runs nobody reports: answers on both arms, short of the bound on the canary's
            rel = c.post(f"/s/lk/r/run_a{i:03d}/v1/chat/completions", json=ASK).headers["x-reef-release-id"]
            arms[rel] = arms.get(rel, 0) + 1
            if arms.get(first["release_id"], 0) >= 6 and arms.get(head, 0) >= 6:
                break
        before = canary_of(c, "lk")
    d.kill9()
    d.start()
    with d.http() as c:
        after = canary_of(c, "lk")
        assert after is not None, "the canary did not survive the restart"
        for key in ("release_id", "base_id", "share", "started_at", "settings"):
            assert after[key] == before[key], key
        for key in ("canary_answers", "head_answers", "canary_reports", "head_reports", "canary_exchanges"):
            assert after["figures"][key] == before["figures"][key], (key, before["figures"], after["figures"])
        assert before["figures"]["canary_answers"] >= 6 and before["figures"]["head_reports"] == 2
        _until("the loop to wait on the canary again",
               lambda: c.get("/reef/status").json()["learning"].get("lk") == "canary")
        chain = c.get("/reef/scenarios/lk/releases", params={"all": "1"}).json()
        assert chain["head"] == head and [p["release_id"] for p in chain["pending"]] == [first["release_id"]]
        assert chain["rejected"] == [], "the waiting batch was trained on while the canary ran"
        for i in range(200):  # more runs nobody reports: the canary reaches its bound
            running = canary_of(c, "lk")  # read once: it may end between two reads
            if running is None or running["release_id"] != first["release_id"]:
                break
            assert c.post(f"/s/lk/r/run_b{i:03d}/v1/chat/completions", json=ASK).status_code == 200
        chain = c.get("/reef/scenarios/lk/releases", params={"all": "1"}).json()
        promoted = next(r for r in chain["releases"] if r["operation"] == "promote")
        assert promoted["source"] == first["release_id"] and promoted["metrics"]["canary_verdict"] == "quiet"
        second = _until("the waiting batch's canary", lambda: (x := canary_of(c, "lk")) and
                        x["release_id"] != first["release_id"] and x, 150)
        assert second["base_id"] == promoted["release_id"]
        chain = c.get("/reef/scenarios/lk/releases", params={"all": "1"}).json()
        assert [p["release_id"] for p in chain["pending"]] == [second["release_id"]] and chain["rejected"] == []
