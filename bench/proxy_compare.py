"""This project's daemon side by side with the original Reef and LiteLLM's proxy, as recording proxies in front of
an upstream that answers at once.

In one run, with one client and one upstream (both from ``bench/proxy_overhead.py``: an aiohttp + uvloop upstream
answering from memory in its own process, a lean aiohttp client with keep-alive connections), each side gets the
same requests:

- ``direct``: the client talks to the upstream itself (the floor);
- ``reef``: this project's daemon, one ``upstream`` model (durable record and receipt per answer);
- ``original``: the original Reef, PyPI ``reef-infra`` (``reef serve -c stack.yaml`` with the core record-only
  ``recipe`` and ``reef.upstream_url``, as its ``recipes/basic/external-provider.yaml``; every exchange, request and
  answer, is a row in a per-scenario SQLite file, WAL with ``synchronous = FULL``; receipt header
  ``x-reef-agent-record-id``; it needs the ``git-lfs`` system package for its artifact store);
- ``litellm``: LiteLLM's proxy (PyPI ``litellm[proxy]``, ``litellm --config cfg.yaml``, one ``openai/`` model on the
  upstream's api_base, a master key, no database: it records nothing durably), with its telemetry off and every
  remote file it would fetch (cost map, beta headers, blog posts, presets) read from its package instead; an
  unreachable HTTP(S) proxy for everything but 127.0.0.1 catches anything missed.

Figures, each measured in alternating rounds (direct, reef, original, litellm, then the reverse, ...) so that a
drift in the machine's load falls on every side alike:

1. added latency at concurrency 1, non-streaming: p50 / p99 against direct;
2. throughput at concurrency 16 (req/s), with ratios to direct and between the proxies, and the CPU per request of
   each proxy's processes (its process tree, from /proc) and its resident memory at the end;
3. added time to first streamed content chunk at concurrency 1, p50.

The competitors install on first use into their own virtual environments under ``--venvs`` (default
``~/.cache/reef-bench/``) with ``python3.11 -m venv`` and that venv's pip; a side that fails to install, start or
answer is printed as ``failed: <reason>`` and the others still run. LiteLLM's pin is 1.106.12: the newest release
whose ``[proxy]`` extra resolves on the package index this was written on (1.110.2's needs ``litellm-proxy``, not
on that index); ``--litellm`` changes it.

Run: ``.venv/bin/python bench/proxy_compare.py [--only reef,original,litellm] [--requests N]`` (about a
minute; the first run installs the competitors first, two minutes more).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import proxy_overhead as po  # noqa: E402

ORIGINAL = "reef-infra==0.0.2"
LITELLM = "1.106.12"
SIDES = ("reef", "original", "litellm")
LITELLM_KEY = "sk-bench"
ORIGINAL_TOKEN = "bench-token"
# LiteLLM fetches these from GitHub and its docs site unless told to read its packaged copies
LITELLM_OFFLINE = {"LITELLM_TELEMETRY": "False", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                   "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True", "LITELLM_LOCAL_BLOG_POSTS": "True",
                   "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True", "LITELLM_LOCAL_POLICY_TEMPLATES": "True"}
NO_NETWORK = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1",
              "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "no_proxy": "127.0.0.1",
              "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}


class Failed(Exception):
    """A side could not be installed, started or measured: printed as ``failed: <reason>``, never scored."""


@dataclass
class Side:
    name: str
    version: str = ""
    records: str = ""
    target: po.Target | None = None
    proc: subprocess.Popen[bytes] | None = None
    ready_url: str = ""
    log: Path | None = None
    failed: str | None = None
    lat: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    tput_n: int = 0
    tput_s: float = 0.0
    cpu_s: float = 0.0
    rates: list[float] = field(default_factory=list)
    rss_mb: float = 0.0

    def fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = " ".join(why.split())[:300]
            print(f"[{self.name}] failed: {self.failed}", file=sys.stderr)


# --- installing and starting the competitors --------------------------------------------------------------------


def clean_env(offline: bool = True, **extra: str) -> dict[str, str]:
    """This environment without Reef's, LiteLLM's and the providers' variables; ``offline``: for a competitor's run,
    with nothing but 127.0.0.1 reachable through HTTP(S) clients that honour proxy variables (pip needs the network)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REEF_", "LITELLM_", "OPENAI_", "ANTHROPIC_"))}
    env.pop("PYTHONPATH", None)
    env.update(NO_NETWORK if offline else {}, **extra)
    return env


def ensure_venv(root: Path, name: str, spec: str, python: str) -> Path:
    """``root/name``, a virtual environment with ``spec`` installed (once: a marker file names what is there)."""
    venv = root / name
    marker = venv / ".reef-bench-installed"
    if marker.exists() and marker.read_text() == spec:
        return venv
    if shutil.which(python) is None:
        raise Failed(f"{python} not found (pass --python)")
    shutil.rmtree(venv, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    print(f"[{name}] installing {spec} into {venv} (once) ...", file=sys.stderr)
    for cmd in ([python, "-m", "venv", str(venv)],
                [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", spec]):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=clean_env(offline=False))
        except subprocess.TimeoutExpired as e:
            raise Failed(f"{' '.join(cmd[:4])} timed out") from e
        if r.returncode != 0:
            lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip() and "is ignored" not in ln]
            errors = [ln for ln in lines if ln.startswith("ERROR")] or lines
            raise Failed(f"install of {spec}: " + " | ".join(errors[-2:]))
    marker.write_text(spec)
    return venv


def dist_version(venv: Path, dist: str) -> str:
    r = subprocess.run([str(venv / "bin" / "python"), "-c",
                        f"import importlib.metadata as m, sys; print(m.version({dist!r}), sys.version.split()[0])"],
                       capture_output=True, text=True, env=clean_env())
    v, _, py = r.stdout.strip().partition(" ")
    return f"{dist} {v}, Python {py}" if r.returncode == 0 else dist


def popen(cmd: list[str], log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:  # the child keeps its own copy
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)


def start_original(side: Side, venv: Path, home: Path, port: int, up_port: int) -> None:
    git = subprocess.run(["git", "lfs", "version"], capture_output=True) if shutil.which("git") else None
    if git is None or git.returncode != 0:
        raise Failed("git-lfs is not installed (the original Reef's artifact store needs it: apt-get install git-lfs)")
    home.mkdir()
    py = venv / "bin" / "python"
    probe = f"import urllib.request as u; u.urlopen('http://127.0.0.1:{port}/healthz', timeout=2)"
    stack = {
        "run_dir": str(home / "run"),
        "ready_timeout": 120,
        "reef": {"host": "127.0.0.1", "port": port, "recipe": "recipe", "token": ORIGINAL_TOKEN,
                 "upstream_url": f"http://127.0.0.1:{up_port}", "upstream_model": "bench-upstream",
                 "artifact_repository": str(home / "artifacts.git"), "artifact_work_dir": str(home / "artifact-work"),
                 "artifact_cache_dir": str(home / "artifact-cache"), "agent_record_dir": str(home / "agent-record")},
        "services": [{"name": "reef", "command": f"{py} -m reef.service", "ready": f'{py} -c "{probe}"'}],
    }
    (home / "stack.yaml").write_text(json.dumps(stack, indent=1))  # JSON is YAML
    side.log = home / "serve.log"
    side.proc = popen([str(venv / "bin" / "reef"), "serve", "-c", str(home / "stack.yaml")], side.log,
                      clean_env(), home)
    side.ready_url = f"http://127.0.0.1:{port}/healthz"
    side.target = po.Target("original", f"http://127.0.0.1:{port}/v1/chat/completions",
                            {"Content-Type": "application/json", "Authorization": f"Bearer {ORIGINAL_TOKEN}",
                             "x-reef-scenario": "bench"})
    side.version = dist_version(venv, "reef-infra")
    side.records = "SQLite row per exchange (request + answer), WAL, synchronous=FULL; receipt"


def start_litellm(side: Side, venv: Path, home: Path, port: int, up_port: int) -> None:
    home.mkdir()
    cfg = {"model_list": [{"model_name": "bench", "litellm_params": {
               "model": "openai/bench-upstream", "api_base": f"http://127.0.0.1:{up_port}/v1", "api_key": "none"}}],
           "general_settings": {"master_key": LITELLM_KEY},
           "litellm_settings": {"telemetry": False}}
    (home / "cfg.yaml").write_text(json.dumps(cfg, indent=1))
    side.log = home / "litellm.log"
    side.proc = popen([str(venv / "bin" / "litellm"), "--config", str(home / "cfg.yaml"), "--host", "127.0.0.1",
                       "--port", str(port)], side.log, clean_env(**LITELLM_OFFLINE), home)
    side.ready_url = f"http://127.0.0.1:{port}/health/liveliness"
    side.target = po.Target("litellm", f"http://127.0.0.1:{port}/v1/chat/completions",
                            {"Content-Type": "application/json", "Authorization": f"Bearer {LITELLM_KEY}"})
    side.version = dist_version(venv, "litellm")
    side.records = "nothing durable (no database configured)"


def start_ours(side: Side, home: Path, port: int, up_port: int) -> None:
    home.mkdir()
    side.proc = po.start_reef(home, port, up_port)
    side.log = home / "logs" / "daemon.log"
    token = po.reef_token(home, side.proc)
    side.ready_url = f"http://127.0.0.1:{port}/healthz"
    side.target = po.Target("reef", f"http://127.0.0.1:{port}/v1/chat/completions",
                            {"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    describe = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                              text=True).stdout.strip()
    side.version = f"this project {describe or '?'}, Python {sys.version.split()[0]}"
    side.records = "durable record per exchange (SQLite); receipt"


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM to the side's own process group where it has one (a competitor's children too), SIGKILL after 30 s."""
    if proc is None or proc.poll() is not None:
        return
    own_group = os.getpgid(proc.pid) == proc.pid

    def send(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig) if own_group else proc.send_signal(sig)

    send(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()


# --- measuring ----------------------------------------------------------------------------------------------------


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_cpu_s(pid: int) -> float:
    total = 0.0
    for p in tree(pid):
        try:
            total += po.cpu_s(p)
        except OSError:
            pass
    return total


def tree_rss_mb(pid: int) -> float:
    total = 0
    for p in tree(pid):
        try:
            total += next(int(ln.split()[1]) for ln in Path(f"/proc/{p}/status").read_text().splitlines()
                          if ln.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


async def wait_ready(side: Side, session: aiohttp.ClientSession, timeout: float = 180) -> None:
    assert side.proc is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if side.proc.poll() is not None:
            tail = side.log.read_text(errors="replace")[-600:] if side.log and side.log.exists() else ""
            raise Failed(f"exited ({side.proc.returncode}): {tail}")
        try:
            async with session.get(side.ready_url) as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise Failed(f"not ready after {timeout:.0f} s")


async def smoke(side: Side, session: aiohttp.ClientSession) -> None:
    """One answer and one stream, checked: the right text back, and whether a receipt came with it."""
    assert side.target is not None
    async with session.post(side.target.url, data=json.dumps(po.REQUEST), headers=side.target.headers) as r:
        body = await r.read()
        if r.status != 200 or po.TEXT.encode() not in body:
            raise Failed(f"HTTP {r.status}: {body[:200]!r}")
        if side.name in ("reef", "original") and "x-reef-agent-record-id" not in r.headers:
            side.records += " (but no receipt came back!)"
    await side.target.first_token(session, json.dumps({**po.REQUEST, "stream": True}).encode())


async def guarded(side: Side, what: str, coro: object) -> object:
    try:
        return await coro  # type: ignore[misc]
    except (Exception, SystemExit) as e:  # Target raises SystemExit on a non-200 answer
        side.fail(f"{what}: {type(e).__name__}: {e}")
        return None


def in_turn(sides: list[Side], r: int) -> list[Side]:
    live = [s for s in sides if s.failed is None]
    return live if r % 2 == 0 else live[::-1]


async def measure(sides: list[Side], session: aiohttp.ClientSession, n: int, rounds: int, per_round: int) -> None:
    for s in in_turn(sides, 0):  # warm up: connections, caches, a scenario's first record
        await guarded(s, "warm-up", po.latency(s.target, session, 50))  # type: ignore[arg-type]
        await guarded(s, "warm-up", po.ttft(s.target, session, 20))  # type: ignore[arg-type]
    for r in range(rounds):
        for s in in_turn(sides, r):
            got = await guarded(s, "latency", po.latency(s.target, session, max(n // rounds, 1)))  # type: ignore
            s.lat += got or []  # type: ignore[operator]
    for r in range(rounds):
        for s in in_turn(sides, r):
            cpu0 = tree_cpu_s(s.proc.pid) if s.proc else 0.0
            t0 = time.perf_counter()
            rate = await guarded(s, "throughput", po.throughput(s.target, session, per_round, 16))  # type: ignore
            if rate is not None:
                s.tput_s += time.perf_counter() - t0
                s.tput_n += per_round
                s.rates.append(rate)  # type: ignore[arg-type]
                s.cpu_s += (tree_cpu_s(s.proc.pid) - cpu0) if s.proc else 0.0
    for s in in_turn(sides, 0):
        s.rss_mb = tree_rss_mb(s.proc.pid) if s.proc else 0.0
    for r in range(rounds):
        for s in in_turn(sides, r):
            got = await guarded(s, "ttft", po.ttft(s.target, session, max(n // 2 // rounds, 1)))  # type: ignore
            s.first += got or []  # type: ignore[operator]


# --- the run ------------------------------------------------------------------------------------------------------


def report(sides: list[Side], n: int, rounds: int, per_round: int, load: tuple[float, float]) -> None:
    by = {s.name: s for s in sides}
    d = by["direct"]
    if d.failed or not d.lat:
        raise SystemExit(f"direct failed: {d.failed}")
    ms = 1e3
    dp50, dp99 = statistics.median(d.lat) * ms, po.pct(d.lat, 0.99) * ms
    drate = d.tput_n / d.tput_s
    dttft = statistics.median(d.first) * ms
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {load[0]:.2f} -> {load[1]:.2f} on "
          f"{os.cpu_count()} CPUs; latency {n} requests, throughput {rounds} x {per_round} per side at c=16, "
          f"ttft {rounds * max(n // 2 // rounds, 1)}; rounds alternate between sides")
    for s in sides:
        print(f"  {s.name:9} {s.version or '-'}" + (f"; records: {s.records}" if s.records else ""))
    print()
    print(f"{'':9} | {'c=1 p50':>8} {'p99':>7} {'adds p50':>9} {'p99':>7} | {'c=16 req/s':>10} {'of direct':>9}"
          f" | {'ttft p50':>8} {'adds':>7} | {'CPU/req':>8} {'RSS':>6}")
    fig: dict[str, dict[str, float]] = {}
    for s in sides:
        if s.failed or not (s.lat and s.first and s.tput_n):
            print(f"{s.name:9} | failed: {s.failed or 'no figures'}")
            continue
        p50, p99 = statistics.median(s.lat) * ms, po.pct(s.lat, 0.99) * ms
        rate = s.tput_n / s.tput_s
        f50 = statistics.median(s.first) * ms
        cpu = s.cpu_s * ms / s.tput_n
        fig[s.name] = {"add50": p50 - dp50, "add99": p99 - dp99, "rate": rate, "ttft": f50 - dttft, "cpu": cpu}
        adds = "" if s is d else f"{p50 - dp50:+9.3f} {p99 - dp99:+7.3f}"
        cpu_txt = "" if s is d else f"{cpu:6.3f}ms {s.rss_mb:4.0f}MB"
        print(f"{s.name:9} | {p50:6.3f}ms {p99:5.3f}ms {adds:17} | {rate:10.0f} {rate / drate:9.2f} | "
              f"{f50:6.3f}ms {'' if s is d else f'{f50 - dttft:+7.3f}':7} | {cpu_txt}")
    print()

    def less(mine: float, theirs: float, unit: str = " ms") -> str:
        return f"{theirs / mine:.1f}x less" if mine > 0.005 and theirs > 0 else f"{mine:+.3f} vs {theirs:+.3f}{unit}"

    for one, other in (("reef", "original"), ("reef", "litellm"), ("original", "litellm")):
        if one not in fig or other not in fig:
            continue
        me, o = fig[one], fig[other]
        per_round = " ".join(f"{a / b:.2f}" for a, b in zip(by[one].rates, by[other].rates, strict=False))
        print(f"{one} vs {other}: added latency p50 {less(me['add50'], o['add50'])}, p99 {less(me['add99'], o['add99'])};"
              f" throughput {me['rate'] / o['rate']:.2f}x (per round {per_round});"
              f" added ttft {less(me['ttft'], o['ttft'])}; CPU per request {less(me['cpu'], o['cpu'], '')}")

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SIDES), help="comma-separated sides to run besides direct: "
                    + ",".join(SIDES))
    ap.add_argument("--venvs", default=str(Path.home() / ".cache" / "reef-bench"),
                    help="where the competitors' virtual environments live (default ~/.cache/reef-bench)")
    ap.add_argument("--python", default="python3.11", help="the interpreter the competitors' venvs are made with")
    ap.add_argument("--original", default=ORIGINAL, help=f"pip spec of the original Reef (default {ORIGINAL})")
    ap.add_argument("--litellm", default=LITELLM, help=f"LiteLLM version (default {LITELLM})")
    ap.add_argument("--requests", type=int, default=500, help="latency requests per side (ttft: half)")
    ap.add_argument("--per-round", type=int, default=400, help="throughput requests per side and round")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    if unknown := set(only) - set(SIDES):
        raise SystemExit(f"--only: unknown side(s) {', '.join(sorted(unknown))}; choose from {', '.join(SIDES)}")
    venvs = Path(args.venvs).expanduser()
    sides = [Side("direct")] + [Side(name) for name in SIDES if name in only]
    home = Path(tempfile.mkdtemp(prefix="reef-compare-", dir="/tmp"))
    up_port = po.free_port()
    upstream = subprocess.Popen([sys.executable, po.__file__, "--serve-upstream", str(up_port)],
                                start_new_session=True)
    sides[0].target = po.Target("direct", f"http://127.0.0.1:{up_port}/v1/chat/completions",
                                {"Content-Type": "application/json"})
    sides[0].version = "the instant upstream (aiohttp + uvloop)"
    try:
        for s in sides[1:]:
            try:
                if s.name == "reef":
                    start_ours(s, home / "reef", po.free_port(), up_port)
                elif s.name == "original":
                    venv = ensure_venv(venvs, "original", args.original, args.python)
                    start_original(s, venv, home / "original", po.free_port(), up_port)
                else:
                    venv = ensure_venv(venvs, "litellm", f"litellm[proxy]=={args.litellm}", args.python)
                    start_litellm(s, venv, home / "litellm", po.free_port(), up_port)
            except (Failed, OSError, SystemExit) as e:
                s.fail(str(e))
        import uvloop

        uvloop.run(run(sides, upstream, up_port, args))
    finally:
        for s in sides:
            stop(s.proc)
        stop(upstream)
        shutil.rmtree(home, ignore_errors=True)


async def run(sides: list[Side], upstream: subprocess.Popen[bytes], up_port: int, args: argparse.Namespace) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        await po.wait_up(session, f"http://127.0.0.1:{up_port}/", upstream, "upstream")
        for s in sides:
            if s.failed is None and s.proc is not None:
                await guarded(s, "start", wait_ready(s, session))
            if s.failed is None:
                await guarded(s, "first request", smoke(s, session))
        load0 = os.getloadavg()[0]
        await measure(sides, session, args.requests, args.rounds, args.per_round)
        report(sides, args.requests, args.rounds, args.per_round, (load0, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
