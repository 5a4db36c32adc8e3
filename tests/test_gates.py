"""The gates as the daemon wires them, through its HTTP API and the release chain (``daemon/gate.py``'s verdicts on
their own are in test_learning_core.py):

- ``regression`` judges a weights candidate against the serving head on the same tasks (paired), not against
  the best evaluation score published so far on the chain (a maximum of noisy means: ``daemon/gate.py``);
- the lessons recipe's ``compare`` gate puts the candidate harness on the candidate side: a harness whose answers
  contain the tasks' ``expect`` wins over one whose answers do not, and a worse candidate is rejected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.conftest import Daemon
from tests.test_learning import releases, settings_toml, wait_for
from tests.test_upstream import stub  # noqa: F401 - the scripted upstream: a model that follows its harness

# --- regression: the best so far ---------------------------------------------------------------------------------


def publish_scored(d: Daemon, scenario: str, weights: Path, eval_rewards: list[float]) -> list[str]:
    """Publish ``weights`` once per score, as trained releases whose manifests carry that evaluation score (what
    a trainer in another process would publish); their release ids, oldest first."""
    from daemon.releases import ReleaseStore, files_from_dir

    store = ReleaseStore(d.home / "artifacts.git")
    out = []
    for i, score in enumerate(eval_rewards):  # a note makes each release's content differ (no empty releases)
        files = {**files_from_dir(weights), "note.txt": f"published {i}\n".encode()}
        rel = store.publish(scenario, files, expected_head=store.head(scenario), operation="train",
                            kind="weights", recipe="online-rl", metrics={"eval_reward": score})
        out.append(rel.release_id)
    return out


def train_once(c: httpx.Client, scenario: str, release: str) -> None:
    """Four answers pinned to ``release`` (one batch of 2 prompts x 2), scored so each prompt's group has signal."""
    receipts = []
    for i in range(4):
        r = c.post(f"/s/{scenario}/v1/chat/completions", headers={"x-reef-release-id": release}, json={
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": f'Say "w{i // 2}".'}]})
        assert r.status_code == 200 and r.headers["x-reef-release-id"] == release, r.text
        receipts.append(r.headers["x-reef-agent-record-id"])
    for i, receipt in enumerate(receipts):
        assert c.post("/reef/report", json={"score": float(i % 2), "references": [receipt]}).status_code == 201


def test_regression_gate_compares_with_the_serving_head_not_the_best_so_far(daemon_factory: Any,
                                                                           tmp_path: Path) -> None:
    # the tiny model's random weights answer (next to) none of the evaluation tasks exactly: the candidate and
    # the head it is paired with both score about 0, far below the chain's best of 1.0; a drop of 0.5 is ruled
    # out on 8 paired tasks at 0.05 (at least 5 needed), so it is published. Judged against the best so far (the
    # rule of old) it was rejected.
    d: Daemon = daemon_factory(settings_toml(gate="regression", margin=0.5, eval_family="say", eval_n=8))
    from daemon.releases import ReleaseStore

    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "reg", "recipe": "online-rl"}).status_code == 201
        init = releases(c, "reg")["head"]
        weights = ReleaseStore(d.home / "artifacts.git").checkout(init, tmp_path / "weights")
        below = publish_scored(d, "reg", weights, [0.0, 1.0, 0.0])  # the best so far (1.0) is not the head

        train_once(c, "reg", below[-1])
        trained = wait_for(lambda: ((r := releases(c, "reg", True))["rejected"] or r["head"] != below[-1]) and r,
                           what="a gate verdict")
        assert not trained["rejected"], trained["rejected"]
        head = trained["releases"][0]
        assert head["parent"] == below[-1] and head["operation"] == "train" and head["step"] == 4
        m = head["metrics"]
        assert m["best"] == 1.0 and m["eval_reward"] < 0.5 and m["pairs"] == 8 and m["margin"] == 0.5, m
        assert m["alpha"] == 0.05 and m["p_value"] <= 0.05 and "diff_ci95" in m, m


# --- lessons compare: which side is the candidate ------------------------------------------------------------------

FOLLOWER = '\n[models.follower]\nengine = "upstream"\nurl = "{url}/v1"\nformat = "openai-chat"\nupstream_model = "m"\n'


def test_lessons_compare_gate_publishes_the_better_harness_and_rejects_a_worse_one(
        daemon_factory: Any, stub: str) -> None:  # noqa: F811
    # the scenario's model answers with its system prompt (the harness's rules), so a task's answer contains its
    # ``expect`` exactly when the harness under test says it
    d: Daemon = daemon_factory(FOLLOWER.format(url=stub))
    tasks = [{"prompt": "Which fruit do you like? [stub:echo_system]", "expect": "banana"}]
    with d.unix() as c:
        created = c.post("/reef/scenarios", json={"name": "cmp", "recipe": "lessons", "model": "follower",
                                                  # one task: only a stated error rate of 0.5 lets one pair decide
                                                  "settings": {"gate": "compare", "tasks": tasks, "alpha": 0.5,
                                                               "max_rules": 1}})
        assert created.status_code == 201, created.text
        init = created.json()["head"]

        # the candidate's rules make the answer contain "banana", the serving (empty) harness's do not: 1 win
        better = c.post("/reef/scenarios/cmp/evolve", json={"instruction": "always mention banana"}).json()
        assert better["verdict"] == "accepted", better
        assert better["release_id"] != init
        chain = releases(c, "cmp")
        assert chain["head"] == better["release_id"]
        assert "banana" in c.get("/reef/scenarios/cmp/harness").json()["files"]["AGENTS.md"]

        # the next candidate keeps one rule, the new one: its answer lost "banana", the serving one's has it
        worse = c.post("/reef/scenarios/cmp/evolve", json={"instruction": "always mention cherry"}).json()
        assert worse["verdict"] == "rejected", worse
        assert "wins 0 - losses 1" in worse["reason"], worse
        chain = releases(c, "cmp", True)
        assert chain["head"] == better["release_id"] and chain["rejected"][0]["reason"] == worse["reason"]
        files = c.get("/reef/scenarios/cmp/harness").json()["files"]
        assert "banana" in files["AGENTS.md"] and "cherry" not in files["AGENTS.md"]
