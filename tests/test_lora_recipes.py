"""sao and ttt-discover on a model where online-rl trains LoRA (``lora`` unset, a model of ``LORA_AUTO_PARAMS``
parameters or more), through a real daemon: a step publishes an adapter release on the scenario's base (the
adapter alone, small against the model; sao's critic beside it), the engine serves it with answers of its own, a
restart serves the same and sao's next step resumes the critic from the release; LoRA settings that cannot work
are a 400 naming them."""

from __future__ import annotations

import json
from typing import Any

import httpx

from daemon import lora
from daemon.releases import ReleaseStore
from recipes.online_rl import LORA_AUTO_PARAMS
from tests.conftest import Daemon, assert_canonical_error
from tests.test_learning import releases, wait_for

MODEL = "big"


def config(path: Any, recipe: str, **settings: Any) -> str:
    # a candidate goes straight to the head here: these tests are about learning, not the canary that weights
    # recipes pass their candidates through by default (tests/test_canary_learning.py)
    settings = {"canary_share": 0, **settings}
    lines = f'\n[models.{MODEL}]\nengine = "transformers"\npath = "{path}"\n\n[recipes.{recipe}]\n'
    return lines + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())


def answer(c: httpx.Client, scenario: str, prompt: str, *, release: str | None = None, seed: int | None = None
           ) -> dict[str, Any]:
    """One served answer (pinned to ``release`` when given) and its record."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": prompt}]}
    if seed is not None:
        body["seed"] = seed
    r = c.post(f"/s/{scenario}/v1/chat/completions", json=body,
               headers={"x-reef-release-id": release} if release else {})
    assert r.status_code == 200, r.text
    assert release is None or r.headers["x-reef-release-id"] == release
    return c.get(f"/reef/records/{r.headers['x-reef-agent-record-id']}").json()


def report(c: httpx.Client, receipt: str, score: float, **metadata: Any) -> None:
    body: dict[str, Any] = {"score": score, "references": [receipt]}
    if metadata:
        body["metadata"] = metadata
    assert c.post("/reef/report", json=body).status_code == 201


def consumed(c: httpx.Client, scenario: str) -> list[str]:
    chain = releases(c, scenario, True)
    return [r for x in chain["releases"] + chain["rejected"] for r in x.get("receipts", [])]


def served(c: httpx.Client, scenario: str, release: str) -> tuple[list[int], list[float]]:
    rec = answer(c, scenario, "Say file.", release=release, seed=7)
    assert rec["release_id"] == release
    return rec["token_ids"], rec["logprobs"]


def differ(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> float:
    """How far two answers to the same request are apart: inf when they sampled other tokens, else the largest
    log-prob difference."""
    if a[0] != b[0]:
        return float("inf")
    return max(abs(x - y) for x, y in zip(a[1], b[1], strict=True))


def check_adapter_release(d: Daemon, release: str, init: dict[str, Any], extra: tuple[str, ...] = ()) -> dict[str, int]:
    """The release is an adapter on the scenario's init (its whole model), holding the adapter alone, small
    against the model; returns its files' sizes."""
    store = ReleaseStore(d.home / "artifacts.git")
    files = {f.path: f.size for f in store.files(release)}
    assert sorted(files) == sorted(lora.FILES + extra), files
    assert store.adapter(release) == lora.AdapterManifest(init["content_id"], init["release_id"])
    whole = sum(f.size for f in store.files(init["release_id"]))
    assert sum(files.values()) < whole / 20, (files, whole)  # 2 MB of 87: never a copy of the model
    return files


def test_sao_publishes_adapter_releases_with_its_critic_and_a_restart_resumes_both(
        daemon_factory: Any, lora_sized_model: Any) -> None:
    d: Daemon = daemon_factory(config(lora_sized_model, "sao", lr=0.01))
    with d.http() as c:
        # LoRA settings that cannot work are refused, named
        for settings, param in (({"lora": True, "train_final_norm": True}, "settings.train_final_norm"),
                                ({"lora": True, "train_embeddings": True}, "settings.train_embeddings"),
                                ({"lora_rank": 0}, "settings.lora_rank")):
            err = assert_canonical_error(c.post("/reef/scenarios", json={
                "name": "bad", "recipe": "sao", "model": MODEL, "settings": settings}), 400)
            assert err["param"] == param, (settings, err)
        created = c.post("/reef/scenarios", json={"name": "sao", "recipe": "sao", "model": MODEL})
        assert created.status_code == 201, created.text
        init = releases(c, "sao")["releases"][-1]
        seed = answer(c, "sao", "Say a.")["id"]
        report(c, seed, 0.5)  # seeds the fresh critic: no signal, nothing published
        wait_for(lambda: seed in consumed(c, "sao"), what="the seeding report consumed")
        first = answer(c, "sao", "Say b.")["id"]
        report(c, first, 1.0)
        head = wait_for(lambda: (r := releases(c, "sao"))["releases"][0]["step"] == 1 and r,
                        what="step 1")["releases"][0]
        assert head["receipts"] == [first] and head["settings"]["lora"] is None  # unset: the model's size decided
        files = check_adapter_release(d, head["release_id"], init, extra=("value_head.pt",))
        assert head["metrics"]["adapter_bytes"] == files[lora.WEIGHTS]
        base = served(c, "sao", init["release_id"])
        trained = served(c, "sao", head["release_id"])
        assert differ(base, served(c, "sao", init["release_id"])) < 1e-5  # the same release answers the same
        assert differ(base, trained) > 1e-3, (base, trained)  # the adapter release answers with its own weights
    d.stop()
    d.start()
    with d.http() as c:
        assert differ(trained, served(c, "sao", head["release_id"])) < 1e-4  # the restart serves the same
        # the worker's lineage is gone: the next step starts from the head's adapter and the critic saved with it
        # (a fresh critic would spend this report seeding itself and publish nothing)
        second = answer(c, "sao", "Say c.")["id"]
        report(c, second, 0.0)
        chain = wait_for(lambda: second in consumed(c, "sao") and releases(c, "sao", True), what="step 2")
        now = chain["releases"][0]
        assert now["step"] == 2 and now["receipts"] == [second], chain["rejected"]
        check_adapter_release(d, now["release_id"], init, extra=("value_head.pt",))
        assert differ(trained, served(c, "sao", now["release_id"])) > 1e-3


def test_ttt_discover_publishes_adapter_releases_and_a_restart_serves_the_same(
        daemon_factory: Any, lora_sized_model: Any) -> None:
    d: Daemon = daemon_factory(config(lora_sized_model, "ttt-discover", group_size=2, lr=0.01))
    with d.http() as c:
        err = assert_canonical_error(c.post("/reef/scenarios", json={
            "name": "bad", "recipe": "ttt-discover", "settings": {"lora": True, "train_embeddings": True}}), 400)
        assert err["param"] == "settings.train_embeddings"
        created = c.post("/reef/scenarios", json={"name": "ttt", "recipe": "ttt-discover", "model": MODEL})
        assert created.status_code == 201, created.text
        init = releases(c, "ttt")["releases"][-1]
        attempts = [answer(c, "ttt", "Say one long word.")["id"] for _ in range(2)]
        for receipt, score in zip(attempts, (0.0, 1.0), strict=True):
            report(c, receipt, score, group="r1")
        head = wait_for(lambda: (r := releases(c, "ttt"))["releases"][0]["step"] == 1 and r,
                        what="step 1")["releases"][0]
        assert sorted(head["receipts"]) == sorted(attempts)
        files = check_adapter_release(d, head["release_id"], init)
        assert head["metrics"]["adapter_bytes"] == files[lora.WEIGHTS]
        base = served(c, "ttt", init["release_id"])
        trained = served(c, "ttt", head["release_id"])
        assert differ(base, served(c, "ttt", init["release_id"])) < 1e-5
        assert differ(base, trained) > 1e-3, (base, trained)
    d.stop()
    d.start()
    with d.http() as c:
        assert differ(trained, served(c, "ttt", head["release_id"])) < 1e-4


def test_the_model_is_one_online_rl_trains_lora_on(lora_sized_model: Any) -> None:
    """The premise of the tests above: with ``lora`` unset, online-rl trains adapters on this model."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(lora_sized_model)
    h, layers, mlp, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    assert vocab * h + layers * (4 * h * h + 3 * h * mlp) >= LORA_AUTO_PARAMS


def test_a_whole_weights_setting_on_a_step_that_trains_lora_fails_naming_it(tiny_model: Any,
                                                                            monkeypatch: Any) -> None:
    """``lora`` unset decides by the model's size in the trainer; where it picks LoRA, ``train_embeddings`` or
    sao's ``train_final_norm`` would train nothing: the step fails saying which setting to change."""
    import pytest

    from recipes import online_rl
    from recipes.sao import SAOSettings
    from recipes.ttt_discover import TTTSettings

    monkeypatch.setattr(online_rl, "LORA_AUTO_PARAMS", 0)  # the tiny model as big as a real one
    for settings, key in ((SAOSettings(train_final_norm=True), "train_final_norm"),
                          (TTTSettings(train_embeddings=True), "train_embeddings")):
        with pytest.raises(ValueError, match=f"{key} = true trains whole weights.*set lora = false"):
            online_rl.load_policy(tiny_model, None, settings, trainable=True)  # type: ignore[arg-type]
        settings.lora = False  # what the message says to do: whole weights, the setting at work
        assert not online_rl.is_adapter(online_rl.load_policy(tiny_model, None, settings, trainable=True))
    assert online_rl.is_adapter(online_rl.load_policy(tiny_model, None, SAOSettings(), trainable=True))
