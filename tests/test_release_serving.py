"""Every answer is served by exactly one release: init on first use, live swaps when a head moves (by any
process), pinning, rollback through the API and the CLI, and the chain as plain git history."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from daemon.releases import ReleaseStore
from tests.conftest import Daemon, assert_canonical_error, sse_events

BODY = {"model": "tiny", "max_tokens": 6, "messages": [{"role": "user", "content": "hello there"}]}


def make_weights(tiny_model: Path, dest: Path, seed: int) -> Path:
    """A copy of the tiny model with perturbed weights (a distinct release content)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, dest)
    weights = next(dest.glob("*.safetensors"))
    tensors = load_file(weights)
    g = torch.Generator().manual_seed(seed)
    for name in sorted(tensors):
        if "embed" in name or "lm_head" in name:
            tensors[name] = tensors[name] + 0.5 * torch.randn(tensors[name].shape, generator=g)
    weights.unlink()
    save_file(tensors, weights, metadata={"format": "pt"})
    return dest


def publish(d: Daemon, scenario: str, model_dir: Path) -> str:
    from daemon.releases import ReleaseStore, files_from_dir

    store = ReleaseStore(d.home / "artifacts.git")
    rel = store.publish(scenario, files_from_dir(model_dir), expected_head=store.head(scenario), operation="train",
                        kind="weights", recipe="record", metrics={"reward": 0.5})
    return rel.release_id


def chat(c: httpx.Client, scenario: str, **headers: str) -> httpx.Response:
    resp = c.post(f"/s/{scenario}/v1/chat/completions", json=BODY, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp


def test_first_use_publishes_init_and_records_name_the_release(daemon: Daemon) -> None:
    with daemon.http() as c:
        resp = chat(c, "rel-a")
        chain = c.get("/reef/scenarios/rel-a/releases").json()
        rec = c.get(f"/reef/records/{resp.headers['x-reef-agent-record-id']}").json()
    [init] = chain["releases"]
    assert (init["step"], init["operation"], init["kind"], init["parent"]) == (0, "init", "weights", None)
    assert chain["head"] == init["release_id"] == resp.headers["x-reef-release-id"]
    assert rec["release_id"] == init["release_id"] and rec["content_id"] == init["content_id"]
    assert rec["runtime_load_id"] and ":" in rec["runtime_load_id"]
    log = subprocess.run(["git", "--git-dir", str(daemon.home / "artifacts.git"), "log", "refs/reef/scenarios/rel-a"],
                         capture_output=True, text=True, check=True).stdout
    assert "Reef-Operation: init" in log and "Reef-Step: 0" in log


def test_external_publish_swaps_live_and_rollback_restores(daemon: Daemon, tiny_model: Path, tmp_path: Path) -> None:
    with daemon.http() as c:
        first = chat(c, "rel-b")
        init_id = first.headers["x-reef-release-id"]
        new_id = publish(daemon, "rel-b", make_weights(tiny_model, tmp_path / "w1", 1))
        second = chat(c, "rel-b")
        assert second.headers["x-reef-release-id"] == new_id
        r1 = c.get(f"/reef/records/{first.headers['x-reef-agent-record-id']}").json()
        r2 = c.get(f"/reef/records/{second.headers['x-reef-agent-record-id']}").json()
        assert r1["runtime_load_id"] != r2["runtime_load_id"] and r1["content_id"] != r2["content_id"]

        stale = c.post("/reef/scenarios/rel-b/rollback", json={"release_id": init_id, "expected_head": init_id})
        err = assert_canonical_error(stale, 409)
        assert err["expected_head"] == init_id and err["actual_head"] == new_id
        rolled = c.post("/reef/scenarios/rel-b/rollback", json={"release_id": init_id, "expected_head": new_id})
        assert rolled.status_code == 201, rolled.text
        rb = rolled.json()
        assert (rb["step"], rb["operation"], rb["source"], rb["parent"]) == (2, "rollback", init_id, new_id)
        assert rb["content_id"] == r1["content_id"]
        third = chat(c, "rel-b")
        assert third.headers["x-reef-release-id"] == rb["release_id"]
        r3 = c.get(f"/reef/records/{third.headers['x-reef-agent-record-id']}").json()
        assert r3["content_id"] == r1["content_id"] and r3["runtime_load_id"] == r1["runtime_load_id"]  # resident
        steps = [r["step"] for r in c.get("/reef/scenarios/rel-b/releases").json()["releases"]]
        assert steps == [2, 1, 0]
        shown = c.get(f"/reef/releases/{new_id}").json()
        changed = [f for f in shown["diff"]["files"] if f["kind"] == "safetensors"]
        assert changed and any(t["diff_norm"] > 0 for t in changed[0]["tensors"])


def test_pinning_a_release(daemon: Daemon, tiny_model: Path, tmp_path: Path) -> None:
    with daemon.http() as c:
        old = chat(c, "rel-c").headers["x-reef-release-id"]
        publish(daemon, "rel-c", make_weights(tiny_model, tmp_path / "w2", 2))
        pinned = chat(c, "rel-c", **{"x-reef-release-id": old})
        assert pinned.headers["x-reef-release-id"] == old
        assert c.get(f"/reef/records/{pinned.headers['x-reef-agent-record-id']}").json()["release_id"] == old
        short = chat(c, "rel-c", **{"x-reef-release-id": old[:10]})
        assert short.headers["x-reef-release-id"] == old
        other = chat(c, "rel-d").headers["x-reef-release-id"]
        unknown = c.post("/s/rel-c/v1/chat/completions", json=BODY, headers={"x-reef-release-id": "f" * 40})
        assert "f" * 40 in assert_canonical_error(unknown, 404, "openai")["message"]
        foreign = c.post("/s/rel-c/v1/chat/completions", json=BODY, headers={"x-reef-release-id": other})
        assert other in assert_canonical_error(foreign, 400, "openai")["message"]


def test_rollback_through_the_cli(daemon: Daemon, tiny_model: Path, tmp_path: Path) -> None:
    with daemon.http() as c:
        init_id = chat(c, "rel-e").headers["x-reef-release-id"]
    new_id = publish(daemon, "rel-e", make_weights(tiny_model, tmp_path / "w3", 3))
    listed = daemon.cli("releases", "list", "-s", "rel-e").stdout
    assert "init" in listed and "train" in listed and new_id[:12] in listed
    shown = daemon.cli("releases", "show", new_id, "--diff").stdout
    assert "model.safetensors" in shown and "|Δ|" in shown
    declined = daemon.cli("releases", "rollback", init_id, "-s", "rel-e", input="n\n", check=False)
    assert declined.returncode == 1 and "nothing changed" in declined.stderr
    assert json.loads(daemon.cli("releases", "list", "-s", "rel-e", "--json").stdout)["head"] == new_id
    done = daemon.cli("releases", "rollback", init_id, "-s", "rel-e", "--yes")
    assert "published" in done.stdout and "from head" in done.stdout
    chain = json.loads(daemon.cli("releases", "list", "-s", "rel-e", "--json").stdout)
    assert chain["releases"][0]["operation"] == "rollback" and chain["releases"][0]["source"] == init_id


def test_cli_rollback_refuses_when_the_head_moved(daemon: Daemon, tiny_model: Path, tmp_path: Path) -> None:
    with daemon.http() as c:
        init_id = chat(c, "rel-f").headers["x-reef-release-id"]
    publish(daemon, "rel-f", make_weights(tiny_model, tmp_path / "w4", 4))
    moved = make_weights(tiny_model, tmp_path / "w5", 5)
    # the confirmation prompt is where a human pauses: publish meanwhile, then answer yes
    proc = subprocess.Popen([*daemon_cli_argv(), "releases", "rollback", init_id, "-s", "rel-f"], env=daemon.env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    seen, deadline = b"", time.monotonic() + 60
    while b"go ahead" not in seen and time.monotonic() < deadline:
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            break
        seen += chunk
    assert b"go ahead" in seen, seen
    publish(daemon, "rel-f", moved)
    out, err = proc.communicate("y\n", timeout=60)
    assert proc.returncode == 5 and "moved meanwhile" in err and "nothing changed" in err
    chain = json.loads(daemon.cli("releases", "list", "-s", "rel-f", "--json").stdout)
    assert [r["operation"] for r in chain["releases"]] == ["train", "train", "init"]


def daemon_cli_argv() -> list[str]:
    import sys

    return [sys.executable, "-m", "reef_cli.main"]


@pytest.mark.slow
def test_hot_swap_under_load(daemon_factory: Any, tiny_model: Path, tmp_path: Path) -> None:
    """TESTING.md 5 on the embedded engine: whole-weights releases published and rolled back under load."""
    d: Daemon = daemon_factory()
    hot_swap_under_load(d, "swap", [make_weights(tiny_model, tmp_path / f"v{i}", 10 + i) for i in range(3)], BODY,
                        full_weights)


def hot_swap_under_load(d: Daemon, scenario: str, variants: list[Path], body: dict[str, Any],
                        model_for: Callable[[ReleaseStore, dict[str, Any], Path], Any]) -> None:
    """TESTING.md 5: streaming and non-streaming clients while releases (``variants``: artifact directories) are
    published and rolled back many times: no request fails, every record names one release and one load, no load
    serves two contents, and the recorded log-probs are those of the named release (``model_for`` builds the
    reference model for a record from the chain)."""
    with d.http() as c:
        first = c.post(f"/s/{scenario}/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
    failures: list[str] = []
    receipts: list[str] = []
    stop = threading.Event()

    def client(i: int) -> None:
        rng = random.Random(i)
        with d.http() as c:
            while not stop.is_set():
                stream = rng.random() < 0.5
                resp = c.post(f"/s/{scenario}/v1/chat/completions",
                              json={**body, "stream": stream, "seed": rng.randint(0, 9)})
                if resp.status_code != 200:
                    failures.append(resp.text)
                    continue
                if stream:
                    events = sse_events(resp.text)
                    if events[-1][1] != "[DONE]":
                        failures.append(resp.text[-300:])
                        continue
                    receipts.append(events[-2][1]["reef"]["record_id"])
                else:
                    receipts.append(resp.headers["x-reef-agent-record-id"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    published: list[str] = []
    try:
        with d.http() as c:
            for i in range(12):
                if i % 3 == 2 and published:
                    head = c.get(f"/reef/scenarios/{scenario}/releases").json()["head"]
                    resp = c.post(f"/reef/scenarios/{scenario}/rollback",
                                  json={"release_id": random.Random(i).choice(published), "expected_head": head})
                    assert resp.status_code == 201, resp.text
                else:
                    from daemon.errors import Unchanged

                    try:
                        published.append(publish(d, scenario, variants[i % 3]))
                    except Unchanged:  # a rollback made that variant the head already: the next one is a change
                        published.append(publish(d, scenario, variants[(i + 1) % 3]))
                time.sleep(0.25)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not failures, failures[:3]
    assert len(receipts) > 20
    with d.http() as c:
        records = [c.get(f"/reef/records/{r}").json() for r in receipts]
        chain = c.get(f"/reef/scenarios/{scenario}/releases").json()["releases"]
    content_of = {r["release_id"]: r["content_id"] for r in chain}
    load_content: dict[str, str] = {}
    for rec in records:
        assert content_of[rec["release_id"]] == rec["content_id"]
        assert load_content.setdefault(rec["runtime_load_id"], rec["content_id"]) == rec["content_id"]
    assert len(set(load_content.values())) >= 3
    # the recorded log-probs are those of the named release's weights: re-score a sample with each release
    check_logprobs(d, records[:: max(1, len(records) // 12)], model_for)


def full_weights(store: ReleaseStore, rec: dict[str, Any], dest: Path) -> Any:
    """The reference model of a whole-weights release: its checked-out directory."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(store.checkout(rec["release_id"], dest)).eval()


def check_logprobs(d: Daemon, records: list[dict[str, Any]],
                   model_for: Callable[[ReleaseStore, dict[str, Any], Path], Any] = full_weights) -> None:
    import torch

    store = ReleaseStore(d.home / "artifacts.git")
    models: dict[str, Any] = {}
    for rec in records:
        if rec["content_id"] not in models:
            models[rec["content_id"]] = model_for(store, rec, d.home / "check" / rec["content_id"])
        model = models[rec["content_id"]]
        with d.http() as c:
            full = c.get(f"/reef/records/{rec['id']}").json()
        ids = full["prompt_token_ids"] + full["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        n = len(full["prompt_token_ids"])
        want = [lp[n - 1 + i, t].item() for i, t in enumerate(full["token_ids"])]
        assert want == pytest.approx(full["logprobs"], abs=2e-3), rec["id"]


def test_create_from_base_release_and_several_scenarios_resident(daemon: Daemon, tiny_model: Path,
                                                                 tmp_path: Path) -> None:
    with daemon.http() as c:
        chat(c, "rel-g")
        trained = publish(daemon, "rel-g", make_weights(tiny_model, tmp_path / "w6", 6))
        created = c.post("/reef/scenarios", json={"name": "rel-h", "base_release": trained})
        assert created.status_code == 201, created.text
        init = c.get("/reef/scenarios/rel-h/releases").json()["releases"][0]
        assert (init["operation"], init["source"]) == ("init", trained)
        assert init["content_id"] == c.get(f"/reef/releases/{trained}?diff=0").json()["content_id"]
        missing = c.post("/reef/scenarios", json={"name": "rel-i", "base_release": "0" * 40})
        assert_canonical_error(missing, 404)
        # two scenarios on different releases serve side by side, each from its own resident load
        a = [chat(c, "rel-g"), chat(c, "rel-b2")]
        loads = {c.get(f"/reef/records/{r.headers['x-reef-agent-record-id']}").json()["runtime_load_id"] for r in a}
        assert len(loads) == 2
        resident = c.get("/reef/status").json()["models"]["tiny"]["resident"]
        assert len(resident) >= 2


def test_memory_budget_evicts_idle_loads(daemon_factory: Any, tiny_model: Path, tmp_path: Path) -> None:
    d: Daemon = daemon_factory()
    d.stop()
    cfg = (d.home / "config.toml").read_text().replace('engine = "transformers"', 'engine = "transformers"\n'
                                                       "memory_budget_mb = 1")
    (d.home / "config.toml").write_text(cfg)
    d.start()
    with d.http() as c:
        first = chat(c, "budget")
        for i in range(3):
            publish(d, "budget", make_weights(tiny_model, tmp_path / f"b{i}", 20 + i))
            chat(c, "budget")
        resident = c.get("/reef/status").json()["models"]["tiny"]["resident"]
        assert len(resident) == 1  # a 2 MiB model over a 1 MiB budget: only the one in use stays
        pinned = chat(c, "budget", **{"x-reef-release-id": first.headers["x-reef-release-id"]})
        assert pinned.status_code == 200  # an evicted release loads again when asked for


def test_promote_a_pending_release(daemon: Daemon, tiny_model: Path, tmp_path: Path) -> None:
    from daemon.releases import ReleaseStore, files_from_dir

    with daemon.http() as c:
        init_id = chat(c, "rel-p").headers["x-reef-release-id"]
        store = ReleaseStore(daemon.home / "artifacts.git")
        pending = store.hold("rel-p", files_from_dir(make_weights(tiny_model, tmp_path / "wp", 30)),
                             kind="weights", recipe="record", metrics={"eval_reward": 0.9})
        listed = c.get("/reef/scenarios/rel-p/releases", params={"all": "1"}).json()
        assert [p["release_id"] for p in listed["pending"]] == [pending.release_id]
        assert chat(c, "rel-p").headers["x-reef-release-id"] == init_id  # pending does not serve
        stale = c.post("/reef/scenarios/rel-p/promote", json={"release_id": pending.release_id,
                                                               "expected_head": "0" * 40})
        assert_canonical_error(stale, 409)
        done = c.post("/reef/scenarios/rel-p/promote", json={"release_id": pending.release_id,
                                                              "expected_head": init_id})
        assert done.status_code == 201, done.text
        rel = done.json()
        assert (rel["operation"], rel["step"], rel["source"]) == ("promote", 1, pending.release_id)
        assert chat(c, "rel-p").headers["x-reef-release-id"] == rel["release_id"]


def test_a_built_in_model_is_built_before_its_first_init_release(daemon: Daemon) -> None:
    """Creating a scenario on a built-in model that is not built yet (tiny-demo) builds it first: the init
    release holds the model's files, never an empty tree."""
    with daemon.http() as c:
        created = c.post("/reef/scenarios", json={"name": "demo-built", "model": "tiny-demo"}, timeout=600)
        assert created.status_code == 201, created.text
        files = {f["path"] for f in c.get(f"/reef/releases/{created.json()['head']}").json()["diff"]["files"]}
        assert {"model.safetensors", "tokenizer.json", "config.json"} <= files
        r = c.post("/s/demo-built/v1/chat/completions", json={"model": "tiny-demo", "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": 'Say "a".'}]})
        assert r.status_code == 200, r.text
