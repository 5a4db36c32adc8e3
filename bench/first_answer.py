"""From ``./install.sh`` to the first real answer on a fresh home (issue 23): the README's first quick-start command,
timed phase by phase, against a baseline measured in the same run (a bare venv with only the pinned torch: the
floor any install of a PyTorch program pays here).

A clean checkout of this repository's HEAD (``git clone``), a fresh ``HOME`` and ``REEF_HOME`` (no config, no
model), pip's cache off (``PIP_NO_CACHE_DIR=1``: what a fresh machine downloads, it downloads; the pinned torch
comes from this machine's wheel directory as it does for every install here). Then:

1. ``./install.sh --venv V --bin-dir B`` (the default install: Reef, torch, the SmolLM2 conversion);
2. ``B/reef serve`` until ``/healthz`` answers, then until SmolLM2 is loaded;
3. the first answer from ``smollm2`` through the OpenAI chat API (temperature 0, one sentence).

Prints each phase's seconds, the whole, the answer verbatim and the ratio of the install to the torch-only
baseline. Run: ``python bench/first_answer.py`` (about 5-10 minutes; needs the network for PyPI).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France? Answer in one sentence."


def env_for(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REEF_", "VIRTUAL_ENV", "PYTHON", "PIP_CACHE"))}
    env.update(HOME=str(home), REEF_HOME=str(home / ".reef"), PIP_NO_CACHE_DIR="1")
    return env


def timed(args: list[str], env: dict[str, str], cwd: Path, log: Path) -> float:
    t0 = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(args, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"{' '.join(args[:2])} failed ({done.returncode}); its output: {log}")
    return time.perf_counter() - t0


def get(url: str, token: str | None = None, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="reef-first-answer-"))
    try:
        measure(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure(tmp: Path) -> None:
    src, home = tmp / "reef", tmp / "home"
    home.mkdir()
    subprocess.run(["git", "clone", "-q", str(ROOT), str(src)], check=True)
    env = env_for(home)
    print(f"a clean clone of {subprocess.check_output(['git', '-C', str(ROOT), 'rev-parse', '--short', 'HEAD'], text=True).strip()}"
          f", a fresh home, pip's cache off; load average {os.getloadavg()[0]:.1f}", flush=True)

    base = timed([sys.executable, "-c", "import subprocess, sys, venv; venv.create(sys.argv[1], with_pip=True); "
                  "subprocess.run([sys.argv[1] + '/bin/pip', 'install', '-q', 'torch==2.13.0'], check=True)",
                  str(tmp / "torch-only")], env, tmp, tmp / "baseline.log")
    print(f"baseline: a venv with torch==2.13.0 alone     {base:6.1f} s", flush=True)

    venv, bindir = home / ".local/share/reef/venv", home / ".local/bin"
    install = timed(["bash", "./install.sh", "--venv", str(venv), "--bin-dir", str(bindir)], env, src,
                    tmp / "install.log")
    print(f"./install.sh (Reef, torch, SmolLM2 made)      {install:6.1f} s", flush=True)

    with socket.socket() as sock:  # a free port, the one setting made: everything else is the defaults
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (home / ".reef").mkdir(exist_ok=True)
    (home / ".reef" / "config.toml").write_text(f"port = {port}\n")
    t0 = time.perf_counter()
    serve = subprocess.Popen([str(bindir / "reef"), "serve"], env=env, cwd=home, stdout=subprocess.DEVNULL,
                             stderr=(tmp / "serve.log").open("w"), start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        health: dict = {}
        healthy = loaded = None
        while time.perf_counter() - t0 < 600:
            if serve.poll() is not None:
                sys.exit(f"reef serve exited {serve.returncode}; its log: {tmp / 'serve.log'}")
            try:
                health = get(f"{url}/healthz")
            except OSError:
                time.sleep(0.05)
                continue
            healthy = healthy or time.perf_counter() - t0
            if "smollm2" in (health.get("models") or {}).get("loaded", []):
                loaded = time.perf_counter() - t0
                break
            time.sleep(0.05)
        if loaded is None:
            sys.exit(f"SmolLM2 not loaded in 600 s: {health}")
        token = (home / ".reef" / "token").read_text().strip()
        t1 = time.perf_counter()
        answer = get(f"{url}/v1/chat/completions", token, {
            "model": "smollm2", "temperature": 0, "max_tokens": 40,
            "messages": [{"role": "user", "content": QUESTION}]})
        first = time.perf_counter() - t1
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(timeout=60)
    text = answer["choices"][0]["message"]["content"]
    print(f"reef serve: /healthz answers                  {healthy:6.1f} s after launch")
    print(f"reef serve: SmolLM2 loaded                    {loaded:6.1f} s after launch")
    print(f"the first answer                              {first:6.1f} s")
    print(f"from ./install.sh to the first answer         {install + loaded + first:6.1f} s")
    print(f"ratio: ./install.sh / the torch-only venv     {install / base:6.2f}x")
    print(f"load average at the end {os.getloadavg()[0]:.1f} (1 min), {os.getloadavg()[2]:.1f} (15 min)")
    print(f"Q: {QUESTION}\nA: {text}")


if __name__ == "__main__":
    main()
