"""LoRA adapter releases through a real daemon: the chain stores the base once and each adapter release as the
adapter alone; requests pinned to two adapter releases and to the base decode at the same time, every record's
log-probs those of its own release (re-scored offline by peft from the chain's files); rollback to an adapter
and to the base; ``reef releases show --diff`` names the adapter tensors that changed; an adapter on another
base is refused at publish, and one whose manifest lies about its base is never served."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from daemon import lora
from daemon.errors import BadRequest, BaseMismatch
from daemon.lora import AdapterManifest
from daemon.releases import ReleaseStore, files_from_dir
from daemon.residency import PINS
from tests.conftest import Daemon, assert_canonical_error
from tests.test_hot_swap_weights import pinned_burst, rescored
from tests.test_lora_engine import make_adapter, peft_model
from tests.test_release_serving import BODY, chat, make_weights


def init(d: Daemon, scenario: str) -> dict[str, Any]:
    """The scenario's init release (its first request publishes it)."""
    with d.http() as c:
        chat(c, scenario)
        return c.get(f"/reef/scenarios/{scenario}/releases").json()["releases"][-1]


def publish_adapter(d: Daemon, scenario: str, dest: Path, seed: int, base: dict[str, Any], model: Path) -> str:
    """A random adapter on the scenario's base, published as a trainer would."""
    store = ReleaseStore(d.home / "artifacts.git")
    adapter = make_adapter(model, dest, seed, AdapterManifest(base["content_id"], base["release_id"]))
    rel = store.publish(scenario, files_from_dir(adapter), expected_head=store.head(scenario), operation="train",
                        kind="weights", recipe="record")
    return rel.release_id


def test_adapter_releases_are_stored_alone_and_decode_beside_the_base_with_their_own_weights(
        daemon_factory: Any, tiny_model: Path, tmp_path: Path) -> None:
    d: Daemon = daemon_factory()
    base = init(d, "lora")
    a = publish_adapter(d, "lora", tmp_path / "a", 1, base, tiny_model)
    b = publish_adapter(d, "lora", tmp_path / "b", 2, base, tiny_model)
    store = ReleaseStore(d.home / "artifacts.git")
    base_bytes = sum(f.size for f in store.files(base["release_id"]))
    for rel in (a, b):
        assert sorted(f.path for f in store.files(rel)) == sorted(lora.FILES)
        assert sum(f.size for f in store.files(rel)) < base_bytes / 10

    served = pinned_burst(d, "lora", [base["release_id"], a, b])
    with d.http() as c:
        records = {rid: c.get(f"/reef/records/{rid}").json() for _, rid in served}
    checkout = store.checkout(base["release_id"], tmp_path / "base")
    models = {base["release_id"]: peft_model(checkout, None),
              **{rel: peft_model(checkout, store.checkout(rel, tmp_path / f"check-{rel}")) for rel in (a, b)}}
    spans = {rid: (rec["created_at"] - rec["timings"]["total_ms"] / 1e3, rec["created_at"])
             for rid, rec in records.items()}
    by_rel = {rel: [spans[rid] for r, rid in served if r == rel] for rel in models}
    assert any(sa < eb and sb < ea for sa, ea in by_rel[a] for sb, eb in by_rel[b]), spans  # at the same time
    for rel, rid in served:
        rec = records[rid]
        assert rec["release_id"] == rel and len(rec["token_ids"]) == len(rec["logprobs"]) > 1, rec
        assert rec["logprobs"] == pytest.approx(rescored(models[rel], rec), abs=1e-4), (rid, rel)
        for other in set(models) - {rel}:
            worst = max(abs(x - y) for x, y in zip(rec["logprobs"][1:], rescored(models[other], rec)[1:],
                                                   strict=True))
            assert worst > 0.05, (rid, rel, other, worst)  # told apart (tiny's random embeddings bound logits)
    loads = {rel: {records[rid]["runtime_load_id"] for r, rid in served if r == rel} for rel in models}
    assert all(len(ids) == 1 for ids in loads.values()) and len(set.union(*loads.values())) == 3


def test_rollback_to_an_adapter_and_to_the_base_and_the_diff_names_adapter_tensors(
        daemon_factory: Any, tiny_model: Path, tmp_path: Path) -> None:
    d: Daemon = daemon_factory()
    base = init(d, "roll")
    a = publish_adapter(d, "roll", tmp_path / "a", 1, base, tiny_model)
    b = publish_adapter(d, "roll", tmp_path / "b", 2, base, tiny_model)
    store = ReleaseStore(d.home / "artifacts.git")
    checkout = store.checkout(base["release_id"], tmp_path / "base")
    with d.http() as c:
        for target, adapter_dir in ((a, tmp_path / "a"), (base["release_id"], None)):
            head = store.head("roll")
            resp = c.post("/reef/scenarios/roll/rollback", json={"release_id": target, "expected_head": head})
            assert resp.status_code == 201, resp.text
            rolled = resp.json()
            assert rolled["operation"] == "rollback" and rolled["content_id"] == store.get(target).content_id
            body = {**BODY, "max_tokens": 12, "seed": 3}
            served = c.post("/s/roll/v1/chat/completions", json=body)
            assert served.headers["x-reef-release-id"] == rolled["release_id"]
            rec = c.get(f"/reef/records/{served.headers['x-reef-agent-record-id']}").json()
            assert rec["content_id"] == store.get(target).content_id
            assert rec["logprobs"] == pytest.approx(rescored(peft_model(checkout, adapter_dir), rec), abs=1e-4)
    to_base = store.head("roll")

    # the diff of an adapter release is against the model its parent serves: the base, or another adapter
    first = json.loads(d.cli("releases", "show", a, "--diff", "--json").stdout)["diff"]
    assert first["added"] == sorted(lora.FILES) and first["removed"] == [] and first["changed"] == []
    [weights] = [f for f in first["files"] if f["path"] == lora.WEIGHTS]
    assert weights["tensors"] and all(t["status"] == "added" and "lora_" in t["name"] and t["norm"] > 0
                                      for t in weights["tensors"])
    second = json.loads(d.cli("releases", "show", b, "--diff", "--json").stdout)["diff"]
    assert second["changed"] == [lora.WEIGHTS] and second["added"] == second["removed"] == []
    [weights] = second["files"]
    assert weights["tensors"] and all(t["status"] == "changed" and "lora_" in t["name"] and t["diff_norm"] > 0
                                      for t in weights["tensors"])
    assert {t["name"] for t in weights["tensors"]} == {t["name"] for f in first["files"] if f["path"] == lora.WEIGHTS
                                                       for t in f["tensors"]}
    back = json.loads(d.cli("releases", "show", to_base, "--diff", "--json").stdout)["diff"]
    assert back["removed"] == sorted(lora.FILES) and back["added"] == back["changed"] == []
    shown = d.cli("releases", "show", b, "--diff").stdout
    assert f"~ {lora.WEIGHTS}" in shown and "lora_A" in shown and "|Δ|" in shown and "LoRA adapter on base" in shown


def test_an_adapter_on_another_base_is_refused_at_publish_and_a_lying_one_is_never_served(
        daemon_factory: Any, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d: Daemon = daemon_factory()
    base = init(d, "mine")
    store = ReleaseStore(d.home / "artifacts.git")
    other_model = make_weights(tiny_model, tmp_path / "other-model", seed=7)
    other = store.publish("theirs", files_from_dir(other_model), expected_head=None, operation="init",
                          kind="weights", recipe="record")
    head = store.head("mine")

    def attempt(manifest: AdapterManifest, name: str, extra: dict[str, Any] | None = None) -> Any:
        adapter = make_adapter(tiny_model, tmp_path / name, 3, manifest)
        with pytest.raises(BadRequest) as err:
            store.publish("mine", {**files_from_dir(adapter), **(extra or {})}, expected_head=head,
                          operation="train", kind="weights", recipe="record")
        return err.value

    # trained on another base (a real release, with its real content id)
    e = attempt(AdapterManifest(other.content_id, other.release_id), "on-other")
    assert isinstance(e, BaseMismatch) and (e.expected, e.actual) == (base["content_id"], other.content_id)
    assert "not published" in e.message and e.status == 400
    # a manifest naming the right base content in a release that holds another
    e = attempt(AdapterManifest(base["content_id"], other.release_id), "forged")
    assert isinstance(e, BaseMismatch) and other.release_id in e.message
    # an adapter release carrying a copy of a base file
    e = attempt(AdapterManifest(base["content_id"], base["release_id"]), "extra",
                {"config.json": (tiny_model / "config.json").read_bytes()})
    assert "holds exactly" in e.message and "config.json" in e.message
    assert store.head("mine") == head and len(store.history("mine")) == 1  # nothing was published

    # a lying manifest that got onto the chain by a path that skips the check is still never served
    monkeypatch.setattr(ReleaseStore, "_check_adapter", lambda *a, **k: None)
    liar = make_adapter(tiny_model, tmp_path / "liar", 4, AdapterManifest(base["content_id"], other.release_id))
    rel = store.publish("mine", files_from_dir(liar), expected_head=head, operation="train", kind="weights",
                        recipe="record")
    with d.http() as c:
        err = assert_canonical_error(c.post("/s/mine/v1/chat/completions", json=BODY,
                                            headers={"x-reef-release-id": rel.release_id}), 500, shape="openai")
        assert "not served" in err["message"] and other.release_id in err["message"]
        ok = c.post("/s/mine/v1/chat/completions", json=BODY, headers={"x-reef-release-id": base["release_id"]})
        assert ok.status_code == 200  # the rest of the chain serves on


def test_a_truncated_adapter_that_reached_the_chain_is_a_clear_error_and_the_rest_serves(
        daemon_factory: Any, tiny_model: Path, tmp_path: Path) -> None:
    """An adapter whose tensors file was cut short, published by a path that skips the learner's check: a request
    for it is one clear error naming the file (it was a 500 with a traceback), and the base serves on."""
    d: Daemon = daemon_factory()
    base = init(d, "cut")
    store = ReleaseStore(d.home / "artifacts.git")
    adapter = make_adapter(tiny_model, tmp_path / "cut", 5, AdapterManifest(base["content_id"], base["release_id"]))
    weights = adapter / lora.WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    rel = store.publish("cut", files_from_dir(adapter), expected_head=store.head("cut"), operation="train",
                        kind="weights", recipe="record")
    with d.http() as c:
        err = assert_canonical_error(c.post("/s/cut/v1/chat/completions", json=BODY,
                                            headers={"x-reef-release-id": rel.release_id}), 500, shape="openai")
        assert "not a readable LoRA adapter" in err["message"] and "Traceback" not in err["message"], err
        ok = c.post("/s/cut/v1/chat/completions", json=BODY, headers={"x-reef-release-id": base["release_id"]})
        assert ok.status_code == 200
    assert "Traceback" not in d.log_tail(300)


def test_superseded_adapter_releases_leave_memory_and_served_ones_stay(
        daemon_factory: Any, tiny_model: Path, tmp_path: Path) -> None:
    """Six adapter releases published one after another (as a trainer would): after each, the engine holds the base,
    the head, a release a run pinned while it was the head (a wrapper pins its run's release to the end) and a
    running canary's candidate, and nothing else: every other superseded head's adapter is dropped (it stayed
    until ``memory_budget_mb``, some 10 MB a SmolLM2 release). When the canary ends, its candidate goes too
    (a publish while it ran would end it: the canary starts after the last). Pins are kept up to the newest
    ``PINS``."""
    d: Daemon = daemon_factory()
    base = init(d, "many")
    store = ReleaseStore(d.home / "artifacts.git")

    def content(release_id: str) -> str:
        return store.get(release_id).content_id

    with d.http() as c:
        def settle(want: set[str], what: str) -> None:
            deadline = time.monotonic() + 60  # a hang guard, not a speed bound
            while (got := set(c.get("/reef/status").json()["models"]["tiny"]["resident"])) != want:
                assert time.monotonic() < deadline, f"{what}: resident {sorted(got)}, expected {sorted(want)}"
                time.sleep(0.05)

        heads: list[str] = []
        kept = {base["content_id"]}
        for i in range(1, 7):
            heads.append(publish_adapter(d, "many", tmp_path / f"a{i}", i, base, tiny_model))
            assert chat(c, "many").headers["x-reef-release-id"] == heads[-1]  # served by the new head
            if i == 2:  # a run begins on this head and pins it to its end
                chat(c, "many", **{"x-reef-release-id": heads[-1]})
                kept.add(content(heads[-1]))
            if i == 6:  # a canary of a held candidate against the last head, its share taking every run
                cand = store.hold("many", files_from_dir(make_adapter(
                    tiny_model, tmp_path / "cand", 9, AdapterManifest(base["content_id"], base["release_id"]))),
                    kind="weights", recipe="record").release_id
                c.post("/reef/scenarios/many/canary", json={"release_id": cand, "share": 0.99}).raise_for_status()
                served = c.post("/s/many/r/run-1/v1/chat/completions", json=BODY)
                assert served.headers["x-reef-release-id"] == cand, served.headers
                kept.add(content(cand))
            settle(kept | {content(heads[-1])}, f"after publish {i}")
        # the canary ended (by hand here): its candidate serves no new run and is dropped
        c.post("/reef/scenarios/many/canary/end", json={}).raise_for_status()
        settle(kept - {content(cand)} | {content(heads[-1])}, "after the canary ended")
        # runs pinned to older releases (reloaded): the PINS newest pins stay, older ones are dropped
        assert PINS == 4
        for rid in (heads[2], heads[3], heads[4], heads[0], heads[1]):  # a2's run pinned first, then these
            assert chat(c, "many", **{"x-reef-release-id": rid}).headers["x-reef-release-id"] == rid
        settle({base["content_id"], content(heads[-1])} | {content(heads[i]) for i in (3, 4, 0, 1)},
               "the newest four pins kept, the fifth newest (heads[2]) dropped")


def test_sixty_adapter_releases_pinned_at_random_over_a_residency_of_four_pins_answer_every_request(
        daemon_factory: Any, tiny_model: Path, tmp_path: Path) -> None:
    """Sixty adapter releases on one base, requests pinned to them at random, four in flight at a time: far more
    releases than the engine keeps (the head, the base and the ``PINS`` newest pins), so most requests find their
    adapter gone and load it again. Every request is answered by the release it named, none fails, and what stays
    resident afterwards is bounded. Bugs caught: a load dropped while a request still decodes on it (a failed or
    misattributed answer), a reload that attaches the wrong adapter (the release id says which served), pins that
    keep every release they ever named (the resident set grows with the releases asked)."""
    import random
    import threading

    from safetensors.torch import load_file, save_file

    d: Daemon = daemon_factory()
    base = init(d, "sixty")
    store = ReleaseStore(d.home / "artifacts.git")
    first = make_adapter(tiny_model, tmp_path / "a0", 1, AdapterManifest(base["content_id"], base["release_id"]))
    tensors = load_file(first / lora.WEIGHTS)
    releases = []
    for i in range(60):  # another release's content each: the first adapter, each tensor scaled its own way
        dest = tmp_path / f"a{i + 1}"
        dest.mkdir()
        for f in first.iterdir():
            if f.name != lora.WEIGHTS:
                (dest / f.name).write_bytes(f.read_bytes())
        save_file({k: v * (1 + 0.01 * (i + 1)) for k, v in tensors.items()}, dest / lora.WEIGHTS,
                  metadata={"format": "pt"})
        releases.append(store.publish("sixty", files_from_dir(dest), expected_head=store.head("sixty"),
                                      operation="train", kind="weights", recipe="record").release_id)
    assert len({store.get(r).content_id for r in releases}) == 60
    picks = random.Random(0).choices(releases, k=96)
    failures: list[str] = []
    served: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        with d.http() as c:
            for i in range(k, len(picks), 4):
                body = {"model": "tiny", "max_tokens": 6, "seed": i,
                        "messages": [{"role": "user", "content": f"tell me about caches number {i}"}]}
                r = c.post("/s/sixty/v1/chat/completions", json=body, headers={"x-reef-release-id": picks[i]})
                with lock:
                    if r.status_code != 200 or r.headers.get("x-reef-release-id") != picks[i]:
                        failures.append(f"{picks[i]}: {r.status_code} {r.headers.get('x-reef-release-id')} "
                                        f"{r.text[:200]}")
                    else:
                        served.append(picks[i])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not failures, failures
    assert sorted(served) == sorted(picks) and len(set(picks)) > 40  # most of the sixty were asked
    with d.http() as c:
        deadline = time.monotonic() + 60  # a hang guard, not a speed bound: idle loads go once their requests end
        while len(resident := c.get("/reef/status").json()["models"]["tiny"]["resident"]) > 2 + PINS:
            assert time.monotonic() < deadline, sorted(resident)
            time.sleep(0.05)
    assert base["content_id"] in resident and store.get(releases[-1]).content_id in resident  # base and head
