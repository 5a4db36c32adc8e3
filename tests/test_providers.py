"""Real providers in one command (``reef serve --provider NAME``, ``reef-pi --reef-provider NAME``), over real HTTP.

The real APIs (api.anthropic.com, api.openai.com) cannot be reached from here, and no Ollama or llama.cpp server
runs here: every preset is pointed at a STAND-IN provider, ``tests/upstream_stub.py`` on 127.0.0.1, with
``--upstream-url`` (the documented override of a preset's base URL). The stand-in speaks each provider's wire
format and records the headers it received, so the tests can see which header carried the key.

The key is a unique random string per test; after each run the whole ``REEF_HOME`` (config, logs, records,
release chain, run files, agent homes) is searched for it, as are ``reef status``, ``/reef/*`` answers, error
messages and the daemon's argv.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from daemon.config import load_config
from daemon.errors import BadRequest
from daemon.providers import PRESETS, provider_entry
from tests.conftest import Daemon, assert_canonical_error, make_home, probe_unix
from tests.test_agents import BIN, agents_dir  # noqa: F401 - the real agents, installed once per machine
from tests.test_upstream import stub  # noqa: F401 - the stand-in provider fixture, used by name

PROPOSER = '[recipes.lessons]\nproposer = "{model}"\n'


def new_key() -> str:
    return f"sk-test-{secrets.token_hex(20)}"


def sent(stub_url: str) -> list[dict[str, Any]]:
    """What the stand-in received, headers by lower-case name."""
    with httpx.Client() as c:
        got = c.get(stub_url + "/_stub/requests").json()
    for r in got:
        r["headers"] = {k.lower(): v for k, v in r["headers"].items()}
    return got


def forget(stub_url: str) -> None:
    with httpx.Client() as c:
        c.delete(stub_url + "/_stub/requests")


def grep_home(home: Path, key: str) -> list[str]:
    """Every file under the home that holds the key (bytes, any file: sqlite, git objects, logs, json)."""
    needle = key.encode()
    return [str(p) for p in home.rglob("*") if p.is_file() and not p.is_symlink() and needle in p.read_bytes()]


@contextlib.contextmanager
def serving(home: Path, port: int, env: dict[str, str], *flags: str) -> Iterator[Daemon]:
    """``reef serve --port PORT FLAGS...`` in the foreground of a child process, until the test is done."""
    log = open(home / "logs" / "serve.log", "wb")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen([sys.executable, "-m", "reef_cli.main", "serve", "--port", str(port), *flags],
                            env=env, stdout=log, stderr=log, cwd=home)
    log.close()
    d = Daemon(home=home, port=port, env=env, proc=proc)  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 120  # a hang guard; the wait is on the socket answering
        while not probe_unix(home / "reef.sock"):
            assert proc.poll() is None and time.monotonic() < deadline, (home / "logs" / "serve.log").read_text()
            time.sleep(0.05)
        yield d
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def cli(env: dict[str, str], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reef_cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd=cwd)


# --- the presets on their own ----------------------------------------------------------------------------------


def test_presets_name_their_url_format_model_and_key_variable() -> None:
    env: dict[str, str] = {}
    a = provider_entry("anthropic", env)
    assert (a.url, a.format, a.upstream_model, a.api_key_env) == (
        "https://api.anthropic.com", "anthropic", "claude-sonnet-4-5", "ANTHROPIC_API_KEY")
    o = provider_entry("openai", env)
    assert (o.url, o.format, o.api_key_env) == ("https://api.openai.com/v1", "openai-chat", "OPENAI_API_KEY")
    assert provider_entry("openai", env, format="openai-responses").format == "openai-responses"
    ol = provider_entry("ollama", env, model="qwen2.5-coder")
    assert (ol.url, ol.api_key_env, ol.upstream_model) == ("http://127.0.0.1:11434/v1", None, "qwen2.5-coder")
    assert provider_entry("llamacpp", env).url == "http://127.0.0.1:8080/v1"
    compat = provider_entry("openai-compatible", env, url="http://127.0.0.1:8000/v1", key_env="GATEWAY_API_KEY")
    assert compat.api_key_env == "GATEWAY_API_KEY" and compat.format == "openai-chat"
    assert set(PRESETS) == {"anthropic", "openai", "ollama", "llamacpp", "openai-compatible"}


@pytest.mark.parametrize(("name", "kw", "says"), [
    ("antropic", {}, "known providers: anthropic, openai, ollama, llamacpp, openai-compatible"),
    ("ollama", {}, "needs --upstream-model"),
    ("openai-compatible", {}, "needs --upstream-url"),
    ("anthropic", {"format": "openai-chat"}, "speaks anthropic"),
    ("openai", {"key_env": "OPENAI_SECRET"}, "must be a name ending in _API_KEY"),
    ("openai", {"key_env": "REEF_TOKEN"}, "not REEF_TOKEN"),
    ("openai", {"url": "http://gateway.example/v1"}, "clear text"),  # a key over plain http beyond loopback
    ("openai", {"url": "ftp://gateway.example"}, "http(s) URL"),
])
def test_a_preset_that_cannot_work_is_refused_saying_why(name: str, kw: dict[str, Any], says: str) -> None:
    with pytest.raises(BadRequest, match=None) as e:
        provider_entry(name, {}, **kw)
    assert says in e.value.message, e.value.message


@pytest.mark.parametrize(("host", "loopback"), [
    ("api.localhost", False), ("evillocalhost", False), ("localhost.evil.com", False), ("ip6-localhost", False),
    ("localhost.", False), ("127.1", False), ("10.0.0.5", False),
    ("127.0.0.1", True), ("127.5.5.5", True), ("[::1]", True), ("localhost", True), ("LocalHost", True)])
def test_a_key_goes_over_plain_http_only_to_a_literal_loopback_address_or_localhost(host: str, loopback: bool) -> None:
    """Names are not resolved (a hosts entry mapped ``api.localhost`` elsewhere and it received the key in clear
    text): only 127.0.0.0/8, ::1 and the name ``localhost`` itself may get a key over plain http; without a key
    any of them may be used over http, and with https any of them takes a key."""
    from daemon.listening import is_loopback

    assert is_loopback(host) is loopback
    url = f"http://{host}:8080/v1"
    if loopback:
        assert provider_entry("openai", {}, url=url).url == url
    else:
        with pytest.raises(BadRequest, match="clear text") as e:
            provider_entry("openai", {}, url=url)
        assert e.value.param == "url"
    assert provider_entry("ollama", {}, url=url, model="m").url == url  # no key: nothing to leak
    assert provider_entry("openai", {}, url=f"https://{host}:8080/v1").url == f"https://{host}:8080/v1"


def test_credentials_in_a_url_are_refused_and_never_echoed(tmp_path: Path) -> None:
    with pytest.raises(BadRequest) as e:
        provider_entry("openai", {}, url="https://me:hunter2secret@gateway.example/v1")
    assert "credentials" in e.value.message and "hunter2secret" not in e.value.message
    # the same for a model entry in config.toml (it was accepted and the credentials silently dropped)
    (tmp_path / "config.toml").write_text('[models.gw]\nengine = "upstream"\n'
                                          'url = "https://me:hunter2secret@gateway.example"\n')
    with pytest.raises(BadRequest) as e:
        load_config({"REEF_HOME": str(tmp_path)})
    assert "credentials" in e.value.message and "hunter2secret" not in e.value.message
    # a plain-http key beyond loopback, and a key variable Reef never reads, are refused in config.toml too
    (tmp_path / "config.toml").write_text('[models.gw]\nengine = "upstream"\nurl = "http://gateway.example"\n'
                                          'api_key_env = "GATEWAY_API_KEY"\n')
    with pytest.raises(BadRequest, match="clear text"):
        load_config({"REEF_HOME": str(tmp_path)})
    (tmp_path / "config.toml").write_text('[models.gw]\nengine = "upstream"\nurl = "https://gateway.example"\n'
                                          'api_key_env = "GATEWAY_SECRET"\n')
    with pytest.raises(BadRequest, match="_API_KEY"):
        load_config({"REEF_HOME": str(tmp_path)})


def test_the_provider_is_the_default_model_in_memory_only(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('default_model = "tiny"\n')
    before = (tmp_path / "config.toml").read_text()
    cfg = load_config({"REEF_HOME": str(tmp_path), "REEF_PROVIDER": "anthropic", "ANTHROPIC_API_KEY": "k"})
    assert cfg.default_model == "anthropic" and cfg.provider is not None and cfg.models["anthropic"].engine == "upstream"
    flagged = load_config({"REEF_HOME": str(tmp_path)}, {"provider": "openai", "upstream_model": "gpt-x",
                                                         "default_model": "tiny"})
    assert flagged.default_model == "tiny" and flagged.models["openai"].upstream_model == "gpt-x"
    assert (tmp_path / "config.toml").read_text() == before
    with pytest.raises(BadRequest, match="--upstream-model needs --provider"):
        load_config({"REEF_HOME": str(tmp_path), "REEF_UPSTREAM_MODEL": "m"})


# --- refused at start ------------------------------------------------------------------------------------------


def test_a_missing_key_or_unknown_provider_is_refused_at_start(tiny_model: Path) -> None:
    home, port, env = make_home(tiny_model)
    try:
        out = cli(env, "serve", "--port", str(port), "--provider", "anthropic")
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert "ANTHROPIC_API_KEY is not set" in out.stderr
        out = cli(env, "daemon", "start", "--provider", "openai")
        assert out.returncode == 2 and "OPENAI_API_KEY is not set" in out.stderr, out.stderr
        # the daemon itself (what a wrapper starts with REEF_PROVIDER) refuses too, before it listens
        daemon = subprocess.run([sys.executable, "-m", "daemon"], env={**env, "REEF_PROVIDER": "openai"},
                                capture_output=True, text=True, timeout=120, cwd=home)
        assert daemon.returncode == 2 and "OPENAI_API_KEY is not set" in daemon.stderr, daemon.stderr
        assert not (home / "reef.sock").exists() and not (home / "reef.pid").exists()
        out = cli(env, "serve", "--port", str(port), "--provider", "claude")
        assert out.returncode == 2 and "unknown provider 'claude'; known providers: anthropic, openai" in out.stderr
        out = cli({**env, "OPENAI_API_KEY": "k"}, "serve", "--provider", "openai", "--upstream-url",
                  "https://me:hunter2secret@gateway.example/v1")
        assert out.returncode == 2 and "credentials" in out.stderr and "hunter2secret" not in out.stderr
    finally:
        shutil.rmtree(home, ignore_errors=True)


# --- served, recorded, learning --------------------------------------------------------------------------------


def test_anthropic_preset_serves_sdk_clients_records_learns_and_never_keeps_the_key(
        tiny_model: Path, stub: str) -> None:  # noqa: F811
    key = new_key()
    home, port, env = make_home(tiny_model, PROPOSER.format(model="anthropic"))
    env["ANTHROPIC_API_KEY"] = key
    config_before = (home / "config.toml").read_text()
    forget(stub)
    try:
        with serving(home, port, env, "--provider", "anthropic", "--upstream-url", stub) as d:
            assert key not in Path(f"/proc/{d.proc.pid}/cmdline").read_text()  # type: ignore[union-attr]
            with d.http() as c:
                made = c.post("/reef/scenarios", json={"name": "coach", "recipe": "lessons"})
                assert made.status_code == 201 and made.json()["model"] == "anthropic", made.text
                receipts = []
                with openai.OpenAI(base_url=f"{d.url}/s/coach/v1", api_key=d.token, max_retries=0) as oc:
                    raw = oc.chat.completions.with_raw_response.create(
                        model="anthropic", messages=[{"role": "user", "content": "hi"}])
                    assert raw.parse().choices[0].message.content == "stub says hello"
                    receipts.append(raw.headers["x-reef-agent-record-id"])
                with anthropic.Anthropic(base_url=f"{d.url}/s/coach", api_key=d.token, max_retries=0) as ac:
                    with ac.messages.stream(model="anthropic", max_tokens=32,
                                            messages=[{"role": "user", "content": "hello"}]) as s:
                        assert s.get_final_text() == "stub says hello"
                        receipts.append(s.response.headers["x-reef-agent-record-id"])
                got = sent(stub)
                assert [r["path"] for r in got] == ["/v1/messages", "/v1/messages"]
                for r in got:  # Anthropic's header, with the key from ANTHROPIC_API_KEY; no Bearer beside it
                    assert r["headers"]["x-api-key"] == key and "authorization" not in r["headers"]
                    assert r["headers"]["anthropic-version"] and r["body"]["model"] == "claude-sonnet-4-5"
                for receipt in receipts:
                    rec = c.get(f"/reef/records/{receipt}").json()
                    assert rec["scenario"] == "coach" and rec["model"] == "anthropic" and rec["status"] == "complete", rec
                # the provider refusing the key: 502 naming the variable, never the key
                forget(stub)
                refused = c.post("/s/coach/v1/chat/completions", json={
                    "model": "anthropic", "messages": [{"role": "user", "content": "[stub:status=401]"}]})
                err = assert_canonical_error(refused, 502, shape="openai")
                assert "ANTHROPIC_API_KEY" in err["message"] and key not in refused.text

                # learning: a lessons evolve whose proposer is the provider's model
                forget(stub)
                out = c.post("/reef/scenarios/coach/evolve", json={
                    "instruction": "always run the tests [stub:text=Run the tests before you finish.]"})
                assert out.status_code == 201 and out.json()["verdict"] == "accepted", out.text
                asked = sent(stub)  # the proposer's call, then the held-out check's probes under the new rules
                (proposed,) = [r for r in asked if "rules file" in json.dumps(r["body"])]
                assert all(r["headers"]["x-api-key"] == key for r in asked) and len(asked) > 1
                assert out.json()["metrics"]["heldout"] == "passed"
                rules = c.get("/reef/scenarios/coach/harness").json()["files"]["AGENTS.md"]
                assert "Run the tests before you finish." in rules, rules

                answers = [c.get(path) for path in (
                    "/reef/status", "/reef/scenarios", "/reef/scenarios/coach", "/reef/scenarios/coach/records",
                    "/reef/scenarios/coach/releases", "/reef/scenarios/coach/harness", f"/reef/records/{receipts[0]}",
                    "/metrics", "/healthz")]
                assert all(a.status_code == 200 for a in answers)
                assert not [a.url for a in answers if key in a.text]
                status = answers[0].json()
                assert status["default_model"] == "anthropic"
                assert status["models"]["anthropic"]["upstream"] == {
                    "url": stub, "format": "anthropic", "model": "claude-sonnet-4-5", "api_key_env": "ANTHROPIC_API_KEY"}
            # a background start beside it: the same provider is the daemon already running; another is refused
            again = cli(env, "daemon", "start", "--provider", "anthropic", "--upstream-url", stub)
            assert again.returncode == 0 and "already running" in again.stdout, again.stdout + again.stderr
            other = cli({**env, "OPENAI_API_KEY": "k"}, "daemon", "start", "--provider", "openai")
            assert other.returncode == 1 and "without provider openai" in other.stderr, other.stderr
            for args in (("status",), ("status", "--json"), ("doctor",)):
                shown = cli(env, *args)
                assert key not in shown.stdout + shown.stderr, args
            assert "key from $ANTHROPIC_API_KEY" in cli(env, "status").stdout
        assert (home / "config.toml").read_text() == config_before
        assert grep_home(home, key) == []
        assert "key from $ANTHROPIC_API_KEY" in (home / "logs" / "serve.log").read_text()
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize(("provider", "flags", "env_key", "model", "path", "auth"), [
    ("openai", [], "OPENAI_API_KEY", "gpt-4.1-mini", "/v1/chat/completions", "bearer"),
    ("openai", ["--upstream-format", "openai-responses", "--upstream-model", "gpt-test"], "OPENAI_API_KEY",
     "gpt-test", "/v1/responses", "bearer"),
    ("ollama", ["--upstream-model", "qwen2.5-coder"], None, "qwen2.5-coder", "/v1/chat/completions", None),
    ("llamacpp", [], None, "llamacpp", "/v1/chat/completions", None),  # the client's model name goes through
    ("openai-compatible", ["--upstream-key-env", "GATEWAY_API_KEY", "--upstream-model", "m"], "GATEWAY_API_KEY",
     "m", "/v1/chat/completions", "bearer"),
])
def test_openai_format_presets_send_the_key_as_a_bearer_token(
        tiny_model: Path, stub: str,  # noqa: F811
        provider: str, flags: list[str], env_key: str | None, model: str, path: str, auth: str | None) -> None:
    key = new_key()
    home, port, env = make_home(tiny_model)
    if env_key:
        env[env_key] = key
    forget(stub)
    try:
        with serving(home, port, env, "--provider", provider, "--upstream-url", stub + "/v1", *flags) as d, \
                anthropic.Anthropic(base_url=d.url, api_key=d.token, max_retries=0) as ac:
            raw = ac.messages.with_raw_response.create(model=provider, max_tokens=32,
                                                       messages=[{"role": "user", "content": "hi"}])
            assert raw.parse().content[0].text == "stub says hello"
            assert raw.headers["x-reef-agent-record-id"]
            (got,) = sent(stub)
            assert got["path"] == path and got["body"]["model"] == model
            assert "x-api-key" not in got["headers"]
            if auth:
                assert got["headers"]["authorization"] == f"Bearer {key}"
            else:  # a local server: no key, no header
                assert "authorization" not in got["headers"]
        assert grep_home(home, key) == []
    finally:
        shutil.rmtree(home, ignore_errors=True)


# --- a wrapped agent in one command ----------------------------------------------------------------------------


@pytest.mark.agents
def test_reef_pi_with_a_provider_in_one_command(tiny_model: Path, stub: str, tmp_path: Path,  # noqa: F811
                                                agents_dir: Path) -> None:  # noqa: F811
    """``reef-pi --reef-provider anthropic -p ...``: refused while a daemon without the provider runs; with none
    running, the wrapper starts one serving the provider, moves the scenario made on another model, and the run is
    served by the (stand-in) provider with receipts; evolve learns through the provider's model."""
    key = new_key()
    home, port, env = make_home(tiny_model)
    env.update(ANTHROPIC_API_KEY=key, REEF_AGENTS_DIR=str(agents_dir), HOME=str(tmp_path), REEF_UPSTREAM_URL=stub)
    project = tmp_path / "project"
    project.mkdir()

    def reef_pi(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BIN / "reef-pi"), *args], env=env, capture_output=True, text=True, timeout=240,
                              cwd=project, stdin=subprocess.DEVNULL)

    # a daemon without the provider: the scenario pi is made on the tiny model
    d = Daemon(home=home, port=port, env={k: v for k, v in env.items() if k != "REEF_UPSTREAM_URL"})
    forget(stub)
    try:
        d.start()
        with d.http() as c:
            assert c.post("/reef/scenarios", json={"name": "pi", "recipe": "lessons", "model": "tiny"}).status_code == 201
        refused = reef_pi("--reef-provider", "anthropic", "-p", "--no-session", "say hi")
        assert refused.returncode == 1 and "without provider anthropic" in refused.stderr, refused.stderr
        d.stop()
        with open(home / "config.toml", "a") as f:  # lessons phrases rules with the provider's model from now on
            f.write(PROPOSER.format(model="anthropic"))
        ran = reef_pi("--reef-provider", "anthropic", "-p", "--no-session", "say hi")
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert "stub says hello" in ran.stdout
        assert "starting the daemon" in ran.stderr and "moved from model tiny to provider anthropic" in ran.stderr
        runs = home / "runs"
        run = json.loads((runs / f"{(runs / 'last-pi').read_text().strip()}.json").read_text())
        assert run["receipts"] and run["model"] == "anthropic"
        got = sent(stub)
        assert got and all(r["headers"]["x-api-key"] == key and r["path"] == "/v1/messages" for r in got)
        forget(stub)
        taught = reef_pi("evolve", "keep answers short [stub:text=Keep answers short.]")
        assert taught.returncode == 0 and "released step" in taught.stdout, taught.stdout + taught.stderr
        asked = sent(stub)  # the proposer's call and the held-out check's probes, all with the key
        (proposed,) = [r for r in asked if "rules file" in json.dumps(r["body"])]
        assert all(r["headers"]["x-api-key"] == key for r in asked)
        status = cli(env, "status")
        assert key not in status.stdout + status.stderr
    finally:
        d.stop()
        cli(env, "daemon", "stop")
    assert grep_home(home, key) == []
    shutil.rmtree(home, ignore_errors=True)
