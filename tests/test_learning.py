"""The learning loop through a real daemon: scored reports become a trained release with its lineage, the gate
writes down what it rejects, consumed receipts are never used twice, and a kill -9 (of the daemon or of the
trainer worker) loses nothing."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import httpx

from tests.conftest import Daemon, assert_canonical_error


def settings_toml(**kw: Any) -> str:
    base = {"batch_prompts": 2, "group_size": 2, "gate": "always"}
    base.update(kw)
    return "\n[recipes.online-rl]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in base.items())


def serve_and_report(c: httpx.Client, scenario: str, n: int, score: Any = lambda i: float(i % 2)) -> list[str]:
    receipts = []
    for i in range(n):
        r = c.post(f"/s/{scenario}/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": f'Say "w{i // 2}".'}]})
        assert r.status_code == 200, r.text
        receipts.append(r.headers["x-reef-agent-record-id"])
    for i, rec in enumerate(receipts):
        assert c.post("/reef/report", json={"score": score(i), "references": [rec]}).status_code == 201
    return receipts


def wait_for(fn: Any, timeout: float = 90, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def releases(c: httpx.Client, scenario: str, all_: bool = False) -> dict[str, Any]:
    return c.get(f"/reef/scenarios/{scenario}/releases", params={"all": "1"} if all_ else {}).json()


def test_reports_become_a_trained_release_with_lineage(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory(settings_toml())
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "learn", "recipe": "online-rl"}).status_code == 201
        receipts = serve_and_report(c, "learn", 4)
        chain = wait_for(lambda: (r := releases(c, "learn"))["releases"][0]["operation"] == "train" and r,
                         what="a train release")
        head = chain["releases"][0]
        assert head["step"] == 1 and sorted(head["receipts"]) == sorted(receipts)
        assert head["settings"]["batch_prompts"] == 2 and head["settings"]["gate"] == "always"
        assert head["metrics"]["samples"] == 4
        # the next answer comes from the trained release
        r = c.post("/s/learn/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "x"}]})
        assert r.headers["x-reef-release-id"] == head["release_id"]
        # a late report on a consumed receipt is stored and shown, never trained on again
        assert c.post("/reef/report", json={"score": 1, "references": [receipts[0]]}).status_code == 201
        assert len(c.get(f"/reef/records/{receipts[0]}").json()["reports"]) == 2
        time.sleep(2)
        assert len(releases(c, "learn", True)["releases"]) == 2 and not releases(c, "learn", True)["rejected"]


def test_gate_rejections_are_written_down_and_serving_is_untouched(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory(settings_toml(gate="floor", floor=2.0, eval_family="say", eval_n=4))
    with d.http() as c:
        c.post("/reef/scenarios", json={"name": "gated", "recipe": "online-rl"})
        serve_and_report(c, "gated", 4)
        chain = wait_for(lambda: (r := releases(c, "gated", True))["rejected"] and r, what="a rejection")
        assert [r["operation"] for r in chain["releases"]] == ["init"]
        rejection = chain["rejected"][0]
        assert "floor" in rejection["reason"] and rejection["step"] == 1 and len(rejection["receipts"]) == 4
    listed = d.cli("releases", "list", "-s", "gated", "--all").stdout
    assert "rejected" in listed and "floor" in listed


def test_scenario_settings_are_checked(daemon: Daemon) -> None:
    with daemon.http() as c:
        bad = c.post("/reef/scenarios", json={"name": "s-bad", "recipe": "online-rl", "settings": {"lr": "x", "nope": 1}})
        assert "nope" in assert_canonical_error(bad, 400)["message"]
        bad = c.post("/reef/scenarios", json={"name": "s-bad2", "recipe": "record", "settings": {"lr": 1}})
        assert_canonical_error(bad, 400)


def test_kill_9_during_training_loses_nothing(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory(settings_toml(steps_per_batch=1500))
    with d.http() as c:
        c.post("/reef/scenarios", json={"name": "crash", "recipe": "online-rl"})
        receipts = serve_and_report(c, "crash", 4)
        wait_for(lambda: c.get("/reef/status").json()["learning"].get("crash") == "training", what="training")
    d.kill9()
    d.start()
    with d.http() as c:
        assert [r["operation"] for r in releases(c, "crash")["releases"]] == ["init"]  # nothing half-published
        chain = wait_for(lambda: (r := releases(c, "crash"))["releases"][0]["operation"] == "train" and r,
                         timeout=180, what="training after the restart")
    consumed = [rec for r in chain["releases"] for rec in r["receipts"]]
    assert sorted(consumed) == sorted(receipts)  # each consumed exactly once


def test_a_dead_trainer_worker_is_restarted_and_the_batch_retried(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory(settings_toml(steps_per_batch=1500))
    with d.http() as c:
        c.post("/reef/scenarios", json={"name": "worker", "recipe": "online-rl"})
        receipts = serve_and_report(c, "worker", 4)
        status = wait_for(lambda: (s := c.get("/reef/status").json())["learning"].get("worker") == "training"
                          and s["trainer_pid"] and s, what="training")
        time.sleep(1)
        os.kill(status["trainer_pid"], signal.SIGKILL)
        chain = wait_for(lambda: (r := releases(c, "worker"))["releases"][0]["operation"] == "train" and r,
                         timeout=180, what="a release after the worker restart")
        assert sorted(chain["releases"][0]["receipts"]) == sorted(receipts)
        assert c.get("/reef/status").json()["trainer_pid"] != status["trainer_pid"]
