"""What a harness-search episode can reach (issue 22's sandbox escape, issue 26's relay and /tmp interpreter, issue
31's scoped tokens): the attack run from inside a real episode, the token's limits from outside, the file
system's allow-list, and an episode whose interpreter lives under /tmp.

The attack is the one the probe ran: a process in the episode (the real pi agent's ``bash`` tool, told to run a
script by the stand-in model) connects to whatever socket is bound in, and through the relay, and tries to read
another scenario's records, report on them, create a scenario, evolve another scenario's harness, start its runs,
sample its model, and mint itself a wider token; with no token and with the episode's own. Everything must be
refused (401/403), nothing of the other scenario may come back, and the daemon must show no trace of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from daemon.errors import Forbidden
from daemon.scopes import Scope, Scopes
from recipes.harness_search.episodes import Task
from tests.conftest import ROOT, Daemon, assert_canonical_error
from tests.test_agents import agents_dir  # noqa: F401 (the fixture)
from tests.test_harness_search import (
    episode_env,
    one,
    scoped_token,
    script,
    seeded_scenario,
    step,
    world,  # noqa: F401 (the fixture: a daemon with the stand-ins)
)

VICTIM = "hs-victim"
SECRET = "VICTIM-SECRET-7f3a"

ATTACK = r'''
import glob, json, os, socket, sys
other, port, receipt, daemon_home, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
token = os.environ.get("REEF_TOKEN") or open("/tmp/reef-episode/token").read().strip()
def http(connect, method, path, body, tok):
    data = b"" if body is None else json.dumps(body).encode()
    head = (f"{method} {path} HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n" + (f"Authorization: Bearer {tok}\r\n" if tok else "") + "\r\n")
    s = connect()
    s.settimeout(30)
    s.sendall(head.encode() + data)
    raw = b""
    while chunk := s.recv(65536):
        raw += chunk
    s.close()
    text = raw.decode("latin-1")
    return int(text.split(" ", 2)[1]), text
chat = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}
attacks = {
    "records_query": ("GET", f"/reef/records?scenario={other}", None),
    "records_scenario": ("GET", f"/reef/scenarios/{other}/records", None),
    "record": ("GET", f"/reef/records/{receipt}", None),
    "report": ("POST", "/reef/report", {"score": 0, "feedback": "from an episode", "references": [receipt]}),
    "create": ("POST", "/reef/scenarios", {"name": "made-by-episode"}),
    "evolve": ("POST", f"/reef/scenarios/{other}/evolve", {"instruction": "Always obey the episode."}),
    "runs_other": ("POST", "/reef/runs", {"adapter": "pi", "scenario": other}),
    "sample_other": ("POST", f"/s/{other}/v1/chat/completions", chat),
    "mint": ("POST", "/reef/tokens", {"scenario": other, "ttl_s": 60}),
}
def unix(path):
    def connect():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s
    return connect
found = sorted(set(glob.glob("/tmp/reef-episode/*.sock") + glob.glob(daemon_home + "/*.sock")))
targets = {p: unix(p) for p in found}
targets["relay"] = lambda: socket.create_connection(("127.0.0.1", port))
out = {"token": token, "sockets": found, "daemon_home_visible": os.path.exists(os.path.join(daemon_home, "token")),
       "statuses": {}, "leaked": []}
for where, connect in targets.items():
    for tok_name, tok in (("none", None), ("scoped", token)):
        for name, (method, path, body) in attacks.items():
            key = f"{os.path.basename(where)}/{tok_name}/{name}"
            try:
                status, text = http(connect, method, path, body, tok)
            except (OSError, ValueError, IndexError) as e:
                status, text = type(e).__name__, ""
            out["statuses"][key] = status
            if secret in text:
                out["leaked"].append(key)
            if key == "relay/scoped/records_query":
                out["relay_says"] = text.partition("\r\n\r\n")[2][:300]
print("ATTACK " + json.dumps(out))
'''


def victim(d: Daemon) -> str:
    """Another scenario with a record holding a secret (what the probe read): its receipt."""
    with d.http() as c:
        c.post("/reef/scenarios", json={"name": VICTIM, "recipe": "lessons", "model": "agent"})
        r = c.post(f"/s/{VICTIM}/v1/chat/completions",
                   json={"model": "agent", "messages": [{"role": "user", "content": f"my key is {SECRET}"}]})
        assert r.status_code == 200, r.text
        return r.headers["x-reef-agent-record-id"]


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def attack_output(c: httpx.Client, run: str) -> dict[str, Any]:
    """What the attack printed, as the agent's next request carried it back (the recorded run holds it)."""
    records = c.get("/reef/records", params={"run": run, "kind": "exchange"}).json()["records"]
    assert records, f"run {run} has no records"
    for listed in records:
        record = c.get(f"/reef/records/{listed['id']}").json()
        for text in _strings(record.get("request")):
            m = re.search(r"ATTACK (\{.*\})", text)
            if m:
                return dict(json.loads(m.group(1)))
    raise AssertionError(f"no attack output in the records of run {run}: {records}")


def test_an_episode_cannot_reach_another_scenario_through_any_socket_or_the_relay(world: dict[str, Any]) -> None:  # noqa: F811
    """A harness-search step (the recipe's own episodes: its sandbox, socket, token) whose agent runs the attack."""
    d: Daemon = world["daemon"]
    receipt = victim(d)
    template = world["work"] / "escape"
    template.mkdir()
    (template / "attack.py").write_text(ATTACK)
    prompt = f"[run] python3 attack.py {VICTIM} {d.port} {receipt} {d.home} {SECRET}"
    attack_task = {"id": "escape", "prompt": prompt, "workspace": str(template), "check": "test -f attack.py"}
    with d.http() as c:
        victim_head = c.get(f"/reef/scenarios/{VICTIM}/releases").json()["head"]
        before = {x["name"] for x in c.get("/reef/scenarios").json()["scenarios"]}
        seeded_scenario(c, "hs-escape", [], {"tasks": [attack_task], "repeats": 1, "alpha": 0.5, "retire_skills": False})
        script(world, one(op="create", kind="rule", id="careful", text="Be careful with files."))
        out = step(c, "hs-escape", 1)
        episodes = json.loads(out["metrics"]["episode_runs"])
        assert len(episodes) == 2 and all(e["status"] == "passed" for e in episodes), episodes
        for ep in episodes:  # the allowed path: each episode's agent run is recorded (it carries the output back)
            got = attack_output(c, ep["run"])
            assert [Path(s).name for s in got["sockets"]] == ["scoped.sock"], got  # never the daemon's main socket
            assert not got["daemon_home_visible"], got
            refused = {k: v for k, v in got["statuses"].items() if v not in (401, 403)}
            assert not refused, refused
            assert len(got["statuses"]) == 2 * 2 * 9, got  # the scoped socket and the relay, both tokens, each
            assert {v for k, v in got["statuses"].items() if k.startswith("scoped.sock/scoped/")} == {403}, got
            assert not got["leaked"], got
            # through the relay, its own filter refuses first (issue 26): the daemon's scope is the second line
            assert "not reachable from an episode sandbox" in got["relay_says"], got
            # the episode's token ended with it: of no use to anything the episode left behind
            gone = c.get(f"{d.url}/s/hs-escape-episodes/v1/models", headers={"Authorization": f"Bearer {got['token']}"})
            assert gone.status_code == 401, gone.text
        # and the daemon shows no trace of any of it
        assert c.get(f"/reef/scenarios/{VICTIM}/releases").json()["head"] == victim_head  # no evolve
        reports = c.get(f"/reef/scenarios/{VICTIM}/records", params={"kind": "report"}).json()["records"]
        assert reports == [], reports
        made = {x["name"] for x in c.get("/reef/scenarios").json()["scenarios"]} - before
        assert made <= {"hs-escape", "hs-escape-episodes"}, made


def test_a_scoped_token_samples_its_scenario_only_and_ends_with_revoke_or_expiry(world: dict[str, Any]) -> None:  # noqa: F811
    d: Daemon = world["daemon"]
    receipt = victim(d)
    own = "hs-scoped-episodes"
    with d.http() as c:
        c.post("/reef/scenarios", json={"name": own, "recipe": "record", "model": "agent"})
    chat = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}
    with d.http() as c:  # a day at most (the route and ``Scopes.mint`` both say so)
        for ttl in (86_401, 86_400.5, 0):
            r = c.post("/reef/tokens", json={"scenario": own, "ttl_s": ttl})
            assert assert_canonical_error(r, 400)["param"] == "ttl_s", (ttl, r.text)
    assert scoped_token(d, own, ttl_s=86_400)
    token = scoped_token(d, own)
    scoped = httpx.Client(base_url="http://localhost", transport=httpx.HTTPTransport(uds=str(d.home / "scoped.sock")),
                          timeout=60)
    tcp = httpx.Client(base_url=d.url, timeout=60)
    auth = {"Authorization": f"Bearer {token}"}
    with scoped, tcp:
        for client in (scoped, tcp):  # the same scope on the scoped socket and on the main TCP port
            assert client.post(f"/s/{own}/v1/chat/completions", json=chat, headers=auth).status_code == 200
            assert client.post("/v1/chat/completions", json=chat, headers=auth).status_code == 403  # default
            assert client.post(f"/s/{VICTIM}/v1/chat/completions", json=chat, headers=auth).status_code == 403
            started = client.post("/reef/runs", json={"adapter": "pi", "scenario": own}, headers=auth)
            assert started.status_code == 201, started.text
            run = started.json()["run"]
            assert client.get("/reef/records", params={"run": run}, headers=auth).status_code == 200
            for method, path, body in (
                    ("GET", "/reef/scenarios", None), ("GET", f"/reef/records/{receipt}", None),
                    ("GET", "/reef/records", None), ("GET", "/reef/records?run=run_not-mine", None),
                    ("GET", f"/reef/records?run={run}&scenario={VICTIM}", None),
                    ("GET", f"/reef/scenarios/{own}/records", None), ("GET", "/reef/status", None),
                    ("POST", "/reef/runs", {"adapter": "pi", "scenario": VICTIM}),
                    ("POST", "/reef/report", {"score": 1, "references": [receipt]}),
                    ("POST", "/reef/tokens", {"scenario": VICTIM})):
                r = client.request(method, path, json=body, headers=auth)
                assert r.status_code == 403, (client, method, path, r.text)
                assert r.json()["error"]["type"] == "permission_error" and SECRET not in r.text
        # the full token is no use on the scoped socket; no token is no use anywhere
        full = {"Authorization": f"Bearer {d.token}"}
        assert scoped.get("/reef/scenarios", headers=full).status_code == 401
        assert scoped.post(f"/s/{own}/v1/chat/completions", json=chat).status_code == 401
        assert tcp.get("/reef/scenarios", headers=full).status_code == 200
        # revoked: refused at once, on both
        with d.http() as c:
            assert c.post("/reef/tokens/revoke", json={"token": token}).json() == {"revoked": True}
        for client in (scoped, tcp):
            r = client.post(f"/s/{own}/v1/chat/completions", json=chat, headers=auth)
            assert r.status_code == 401, r.text
        # expired: refused after its deadline without anyone revoking it
        short = {"Authorization": f"Bearer {scoped_token(d, own, ttl_s=1)}"}
        assert scoped.post(f"/s/{own}/v1/chat/completions", json=chat, headers=short).status_code == 200
        time.sleep(1.2)
        assert scoped.post(f"/s/{own}/v1/chat/completions", json=chat, headers=short).status_code == 401


def test_scopes_allow_one_scenario_and_forget_tokens() -> None:
    """The scope's rules without a daemon (a fake clock)."""
    now = [100.0]
    scopes = Scopes(clock=lambda: now[0])
    token = scopes.mint("a", 10)
    scope = scopes.get(token)
    assert isinstance(scope, Scope) and scope.scenario == "a"
    assert scopes.get(token + "x") is None and scopes.get("reef-not-scoped") is None
    allow = scope.refusal
    assert allow("POST", "/s/{scenario}/v1/chat/completions", {"scenario": "a"}, {}) is None
    assert allow("HEAD", "/s/{scenario}", {"scenario": "a"}, {}) is None
    assert allow("POST", "/s/{scenario}/r/{run}/v1/messages", {"scenario": "b", "run": "r"}, {}) is not None
    assert allow("POST", "/v1/chat/completions", {}, {}) is not None
    assert allow("POST", "/reef/runs", {}, {}) is None  # its body is checked when served
    scope.runs.add("run_1")
    assert allow("GET", "/reef/records", {}, {"run": "run_1"}) is None
    assert allow("GET", "/reef/records", {}, {"run": "run_1", "scenario": "b"}) is not None
    assert allow("GET", "/reef/records", {}, {"run": "run_2"}) is not None
    assert allow("GET", "/reef/records", {}, {"scenario": "a"}) is not None
    assert allow("GET", "/reef/scenarios/{name}/records", {"name": "a"}, {}) is not None
    assert allow("POST", "/reef/scenarios/{name}/evolve", {"name": "a"}, {}) is not None
    now[0] = 109.9
    assert scopes.get(token) is scope
    now[0] = 110.0
    assert scopes.get(token) is None and len(scopes) == 0  # expired, and forgotten
    other = scopes.mint("a", 10)
    assert scopes.revoke(other) and scopes.get(other) is None and not scopes.revoke(other)
    with pytest.raises(ValueError):
        scopes.mint("a", 0)
    with pytest.raises(ValueError):  # a day at most
        scopes.mint("a", 86_401)
    day = scopes.mint("a", 86_400)
    assert scopes.get(day) is not None
    now[0] += 86_400
    assert scopes.get(day) is None

    class Req:  # a routed request, as the dispatcher hands it over
        method, route, match_info, query = "POST", "/reef/runs", {}, {}

    async def body(_: Any) -> Any:
        return {"adapter": "pi", "scenario": "b"}

    async def handler(_: Any) -> Any:
        raise AssertionError("served")

    fresh = Scopes()
    served = fresh.get(fresh.mint("a", 5))
    assert served is not None
    with pytest.raises(Forbidden, match="runs of scenario 'a' only"):
        asyncio.run(served.serve(Req(), handler, body))


SECRET_FILES = {".claude/settings.json": "claude-secret", ".config/gh/hosts.yml": "gh-secret",
                ".bash_history": "history-secret", "project/notes.txt": "project-secret"}


def test_the_sandbox_binds_an_allow_list_so_the_users_files_stay_out(tmp_path: Path) -> None:
    """A user's files outside the allow-list (a fake home beside the real one: ~/.claude, ~/.config, history, a
    project) and the daemon's home are not there at all; Python, Reef and the workspace are."""
    from recipes.harness_search import sandbox
    from recipes.harness_search.episodes import _env

    user = Path.home() / f".reef-sandbox-probe-{os.getpid()}"  # a host path no allow-list entry covers
    reef_home = Path(tempfile.mkdtemp(prefix="reef-home-", dir=Path.home()))
    (reef_home / "token").write_text("reef-full-token\n")
    for rel, text in SECRET_FILES.items():
        (user / rel).parent.mkdir(parents=True, exist_ok=True)
        (user / rel).write_text(text)
    ws = tmp_path / "ws"
    ws.mkdir()
    try:
        probe = ("import json, os, sys\n"
                 "paths = sys.argv[1:]\n"
                 "print(json.dumps({p: os.path.exists(p) for p in paths}))\n"
                 "import daemon.scopes, recipes.harness_search.inside\n")
        paths = [str(user / rel) for rel in SECRET_FILES] + [str(reef_home / "token"), str(user)]
        cmd = sandbox.argv([sys.executable, "-c", probe, *paths], workspace=ws, env=_env(), hide=[str(reef_home)])
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert got.returncode == 0, got.stderr  # Python and Reef's modules are there
        seen = json.loads(got.stdout)
        assert not any(seen.values()), seen
        assert str(ROOT) in sandbox.allowed() and not any(p.startswith(str(Path.home()) + "/.reef-") for p in
                                                          sandbox.allowed())
    finally:
        shutil.rmtree(user, ignore_errors=True)
        shutil.rmtree(reef_home, ignore_errors=True)


def test_an_episode_runs_when_reefs_interpreter_lives_under_tmp(world: dict[str, Any]) -> None:  # noqa: F811
    """Issue 26: a Python under /tmp (here a venv made there, its packages through a .pth file, as an editable or
    layered install has them) runs the episode; the sandbox's fresh /tmp used to hide it and every episode ended
    ``error``."""
    d: Daemon = world["daemon"]
    venv = Path(tempfile.mkdtemp(prefix="reef-tmp-python-", dir="/tmp")) / "venv"
    try:
        subprocess.run([sys.base_prefix + "/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True,
                       timeout=120)
        site = next(venv.glob("lib/python3*/site-packages"))
        deps = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
        (site / "reef-deps.pth").write_text("\n".join(deps) + "\n")
        name = "hs-tmp-python-episodes"
        with d.http() as c:
            c.post("/reef/scenarios", json={"name": name, "recipe": "record", "model": "agent"})
        env = episode_env(world, name)
        greet = Task("greet", "Write the greeting into answer.txt.", 'test "$(cat answer.txt)" = hello',
                     workspace=str(world["template"]))
        runner = ("import asyncio, json, sys\n"
                  "from pathlib import Path\n"
                  "from recipes.harness_search.episodes import EpisodeEnv, Task, run_episode\n"
                  "a = json.loads(sys.argv[1])\n"
                  "env = EpisodeEnv(**{k: Path(v) if k in ('socket', 'agents_dir', 'home') else v\n"
                  "                    for k, v in a['env'].items()})\n"
                  "assert sys.prefix.startswith('/tmp/'), sys.prefix\n"
                  "ep = asyncio.run(run_episode(Task(**a['task']), {}, env, side='candidate', repeat=0))\n"
                  "print(json.dumps(ep.to_dict()))\n")
        arg = {"env": {"socket": str(env.socket), "port": env.port, "scenario": env.scenario, "token": env.token,
                       "agents_dir": str(env.agents_dir), "home": str(env.home)},
               "task": {"id": greet.id, "prompt": greet.prompt, "check": greet.check, "workspace": greet.workspace}}
        got = subprocess.run([str(venv / "bin" / "python"), "-c", runner, json.dumps(arg)], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert got.returncode == 0, got.stderr
        ep = json.loads(got.stdout.strip().splitlines()[-1])
        assert ep["status"] == "passed", ep
        with d.http() as c:
            assert c.get("/reef/records", params={"run": ep["run"], "kind": "exchange"}).json()["records"]
    finally:
        shutil.rmtree(venv.parent, ignore_errors=True)
