"""Agent-proposed harness changes (``daemon/proposals.py``), against a real daemon over real sockets: a proposal
goes through the screens and the scenario's gate and its verdict is on the chain, with the proposal (its reason, its
run and receipt) in the manifest; what cannot be judged is refused at the door with nothing written. The gate's
model is a stand-in over real HTTP (``tests/harness_standins.py``, model ``echo``: it answers with the rules it was
given), so the compare gate's tasks pass exactly under the rules that hold the words they expect. The last test
drives it from a real agent episode: the real ``pi``, wrapped, runs ``reef-pi propose`` as a tool call."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ROOT, Daemon, assert_canonical_error, free_port, make_home
from tests.procs import wait_standin
from tests.test_agents import BIN, _user_home, agents_dir, last_run  # noqa: F401 - agents_dir: a fixture

FRENCH = "Write greetings in French."


@pytest.fixture(scope="module")
def world(tiny_model: Path) -> Iterator[dict[str, Any]]:
    stub_port = free_port()
    stub = subprocess.Popen([sys.executable, str(ROOT / "tests" / "harness_standins.py"), str(stub_port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    standin = f"http://127.0.0.1:{stub_port}"
    wait_standin(standin)
    closed = free_port()  # nothing listens there: a model that cannot answer
    hang = socket.create_server(("127.0.0.1", 0))  # takes connections and answers none (until the test ends them)
    hang.settimeout(120)
    models = "".join(f'\n[models.{name}]\nengine = "upstream"\nurl = "{url}"\nformat = "openai-chat"\n'
                     f'upstream_model = "{name}"\n' for name, url in (
                         ("agent", standin), ("echo", standin), ("down", f"http://127.0.0.1:{closed}"),
                         ("hang", f"http://127.0.0.1:{hang.getsockname()[1]}")))
    home, port, env = make_home(tiny_model, models)
    d = Daemon(home=home, port=port, env=env).start()
    yield {"daemon": d, "standin": standin, "home": home, "env": env, "hang": hang}
    hang.close()
    stub.kill()
    stub.wait()
    d.stop()
    shutil.rmtree(home, ignore_errors=True)


def scenario(c: httpx.Client, name: str, **body: Any) -> None:
    r = c.post("/reef/scenarios", json={"name": name, "recipe": "lessons", **body})
    assert r.status_code == 201, r.text


def propose(c: httpx.Client, name: str, /, **body: Any) -> httpx.Response:
    return c.post(f"/reef/scenarios/{name}/proposals", json=body)


def chain(c: httpx.Client, name: str) -> dict[str, Any]:
    r = c.get(f"/reef/scenarios/{name}/releases", params={"all": "1"})
    assert r.status_code == 200, r.text
    return r.json()


def rules_of(c: httpx.Client, name: str) -> str:
    return c.get(f"/reef/scenarios/{name}/harness").json()["files"].get("AGENTS.md", "")


def test_a_good_proposal_is_admitted_with_its_reason_run_and_receipt_on_the_chain(world: dict[str, Any]) -> None:
    """Bugs caught: a proposal that never reaches the chain, a release that does not say it came from a proposal
    (or loses the reason, the run or the receipt), a retire or replace that leaves the rule in place."""
    d: Daemon = world["daemon"]
    with d.http() as c:
        scenario(c, "prop")
        run = "run_prop1"  # one exchange of the run: the receipt of the request whose tool call proposes
        served = c.post("/s/prop/r/run_prop1/v1/chat/completions",
                        json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert served.status_code == 200, served.text
        receipt = served.headers["x-reef-agent-record-id"]
        r = propose(c, "prop", op="add", kind="rule", text="Run the tests before you commit.",
                    reason="two runs committed code whose tests failed", run=run)
        assert r.status_code == 201, r.text
        out = r.json()
        assert out["verdict"] == "accepted" and out["release_id"] and out["receipt"] == receipt, out
        rel = c.get(f"/reef/scenarios/prop/releases/{out['release_id']}").json()
        origin = rel["origin"]
        assert origin["kind"] == "proposal" and origin["id"] == out["proposal"] and origin["op"] == "add"
        assert origin["reason"] == "two runs committed code whose tests failed"
        assert origin["run"] == run and origin["receipt"] == receipt
        assert chain(c, "prop")["head"] == out["release_id"]
        rules = rules_of(c, "prop")
        assert "Run the tests before you commit." in rules
        rule_id = origin["target"].split(" ", 1)[1]
        assert f"[{rule_id}] Run the tests" in rules  # the id an agent names to retire it

        # replace (named by its whole text) and retire (by its id): each a release saying so
        r = propose(c, "prop", op="replace", kind="rule", name="Run the tests before you commit.",
                    text="Run the whole test suite before you commit.", reason="a single test was not enough")
        assert r.status_code == 201 and r.json()["verdict"] == "accepted", r.text
        assert "Run the whole test suite" in rules_of(c, "prop") and "Run the tests before" not in rules_of(c, "prop")
        r = propose(c, "prop", op="retire", kind="rule", name=rule_id, reason="the hook runs the tests now")
        assert r.status_code == 201 and r.json()["verdict"] == "accepted", r.text
        assert "test suite" not in rules_of(c, "prop")
        retired = c.get(f"/reef/scenarios/prop/releases/{r.json()['release_id']}").json()
        assert retired["origin"]["op"] == "retire" and retired["origin"]["run"] is None

        # skills: added, then retired
        r = propose(c, "prop", op="add", kind="skill", name="release-notes", text="How to write release notes.",
                    reason="asked for twice")
        assert r.status_code == 201 and r.json()["verdict"] == "accepted", r.text
        files = c.get("/reef/scenarios/prop/harness").json()["files"]
        assert "name: release-notes" in files["skills/release-notes/SKILL.md"]
        r = propose(c, "prop", op="retire", kind="skill", name="release-notes", reason="not used")
        assert r.status_code == 201 and r.json()["verdict"] == "accepted", r.text
        assert "skills/release-notes/SKILL.md" not in c.get("/reef/scenarios/prop/harness").json()["files"]


def test_screens_refusals_and_nothing_written_at_the_door(world: dict[str, Any]) -> None:
    """Bugs caught: a secret (or an oversized rule) entering a harness, a screened-out proposal missing from the
    chain or not naming its screen, a retire of a missing rule accepted or written down, a body over the limit
    read."""
    d: Daemon = world["daemon"]
    with d.http() as c:
        scenario(c, "prop-screen")
        head = chain(c, "prop-screen")["head"]
        secret = propose(c, "prop-screen", op="add", kind="rule",
                         text="Use the key sk-proj-abcdefghijklmnopqrstuvwx1234 for the tests.", reason="it works")
        assert secret.status_code == 201, secret.text
        got = secret.json()
        assert got["verdict"] == "rejected" and got["screen"] == "secrets", got
        assert got["reason"].startswith("screened out by the secrets screen:") and "API key" in got["reason"]
        long = propose(c, "prop-screen", op="add", kind="rule", text="Be careful. " * 200, reason="more care")
        assert long.status_code == 201 and long.json()["screen"] == "size", long.text
        assert "the limit is 1000" in long.json()["reason"]  # lessons' max_chars
        body = chain(c, "prop-screen")
        assert body["head"] == head and "sk-proj" not in rules_of(c, "prop-screen")
        rejected = {r["origin"]["id"]: r for r in body["rejected"]}
        assert rejected[got["proposal"]]["verdict"] == "rejected"
        assert rejected[got["proposal"]]["reason"].startswith("screened out by the secrets screen")
        assert rejected[got["proposal"]]["origin"]["reason"] == "it works"
        assert rejected[long.json()["proposal"]]["metrics"]["screen"] == "size"
        listed = subprocess.run([sys.executable, "-m", "reef_cli.main", "releases", "list", "-s", "prop-screen", "--all"],
                                env={**d.env, "COLUMNS": "400"}, capture_output=True, text=True, timeout=120).stdout
        assert "screened out by the secrets screen" in listed and "agent proposal: add rule" in listed, listed

        before = len(body["rejected"])
        missing = propose(c, "prop-screen", op="retire", kind="rule", name="no-such-rule", reason="gone")
        err = assert_canonical_error(missing, 404)
        assert "no rule 'no-such-rule'" in err["message"], err
        assert_canonical_error(propose(c, "prop-screen", op="replace", kind="skill", name="nope", text="x",
                                       reason="r"), 404)
        huge = propose(c, "prop-screen", op="add", kind="rule", text="x" * 70_000, reason="big")
        assert "the limit is 65536" in assert_canonical_error(huge, 413)["message"]
        assert "reason is required" in assert_canonical_error(
            propose(c, "prop-screen", op="add", kind="rule", text="Be brief."), 400)["message"]
        assert_canonical_error(propose(c, "prop-screen", op="rename", kind="rule", text="x", reason="r"), 400)
        for bad in ({}, ["add"]):  # not text: a 400 naming op or kind (an object was a 500, found by Schemathesis)
            assert assert_canonical_error(propose(c, "prop-screen", op=bad, kind="rule", text="x", reason="r"),
                                          400)["param"] == "op"
            assert assert_canonical_error(propose(c, "prop-screen", op="add", kind=bad, text="x", reason="r"),
                                          400)["param"] == "kind"
        assert len(chain(c, "prop-screen")["rejected"]) == before  # refused at the door: nothing written

        # a scenario whose recipe learns no harness takes no proposal
        assert c.post("/reef/scenarios", json={"name": "prop-rec", "recipe": "record"}).status_code == 201
        assert "does not learn a harness" in assert_canonical_error(
            propose(c, "prop-rec", op="add", kind="rule", text="Be brief.", reason="r"), 400)["message"]


def test_the_gate_decides_with_its_figures_and_an_unevaluable_proposal_is_failed(world: dict[str, Any]) -> None:
    """The scenario's own gate (lessons compare, five tasks expecting the rule's words, answered by the echo model
    under each tree's rules): the rule added wins every pair and is published; retiring it loses every pair and is
    on the chain as rejected with the gate's figures. Bugs caught: a proposal that skips the gate, a gate verdict
    not written down, a proposal whose evaluation failed recorded as a loss."""
    d: Daemon = world["daemon"]
    tasks = [{"prompt": f"greet {i}", "expect": "greetings in French"} for i in range(5)]
    with d.http() as c:
        scenario(c, "prop-gate", model="echo", settings={"gate": "compare", "tasks": tasks})
        won = propose(c, "prop-gate", op="add", kind="rule", name="french", text=FRENCH, reason="the user is French")
        assert won.status_code == 201, won.text
        assert won.json()["verdict"] == "accepted" and won.json()["metrics"]["wins"] == 5, won.json()
        lost = propose(c, "prop-gate", op="retire", kind="rule", name="french", reason="English is shorter")
        assert lost.status_code == 201, lost.text
        out = lost.json()
        assert out["verdict"] == "rejected" and "wins 0 - losses 5" in out["reason"], out
        body = chain(c, "prop-gate")
        assert body["head"] == won.json()["release_id"] and FRENCH in rules_of(c, "prop-gate")
        [rej] = [r for r in body["rejected"] if (r.get("origin") or {}).get("id") == out["proposal"]]
        assert rej["verdict"] == "rejected" and rej["metrics"]["losses"] == 5 and rej["metrics"]["wins"] == 0
        assert rej["metrics"]["p_value"] == 1.0 and rej["origin"]["reason"] == "English is shorter"

        # the gate's model cannot answer: the proposal could not be evaluated, written down as failed
        scenario(c, "prop-down", model="down", settings={"gate": "compare", "tasks": tasks})
        failed = propose(c, "prop-down", op="add", kind="rule", text=FRENCH, reason="r")
        assert failed.status_code == 201, failed.text
        assert failed.json()["verdict"] == "failed", failed.json()
        assert failed.json()["reason"].startswith("the proposal could not be evaluated:")
        [rej] = chain(c, "prop-down")["rejected"]
        assert rej["verdict"] == "failed" and rej["origin"]["id"] == failed.json()["proposal"]


def test_only_the_full_token_proposes_and_only_for_the_runs_own_scenario(world: dict[str, Any]) -> None:
    """A token scoped to an episode (daemon/scopes.py) never steers: refused for its own scenario and another's;
    a run of another scenario cannot propose here. Bugs caught: a sandboxed agent changing a harness, a run's
    proposal landing on another scenario's chain."""
    d: Daemon = world["daemon"]
    with d.http() as c:
        scenario(c, "prop-a")
        scenario(c, "prop-b")
        token = c.post("/reef/tokens", json={"scenario": "prop-a", "ttl_s": 600}).json()["token"]
        served = c.post("/s/prop-b/r/run_of_b/v1/chat/completions",
                        json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert served.status_code == 200, served.text
        other = propose(c, "prop-a", op="add", kind="rule", text="Be brief.", reason="r", run="run_of_b")
        assert "run run_of_b is a run of scenario 'prop-b'" in assert_canonical_error(other, 400)["message"]
    with httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as scoped:
        for name in ("prop-b", "prop-a"):
            r = propose(scoped, name, op="add", kind="rule", text="Be brief.", reason="r")
            assert "not allowed with a token scoped to scenario 'prop-a'" in assert_canonical_error(r, 403)["message"]
    with d.http() as c:
        assert chain(c, "prop-a")["rejected"] == [] and chain(c, "prop-b")["rejected"] == []
        assert len(chain(c, "prop-a")["releases"]) == 1  # its init only


def test_paused_or_archived_scenarios_refuse_proposals_naming_why(world: dict[str, Any]) -> None:
    """Refused with 409 (not queued: the module docstring says why), nothing written; resumed, it is judged.
    Bugs caught: a proposal published while learning is paused, or onto an archived scenario."""
    d: Daemon = world["daemon"]
    with d.http() as c:
        scenario(c, "prop-p")
        assert c.post("/reef/scenarios/prop-p/pause").status_code == 200
        r = propose(c, "prop-p", op="add", kind="rule", text="Be brief.", reason="r")
        assert "has its learning paused" in assert_canonical_error(r, 409)["message"]
        assert c.post("/reef/scenarios/prop-p/archive").status_code == 200
        r = propose(c, "prop-p", op="add", kind="rule", text="Be brief.", reason="r")
        assert "is archived" in assert_canonical_error(r, 409)["message"]
        body = chain(c, "prop-p")
        assert body["rejected"] == [] and len(body["releases"]) == 1
        assert c.post("/reef/scenarios/prop-p/unarchive").status_code == 200
        assert c.post("/reef/scenarios/prop-p/resume").status_code == 200
        r = propose(c, "prop-p", op="add", kind="rule", text="Be brief.", reason="r")
        assert r.status_code == 201 and r.json()["verdict"] == "accepted", r.text


def test_each_agents_rules_say_how_to_propose(world: dict[str, Any]) -> None:
    """The one rule, in each agent's own rules file with its own command; not in the neutral tree (the chain's
    content) and not for a scenario that takes no proposals."""
    d: Daemon = world["daemon"]
    with d.http() as c:
        scenario(c, "prop-rule")
        assert c.post("/reef/scenarios/prop-rule/evolve", json={"instruction": "Keep diffs small."}).status_code == 201
        for agent, path in (("pi", ".pi/agent/AGENTS.md"), ("claude", ".claude/CLAUDE.md"),
                            ("opencode", ".config/opencode/AGENTS.md")):
            files = c.get("/reef/scenarios/prop-rule/harness", params={"adapter": agent}).json()["files"]
            assert "Keep diffs small." in files[path] and f"`reef-{agent} propose --add-rule" in files[path], files
        assert "propose" not in rules_of(c, "prop-rule")
        assert c.post("/reef/scenarios", json={"name": "prop-rule-rec", "recipe": "record",
                                            "model": "agent"}).status_code == 201  # a harness chain
        assert c.get("/reef/scenarios/prop-rule-rec/harness", params={"adapter": "pi"}).json()["files"] == {}


def test_a_real_agent_proposes_from_its_episode_and_the_next_run_follows_it(world: dict[str, Any],
                                                                           agents_dir: Path) -> None:  # noqa: F811
    """End to end: the real pi, wrapped by reef-pi, reads the propose rule in its harness and runs `reef-pi propose`
    with its bash tool (its model is the stand-in over real HTTP: told `[run] COMMAND`, it calls bash with it). The
    proposal is on the chain with the run and the receipt of the exchange that called the tool; the next run gets
    the rule and follows it (the stand-in writes `bonjour` under it)."""
    d: Daemon = world["daemon"]
    work = Path(tempfile.mkdtemp(prefix="reef-propose-"))
    project = work / "project"
    project.mkdir()
    env = dict(world["env"], REEF_AGENTS_DIR=str(agents_dir), HOME=str(_user_home(work)),
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    s = {"daemon": d}

    def reef_pi(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BIN / "reef-pi"), "--reef-scenario", "prop-pi", *args], cwd=project, env=env,
                              capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)

    try:
        with d.http() as c:
            scenario(c, "prop-pi", model="agent")
        command = f'reef-pi propose --add-rule "{FRENCH}" --reason "the user writes in French"'
        first = reef_pi("-p", "--no-session", f"[run] {command}")
        assert first.returncode == 0, first.stdout + first.stderr
        run = last_run(s, "pi")
        seen = httpx.get(f"{world['standin']}/_requests").json()
        assert any("`reef-pi propose --add-rule" in r["system"] for r in seen), "the rule was not in pi's prompt"
        with d.http() as c:
            head = chain(c, "prop-pi")["releases"][0]
            origin = head["origin"]
            assert origin["kind"] == "proposal" and origin["run"] == run["run"], head
            assert origin["reason"] == "the user writes in French" and origin["receipt"] in run["receipts"]
            assert FRENCH in rules_of(c, "prop-pi")
        second = reef_pi("-p", "--no-session", "Write the greeting into answer.txt.")
        assert second.returncode == 0, second.stdout + second.stderr
        assert (project / "answer.txt").read_text().strip() == "bonjour"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def proposals(c: httpx.Client, name: str, **params: Any) -> dict[str, Any]:
    r = c.get(f"/reef/scenarios/{name}/proposals", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_proposals_are_listed_newest_first_with_their_verdicts(world: dict[str, Any]) -> None:
    """GET /reef/scenarios/{s}/proposals and `reef scenarios proposals`: each proposal once, newest first, with what
    became of it (admitted as which release, refused by which screen, rejected by the gate with its figures, failed,
    held for review), a page at a time. Bugs caught: a verdict missing or wrong (a screened-out proposal shown as the
    gate's, a rollback to a proposal's release listed as a second one), the wrong order, a page that repeats or
    skips, an unknown scenario or cursor answered 200."""
    d: Daemon = world["daemon"]
    tasks = [{"prompt": f"greet {i}", "expect": "greetings in French"} for i in range(5)]
    with d.http() as c:
        scenario(c, "prop-list", model="echo", settings={"gate": "compare", "tasks": tasks})
        assert proposals(c, "prop-list") == {"scenario": "prop-list", "proposals": [], "next_after": None}
        won = propose(c, "prop-list", op="add", kind="rule", name="french", text=FRENCH, reason="the user is French")
        lost = propose(c, "prop-list", op="retire", kind="rule", name="french", reason="English is shorter")
        secret = propose(c, "prop-list", op="add", kind="rule", reason="it works",
                         text="Use the key sk-proj-abcdefghijklmnopqrstuvwx1234 for the tests.")
        assert all(r.status_code == 201 for r in (won, lost, secret)), [r.text for r in (won, lost, secret)]
        ids = [r.json()["proposal"] for r in (won, lost, secret)]
        first = won.json()["release_id"]
        # a rollback to the proposal's release republishes its content: no second entry
        head = chain(c, "prop-list")["head"]
        assert c.post("/reef/scenarios/prop-list/rollback", json={"release_id": first,
                                                                    "expected_head": head}).status_code == 201
        listed = proposals(c, "prop-list")
        assert [p["id"] for p in listed["proposals"]] == ids[::-1] and listed["next_after"] is None, listed
        s, r, a = listed["proposals"]
        assert a["verdict"] == "admitted" and a["release_id"] == first and a["step"] == 1, a
        assert a["op"] == "add" and a["target"] == "rule french" and a["reason"] == "the user is French"
        assert a["at"] <= a["decided_at"]
        assert r["verdict"] == "rejected" and r["metrics"]["losses"] == 5 and "wins 0 - losses 5" in r["why"], r
        assert s["verdict"] == "screened" and s["screen"] == "secrets" and "API key" in s["why"], s

        # pages of one: each once, in order, the last saying no more
        seen, after = [], None
        for _ in range(len(ids) + 1):  # a page that repeats would loop for ever
            page = proposals(c, "prop-list", limit=1, **({"after": after} if after else {}))
            seen += [p["id"] for p in page["proposals"]]
            after = page["next_after"]
            if after is None:
                break
        assert seen == ids[::-1], seen
        assert assert_canonical_error(c.get("/reef/scenarios/prop-list/proposals", params={"after": "prop_nope"}),
                                      400)["param"] == "after"
        assert "no-such-scenario" in assert_canonical_error(c.get("/reef/scenarios/no-such-scenario/proposals"),
                                                            404)["message"]

        # a review gate holds it
        scenario(c, "prop-list-review", settings={"gate": "review"})
        held = propose(c, "prop-list-review", op="add", kind="rule", text="Keep diffs small.", reason="r")
        assert held.status_code == 201, held.text
        [h] = proposals(c, "prop-list-review")["proposals"]
        assert h["verdict"] == "held" and h["candidate"] == chain(c, "prop-list-review")["pending"][0]["release_id"]
        promoted = c.post("/reef/scenarios/prop-list-review/promote", json={"release_id": h["candidate"]})
        assert promoted.status_code == 201, promoted.text
        [p] = proposals(c, "prop-list-review")["proposals"]
        assert (p["id"], p["verdict"], p["reviewed"], p["release_id"]) == (
            h["id"], "admitted", True, promoted.json()["release_id"]), p

    out = subprocess.run([sys.executable, "-m", "reef_cli.main", "scenarios", "proposals", "prop-list"],
                         env={**d.env, "COLUMNS": "400"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # a narrow terminal wraps the verdicts
    at = [text.index(x) for x in ids[::-1]]
    assert at == sorted(at), out.stdout
    assert f"admitted as release {first[:12]} (step 1)" in text[at[2]:], out.stdout
    assert "rejected by the gate: gate: candidate - base -1.000" in text[at[1]:at[2]], out.stdout
    assert "refused by the secrets screen: rule" in text[at[0]:at[1]], out.stdout
    as_json = subprocess.run([sys.executable, "-m", "reef_cli.main", "scenarios", "proposals", "prop-list", "--json"],
                             env=d.env, capture_output=True, text=True, timeout=120)
    assert [p["id"] for p in __import__("json").loads(as_json.stdout)] == ids[::-1], as_json.stdout
    gone = subprocess.run([sys.executable, "-m", "reef_cli.main", "scenarios", "proposals", "no-such-scenario"],
                          env=d.env, capture_output=True, text=True, timeout=120)
    assert gone.returncode == 4 and "no-such-scenario" in gone.stderr, gone.stdout + gone.stderr


def test_a_proposal_being_judged_is_listed_pending_then_with_its_verdict(world: dict[str, Any]) -> None:
    """The gate's model takes the connection and answers nothing (the test's last use of it): while the proposal waits on it, it is listed
    pending; the connection ended, it could not be evaluated, and the same id is listed failed. A scoped token reads
    none of it. Bugs caught: a proposal invisible until judged, one listed twice or still pending once decided, an
    evaluation's token reading the proposals of the harness it is scored on."""
    from concurrent.futures import ThreadPoolExecutor

    d: Daemon = world["daemon"]
    tasks = [{"prompt": f"greet {i}", "expect": "greetings in French"} for i in range(5)]
    with d.http() as c:
        scenario(c, "prop-wait", model="hang", settings={"gate": "compare", "tasks": tasks})
        token = c.post("/reef/tokens", json={"scenario": "prop-wait", "ttl_s": 600}).json()["token"]
    with ThreadPoolExecutor(1) as pool, d.http() as c:
        sent = pool.submit(propose, c, "prop-wait", op="add", kind="rule", text=FRENCH, reason="asked in French")
        conn, _ = world["hang"].accept()  # the gate asks the model: the proposal is being judged now
        try:
            with d.http() as c2:
                [p] = proposals(c2, "prop-wait")["proposals"]
                assert p["verdict"] == "pending" and p["reason"] == "asked in French" and p["op"] == "add", p
                assert p["decided_at"] is None
        finally:  # the model's connections end (and the listener, so none waits in its queue)
            conn.close()
            world["hang"].close()
        done = sent.result()
        assert done.status_code == 201 and done.json()["verdict"] == "failed", done.text
        [p2] = proposals(c, "prop-wait")["proposals"]
        assert p2["id"] == p["id"] == done.json()["proposal"] and p2["verdict"] == "failed", p2
        assert p2["why"].startswith("the proposal could not be evaluated")
    with httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as scoped:
        r = scoped.get("/reef/scenarios/prop-wait/proposals")
        assert "not allowed with a token scoped to scenario 'prop-wait'" in assert_canonical_error(r, 403)["message"]


def test_the_wrapper_command_says_the_verdict_and_fails_on_a_refusal(world: dict[str, Any]) -> None:
    """`reef-pi propose` (run by a user, or by an agent's shell tool): one change per call, the verdict printed, a
    nonzero exit when the proposal is not admitted, so an agent sees it failed. Bugs caught: two changes sent as
    one, a screened-out proposal that exits 0."""
    d: Daemon = world["daemon"]
    with d.http() as c:
        scenario(c, "prop-cli")
    env = {**world["env"], "REEF_SCENARIO": "prop-cli"}

    def reef_pi(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BIN / "reef-pi"), "propose", *args], env=env, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)

    ok = reef_pi("--add-rule", "Keep functions short.", "--reason", "reviews asked for it")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "add rule on scenario prop-cli" in ok.stdout and "released step 1" in ok.stdout, ok.stdout
    bad = reef_pi("--add-rule", "Export AKIAABCDEFGHIJKLMNOP first.", "--reason", "deploys")
    assert bad.returncode == 2 and "screened out by the secrets screen" in bad.stdout, bad.stdout + bad.stderr
    gone = reef_pi("--retire-rule", "no-such-rule", "--reason", "r")
    assert gone.returncode == 4 and "no rule 'no-such-rule'" in gone.stderr, gone.stdout + gone.stderr
    two = reef_pi("--add-rule", "a", "--retire-skill", "b", "--reason", "r")
    assert two.returncode != 0 and "exactly one of" in two.stderr, two.stdout + two.stderr
    with d.http() as c:
        assert len(chain(c, "prop-cli")["releases"]) == 2 and len(chain(c, "prop-cli")["rejected"]) == 1


def test_adding_what_the_harness_has_is_a_409_with_nothing_written(world: dict[str, Any]) -> None:
    """An add of a rule the serving harness holds (by the id its text gives, or named by its id) or of a skill it
    has is refused at the door: a 409 that says to replace it, no rejection on the chain, the head unmoved. Bugs
    caught: the check dropped (the screens then refuse it, and a rejection is written for a request that was
    never judged)."""
    d: Daemon = world["daemon"]
    with d.http() as c:
        scenario(c, "prop-dup")
        rule = propose(c, "prop-dup", op="add", kind="rule", text="Run the tests before you commit.", reason="r")
        assert rule.status_code == 201 and rule.json()["verdict"] == "accepted", rule.text
        skill = propose(c, "prop-dup", op="add", kind="skill", name="notes", text="How to write notes.", reason="r")
        assert skill.status_code == 201 and skill.json()["verdict"] == "accepted", skill.text
        before = chain(c, "prop-dup")
        rule_id = c.get(f"/reef/scenarios/prop-dup/releases/{rule.json()['release_id']}").json()["origin"]["target"]
        for again in ({"kind": "rule", "text": "Run the tests  before you commit."},  # the same rule, spaced apart
                      {"kind": "rule", "name": rule_id.split(" ", 1)[1], "text": "Run every test."},
                      {"kind": "skill", "name": "notes", "text": "Other notes."}):
            err = assert_canonical_error(propose(c, "prop-dup", op="add", reason="again", **again), 409)
            assert "in the harness already" in err["message"] and "replace" in err["message"], (again, err)
        after = chain(c, "prop-dup")
        assert after["head"] == before["head"] and after["rejected"] == before["rejected"] == []
        assert len(after["releases"]) == len(before["releases"]) and after["pending"] == []
        assert [p["id"] for p in proposals(c, "prop-dup")["proposals"]] == [skill.json()["proposal"],
                                                                            rule.json()["proposal"]]


# --- parse and listing, without a daemon --------------------------------------------------------------------------


def test_a_reason_of_exactly_the_limit_is_accepted_and_one_more_refused() -> None:
    from daemon.errors import BadRequest
    from daemon.proposals import MAX_REASON, parse

    body = {"op": "add", "kind": "rule", "text": "Be brief."}
    assert MAX_REASON == 500
    assert parse({**body, "reason": "r" * 500}).reason == "r" * 500
    with pytest.raises(BadRequest, match="reason is 501 characters; the limit is 500") as e:
        parse({**body, "reason": "r" * 501})
    assert e.value.param == "reason"


@pytest.mark.parametrize("op", ["add", "replace", "retire"])
@pytest.mark.parametrize("name", ["../x", "x/../../y", "/etc", ".hidden", "a/b"])
def test_a_skill_name_that_is_a_path_is_a_400_at_parse(op: str, name: str) -> None:
    """Refused where the body is read, with nothing looked up (the screens would refuse a path out of the layout
    later, but by then a rejection is written for a request that was malformed)."""
    from daemon.errors import BadRequest
    from daemon.proposals import parse

    body = {"op": op, "kind": "skill", "name": name, "reason": "r", **({} if op == "retire" else {"text": "t"})}
    with pytest.raises(BadRequest, match="is not a-z, 0-9 and -") as e:
        parse(body)
    assert e.value.param == "name"
    assert parse({**body, "name": "notes-2"}).name == "notes-2"  # the same body with a name is fine


def test_a_decided_proposal_also_read_as_pending_is_listed_once_as_decided() -> None:
    """The listing reads the chain and then the learner's undecided proposals; a proposal decided between the two
    reads is in both. It is listed once, with its verdict (admitted, held, rejected, failed alike)."""
    from types import SimpleNamespace

    from daemon.proposals import Proposal, listing

    p = Proposal("add", "rule", None, "Be brief.", "asked twice", "run_1", "prop_01", 5.0)
    origin = {"kind": "proposal", "id": p.id, "at": p.at, "op": "add", "target": "rule be-brief",
              "reason": p.reason, "run": p.run, "receipt": "rec_1"}
    rel = SimpleNamespace(operation="train", origin=origin, created_at=9.0, release_id="rel_a", step=1, metrics={})
    rej = SimpleNamespace(origin=origin, created_at=9.0, verdict="failed", reason="could not be evaluated",
                          metrics={}, candidate=None)
    held = SimpleNamespace(origin=origin, created_at=9.0, release_id="rel_h", step=2, metrics={})
    pending = [(p, "rec_1")]
    for releases, holds, rejections, verdict in (([rel], [], [], "admitted"), ([], [held], [], "held"),
                                                 ([], [], [rej], "failed")):
        [entry] = listing(releases, holds, rejections, pending)
        assert (entry["id"], entry["verdict"], entry["decided_at"]) == (p.id, verdict, 9.0), entry
    other = Proposal("add", "rule", None, "Be kind.", "r", None, "prop_02", 6.0)
    both = listing([rel], [], [], [*pending, (other, None)])
    assert [(e["id"], e["verdict"]) for e in both] == [("prop_02", "pending"), ("prop_01", "admitted")]


def _body(**over: Any) -> dict[str, Any]:
    return {"op": "add", "kind": "rule", "text": "Be brief.", "reason": "r", **over}


@pytest.mark.parametrize(("body", "param", "words"), [
    (_body(extra=1, zzz=2), "extra", "unknown keys extra, zzz (known: kind, name, op, reason, run, text)"),
    (_body(op="create"), "op", "op must be one of add, replace, retire, not 'create'"),
    (_body(op=["add"]), "op", "op must be one of"),
    (_body(op=None), "op", "op must be one of"),
    (_body(kind="command"), "kind", "kind must be one of rule, skill, not 'command'"),
    (_body(kind=["rule"]), "kind", "kind must be one of"),
    (_body(reason="  \n"), "reason", "reason is required"),
    (_body(reason=3), "reason", "reason is required"),
    (_body(name="  "), "name", "name must be text"),
    (_body(name=7), "name", "name must be text"),
    (_body(text=["x"]), "text", "text must be text"),
    (_body(op="retire", name="be-brief"), "text", "retire takes no text"),
    (_body(op="replace", name="be-brief", text=None), "text", "replace rule needs text: the rule"),
    (_body(op="add", kind="skill", name="notes", text=" \n"), "text", "add skill needs text: the SKILL.md of the skill"),
    (_body(op="replace", text="Be kind."), "name", "replace rule needs a name: the rule id (or its exact text) to replace"),
    (_body(op="add", kind="skill"), "name", "add skill needs a name: the skill to add"),
    (_body(run="../x"), "run", "invalid run name"),
])
def test_a_malformed_proposal_is_a_400_naming_the_field(body: dict[str, Any], param: str, words: str) -> None:
    """Each check of ``parse``, with the field it names. Bugs caught: a check dropped or inverted (an op, name or
    text of the wrong type taken, a blank reason or name taken, text with a retire, an add or replace
    without text, a replace or a skill without a name, an unchecked run), or the wrong field named."""
    from daemon.errors import BadRequest
    from daemon.proposals import parse

    with pytest.raises(BadRequest) as e:
        parse(body)
    assert words in e.value.message and e.value.data.get("param") == param, (e.value.message, e.value.data)


def test_a_proposal_of_exactly_the_size_limit_is_taken_and_one_byte_more_is_a_413() -> None:
    """The size is the text's and the name's UTF-8 bytes together. Bugs caught: ``>=`` for ``>``, the name or the
    text left out of the size, characters counted for bytes."""
    from daemon.errors import PayloadTooLarge
    from daemon.proposals import MAX_BYTES, parse

    assert MAX_BYTES == 64 * 1024
    name = "note"
    text = "é" * ((MAX_BYTES - len(name)) // 2)  # two bytes each: the name and the text are the limit exactly
    assert parse(_body(kind="skill", name=name, text=text)).text == text
    with pytest.raises(PayloadTooLarge, match=f"the proposal is {MAX_BYTES + 1} bytes; the limit is {MAX_BYTES}"):
        parse(_body(kind="skill", name=name + "s", text=text))
    with pytest.raises(PayloadTooLarge):
        parse(_body(kind="skill", name=name, text=text + "x"))


def test_a_parsed_proposal_keeps_its_fields_trimmed_with_a_fresh_id_and_time() -> None:
    """Bugs caught: the name or the reason not stripped, a retire or a nameless add given a name, the run or the
    time lost, an id without its ``prop_`` prefix."""
    import time

    from daemon.proposals import parse

    before = time.time()
    p = parse({"op": "replace", "kind": "rule", "name": "  be-brief ", "text": "Be brief!", "reason": " why \n",
               "run": "run-1"})
    assert (p.op, p.kind, p.name, p.text, p.reason, p.run) == ("replace", "rule", "be-brief", "Be brief!", "why",
                                                               "run-1")
    assert p.id.startswith("prop_") and before <= p.at <= time.time()
    new = parse(_body())
    assert new.name is None and new.run is None and new.id != p.id
    retire = parse({"op": "retire", "kind": "skill", "name": "notes", "reason": "r"})
    assert (retire.name, retire.text) == ("notes", None)


def test_an_archived_or_paused_scenario_refuses_a_proposal_naming_why() -> None:
    """Bugs caught: either check dropped or inverted (an open scenario refused), the wrong reason given."""
    from types import SimpleNamespace

    from daemon.errors import Conflict
    from daemon.proposals import check_open

    check_open(SimpleNamespace(name="s", archived=False, paused=False))
    for archived, paused, why in ((True, False, "archived"), (True, True, "archived"), (False, True, "paused")):
        with pytest.raises(Conflict) as e:
            check_open(SimpleNamespace(name="s", archived=archived, paused=paused))
        assert e.value.data["why"] == why and f"reef scenarios {'unarchive' if why == 'archived' else 'resume'} s" \
            in e.value.message, e.value.message


def test_a_proposal_is_screened_with_the_recipes_own_caps_one_change_at_a_time() -> None:
    """Harness search's ``limits()`` with one mutation; lessons' rule and file caps from its settings; the
    mutations' defaults for a recipe with neither. Bugs caught: the recipe's limits ignored, more than one change
    allowed, lessons' caps not read (or read into the wrong field)."""
    from types import SimpleNamespace

    from daemon.proposals import limits_of
    from recipes.harness_search.mutations import Limits

    own = Limits(max_mutations=5, max_file_bytes=10, max_tree_bytes=20, max_rule_chars=30, allow_executable=True)
    assert limits_of(SimpleNamespace(limits=lambda: own, settings=None)) == Limits(
        max_mutations=1, max_file_bytes=10, max_tree_bytes=20, max_rule_chars=30, allow_executable=True)
    lessons = SimpleNamespace(settings=SimpleNamespace(max_chars=123, max_rules_bytes=4567))
    assert limits_of(lessons) == Limits(max_mutations=1, max_rule_chars=123, max_file_bytes=4567)
    assert limits_of(SimpleNamespace(settings=SimpleNamespace())) == Limits(max_mutations=1)
    assert limits_of(SimpleNamespace(limits=lambda: None, settings=SimpleNamespace())) == Limits(max_mutations=1)


_TREE = {"AGENTS.md": b"# Rules\n\n## Lessons\n\n- [be-brief] Be brief.\n- Run the tests first.\n",
         "skills/notes/SKILL.md": b"---\nname: notes\ndescription: d\n---\nNotes.\n"}


def _p(op: str, kind: str, name: str | None, text: str | None = None) -> Any:
    from daemon.proposals import Proposal

    return Proposal(op, kind, name, text, "because", "run-1", "prop_1", 1.0)


def test_a_proposal_becomes_the_mutation_of_the_rule_or_skill_it_names() -> None:
    """A rule named by its id or by its exact text (whitespace aside), a new rule's id from its text or its own
    name, a skill's text made a SKILL.md unless it brings its own frontmatter, a retire with no text. Bugs caught:
    the op words not mapped, the text not collapsed, a rule's text not resolved to its id, a named new rule given
    the text's id, a skill's text not wrapped (or one with frontmatter wrapped again), text kept on a retire."""
    from daemon.proposals import mutation
    from recipes.harness_search.mutations import rule_id
    from recipes.lessons import render_skill

    add = mutation(_TREE, _p("add", "rule", None, " Keep  diffs\n small. "))
    assert (add.op, add.kind, add.id, add.text, add.files, add.reason) == (
        "create", "rule", rule_id("Keep diffs small."), "Keep diffs small.", None, "because")
    named = mutation(_TREE, _p("add", "rule", "small-diffs", "Keep diffs small."))
    assert (named.op, named.id) == ("create", "small-diffs")
    by_id = mutation(_TREE, _p("replace", "rule", "be-brief", "Be  very brief."))
    assert (by_id.op, by_id.id, by_id.text) == ("update", "be-brief", "Be very brief.")
    by_text = mutation(_TREE, _p("retire", "rule", "Run the  tests\tfirst."))
    assert (by_text.op, by_text.id, by_text.text, by_text.files) == (
        "remove", rule_id("Run the tests first."), None, None)
    skill = mutation(_TREE, _p("add", "skill", "review", "How to review.\nRead it all."))
    assert (skill.op, skill.kind, skill.id, skill.text) == ("create", "skill", "review", None)
    assert skill.files == {"SKILL.md": render_skill("review", "How to review.\nRead it all.")}
    own = "\n---\nname: review\ndescription: own\n---\nx"
    assert mutation(_TREE, _p("add", "skill", "review", own)).files == {"SKILL.md": own}
    gone = mutation(_TREE, _p("retire", "skill", "notes"))
    assert (gone.op, gone.id, gone.files, gone.text) == ("remove", "notes", None, None)
    assert mutation(_TREE, _p("replace", "skill", "notes", "New notes.")).op == "update"


def test_a_proposal_of_what_is_there_or_is_not_is_refused_before_any_screen() -> None:
    """An add of a rule the harness has (by its id or its text's) or a skill it has is a 409; a replace or retire of
    what it lacks a 404 naming what it has (the first 20 rule ids and how many more); a new rule named what no id
    may be a 400. Bugs caught: either check dropped or inverted, the list of what there is wrong or cut at another
    count, the name check dropped for a new rule."""
    from daemon.errors import BadRequest, Conflict, NotFound
    from daemon.proposals import mutation
    from recipes.harness_search.mutations import rule_id

    for p in (_p("add", "rule", None, "Run the tests  first."), _p("add", "rule", "be-brief", "Other."),
              _p("add", "skill", "notes", "More notes.")):
        with pytest.raises(Conflict, match="is in the harness already; propose a replace of it instead"):
            mutation(_TREE, p)
    with pytest.raises(NotFound) as e:
        mutation(_TREE, _p("replace", "rule", "be-kind", "Be kind."))
    assert e.value.message == (f"there is no rule 'be-kind' in the serving harness to replace (its rules: be-brief, "
                               f"{rule_id('Run the tests first.')})")
    with pytest.raises(NotFound, match=r"no skill 'other' in the serving harness to retire \(its skills: notes\)"):
        mutation(_TREE, _p("retire", "skill", "other"))
    with pytest.raises(NotFound, match=r"\(its skills: none\)"):
        mutation({}, _p("replace", "skill", "other", "x"))
    with pytest.raises(NotFound, match=r"\(its rules: none\)"):
        mutation({}, _p("retire", "rule", "be-brief"))
    first = ", ".join(f"r{i:02}" for i in range(20))
    for count, shown in ((20, first), (21, f"{first} and 1 more"), (41, f"{first} and 21 more")):
        tree = {"AGENTS.md": ("## Lessons\n\n" + "".join(f"- [r{i:02}] Rule {i}.\n" for i in range(count))).encode()}
        with pytest.raises(NotFound) as e:
            mutation(tree, _p("retire", "rule", "r99"))
        assert e.value.message.endswith(f"(its rules: {shown})"), (count, e.value.message)
    with pytest.raises(BadRequest, match="a new rule's name 'Be Brief' is not a-z"):
        mutation(_TREE, _p("add", "rule", "Be Brief", "Be brief now."))
    assert mutation(_TREE, _p("replace", "rule", "Be brief.", "Be briefer.")).id == "be-brief"  # its text: no id check


def test_a_proposals_candidate_is_the_tree_with_its_change_screened_and_named() -> None:
    """Bugs caught: a screen's refusal not raised as ``Screened`` naming the screen (or ``form`` for one without),
    a retired skill not marked ``retire`` (or a retired rule marked so), the scripts and the review findings not
    passed on, a summary or metrics missing."""
    from daemon.proposals import Screened, candidate, mutation
    from recipes.harness_search.mutations import Limits

    limits = Limits(max_mutations=1)
    c = candidate(_TREE, mutation(_TREE, _p("replace", "rule", "be-brief", "Be very brief.")), limits)
    assert b"- [be-brief] Be very brief." in c.tree["AGENTS.md"] and c.metrics == {"proposal": 1}
    assert c.details["origin"] == "proposal" and c.details["summary"] == "agent proposal: update rule be-brief"
    assert "executable" not in c.details and "review" not in c.details
    assert [m["op"] for m in c.details["mutations"]] == ["update"]
    gone = candidate(_TREE, mutation(_TREE, _p("retire", "skill", "notes")), limits)
    assert gone.details["origin"] == "retire" and "skills/notes/SKILL.md" not in gone.tree
    assert candidate(_TREE, mutation(_TREE, _p("retire", "rule", "be-brief")), limits).details["origin"] == "proposal"
    tools = "---\nname: t\ndescription: d\nallowed-tools: Bash\n---\n#!/bin/sh\necho"
    held = candidate(_TREE, mutation(_TREE, _p("add", "skill", "t", tools)), Limits(max_mutations=1,
                                                                                    allow_executable=True))
    assert held.details["executable"] == ["skills/t/SKILL.md"] and len(held.details["review"]) == 2, held.details
    assert held.details["origin"] == "proposal"  # an added skill is no retire, nor is a replaced one:
    assert candidate(_TREE, mutation(_TREE, _p("replace", "skill", "notes", "New.")), limits).details["origin"] == \
        "proposal"
    with pytest.raises(Screened) as e:
        candidate(_TREE, mutation(_TREE, _p("add", "skill", "t", tools)), limits)
    assert e.value.screen == "executable" and "allow_executable" in e.value.reason
    with pytest.raises(Screened) as e:
        candidate(_TREE, mutation(_TREE, _p("add", "rule", None, "x" * 700)), limits)
    assert e.value.screen in ("size", "form"), e.value.screen


def test_an_outcomes_origin_names_the_proposal_its_target_and_at_most_2000_characters_of_text() -> None:
    """Bugs caught: the target not the mutation's id (or not the name when there is none), the text uncut or cut
    elsewhere, a ``text`` key for a retire."""
    from daemon.proposals import mutation, origin

    p = _p("add", "rule", None, "y" * 2500)
    m = mutation(_TREE, p)
    o = origin(p, m, "rec_1")
    assert o == {"kind": "proposal", "id": "prop_1", "at": 1.0, "op": "add", "target": f"rule {m.id}",
                 "reason": "because", "run": "run-1", "receipt": "rec_1", "text": "y" * 2000}
    retire = origin(_p("retire", "skill", "gone"), None, None)
    assert retire["target"] == "skill gone" and "text" not in retire and retire["receipt"] is None


def test_each_verdict_is_listed_from_where_it_is_written_and_only_proposals_are() -> None:
    """Admitted from a train or promote release (reviewed only for a promote; a rollback republishing a proposal's
    content is no verdict), held from a held candidate, screened, rejected, unchanged or as written from the
    rejection log, pending from the learner; newest id first; a release whose origin is no proposal (another kind,
    none, no id) is not listed. Bugs caught: another origin kind (or none) taken for a proposal, a verdict word
    mapped wrongly, a screen or a candidate dropped from the entry, a rollback listed, ``reviewed`` said of a
    train, ``at`` lost where the origin has none, the order reversed."""
    from types import SimpleNamespace

    from daemon.proposals import Proposal, listing

    def o(i: str, **more: Any) -> dict[str, Any]:
        return {"kind": "proposal", "id": i, "at": 1.0, "op": "add", "target": "rule x", "reason": "r", "run": None,
                "receipt": None, **more}

    def rel(op: str, origin: Any, rid: str) -> Any:
        return SimpleNamespace(operation=op, origin=origin, created_at=2.0, release_id=rid, step=3, metrics={"m": 1})

    def rej(verdict: str, origin: Any, metrics: Any = None, candidate: str | None = None) -> Any:
        return SimpleNamespace(origin=origin, created_at=4.0, verdict=verdict, reason="why", metrics=metrics,
                               candidate=candidate)

    releases = [rel("rollback", o("prop_09"), "rel_back"), rel("train", o("prop_01"), "rel_1"),
                rel("promote", o("prop_02"), "rel_2"), rel("train", {"kind": "feedback", "id": "x"}, "rel_f"),
                rel("train", {"kind": "search", "id": "y"}, "rel_s"), rel("train", {"id": "z"}, "rel_k"),
                rel("train", {"kind": "proposal", "id": ""}, "rel_e"), rel("train", None, "rel_n"),
                rel("init", o("prop_10"), "rel_i")]
    rejections = [rej("rejected", o("prop_03"), {"screen": "secrets"}), rej("rejected", o("prop_04"), {"g": 1}),
                  rej("skipped", o("prop_05")), rej("failed", o("prop_06"), None, "rel_c"),
                  rej("canary-rolled-back", o("prop_07"))]
    held = [rel("train", o("prop_08", at=None), "rel_h")]
    pending = [(Proposal("add", "rule", None, "t", "r", "run-9", "prop_11", 5.0), "rec_9")]
    out = listing(releases, held, rejections, pending)
    assert [e["id"] for e in out] == ["prop_11", "prop_08", "prop_07", "prop_06", "prop_05", "prop_04", "prop_03",
                                      "prop_02", "prop_01"]
    by = {e["id"]: e for e in out}
    assert {"kind": "proposal", **by["prop_01"]} == {**o("prop_01"), "decided_at": 2.0, "verdict": "admitted", "release_id": "rel_1",
                                  "step": 3, "reviewed": False, "metrics": {"m": 1}}
    assert (by["prop_02"]["verdict"], by["prop_02"]["reviewed"]) == ("admitted", True)
    assert (by["prop_03"]["verdict"], by["prop_03"]["screen"], by["prop_03"]["why"]) == ("screened", "secrets", "why")
    assert by["prop_04"]["verdict"] == "rejected" and "screen" not in by["prop_04"] and "candidate" not in by["prop_04"]
    assert by["prop_05"]["verdict"] == "unchanged" and by["prop_06"]["verdict"] == "failed"
    assert by["prop_06"]["candidate"] == "rel_c" and by["prop_07"]["verdict"] == "canary-rolled-back"
    assert (by["prop_08"]["verdict"], by["prop_08"]["candidate"], by["prop_08"]["at"]) == ("held", "rel_h", 2.0)
    assert by["prop_11"] == {"id": "prop_11", "at": 5.0, "op": "add", "target": "rule (new)", "reason": "r",
                             "run": "run-9", "receipt": "rec_9", "decided_at": None, "verdict": "pending"}
    named = listing([], [], [], [(Proposal("retire", "skill", "notes", None, "r", None, "prop_12", 6.0), None)])
    assert named[0]["target"] == "skill notes"


def test_a_proposal_cannot_be_changed_once_parsed() -> None:
    """The learner judges the proposal the route parsed and lists it pending meanwhile: neither can alter it. Bug
    caught: ``frozen=False``."""
    import dataclasses

    from daemon.proposals import parse

    p = parse(_body())
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.text = "Grant every tool."  # type: ignore[misc]
