"""Release chains shared through a git remote: time from a publish on one daemon to the first answer from that
release on the other.

Two daemons (two homes, two ports, as if on two machines) share a bare repository as ``chain_remote`` (a path
remote, with its LFS store beside the objects). Daemon A publishes (a rollback through its HTTP API, alternating
between two weights releases of the tiny model, so each publish changes what is served); a client of daemon B
sends one short request after another, and we time from A's answer to the publish until B's first answer that
names the new release. That time is B's follow interval (``chain_fetch_s``: on average half of it is waited),
one ``git fetch`` of the new commit and the local head update; the weights' LFS object is copied once (the first
time B meets that content), after which the engine serves both contents from its resident loads.

Run: ``.venv/bin/python bench/remote_follow.py [--rounds N] [--fetch-s 0.5,2]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BODY = {"model": "tiny", "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(home: Path, model: Path, remote: Path, fetch_s: float) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    (home / "logs").mkdir(parents=True)
    (home / "config.toml").write_text(
        f'port = {port}\nchain_remote = "{remote}"\nchain_fetch_s = {fetch_s}\n\n'
        f'[models.tiny]\nengine = "transformers"\npath = "{model}"\n')
    env = dict(os.environ, REEF_HOME=str(home), PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    log = open(home / "logs" / "daemon.log", "ab")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen([sys.executable, "-m", "daemon", "--log-file"], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited: {(home / 'logs' / 'daemon.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url, (home / "token").read_text().strip()
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit("daemon did not start")


def run(fetch_s: float, rounds: int, model: Path, variant: Path) -> list[float]:
    from daemon.chain_remote import ChainRemote
    from daemon.releases import ReleaseStore, files_from_dir

    tmp = Path(tempfile.mkdtemp(prefix="reef-follow-", dir="/tmp"))
    remote = tmp / "chains.git"
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
    procs = []
    try:
        pa, ua, ta = start(tmp / "a", model, remote, fetch_s)
        procs.append(pa)
        pb, ub, tb = start(tmp / "b", model, remote, fetch_s)
        procs.append(pb)
        a = httpx.Client(base_url=ua, headers={"Authorization": f"Bearer {ta}"}, timeout=60)
        b = httpx.Client(base_url=ub, headers={"Authorization": f"Bearer {tb}"}, timeout=60)
        init = a.post("/s/bench/v1/chat/completions", json=BODY).headers["x-reef-release-id"]
        store = ReleaseStore(tmp / "a" / "artifacts.git",
                             remote=ChainRemote(tmp / "a" / "artifacts.git", str(remote)))
        other = store.publish("bench", files_from_dir(variant), expected_head=init, operation="train",
                              kind="weights", recipe="record").release_id
        times = []
        head, sources = other, [init, other]
        for i in range(rounds + 1):  # the first round warms B up (LFS copy, load): not counted
            if i:
                r = a.post("/reef/scenarios/bench/rollback",
                           json={"release_id": sources[i % 2], "expected_head": head})
                r.raise_for_status()
                head = r.json()["release_id"]
            t0 = time.perf_counter()
            deadline = time.monotonic() + 120
            while b.post("/s/bench/v1/chat/completions", json=BODY).headers["x-reef-release-id"] != head:
                if time.monotonic() > deadline:
                    raise SystemExit(f"daemon B never served {head}")
            if i:
                times.append(time.perf_counter() - t0)
        return times
    finally:
        for p in procs:
            p.terminate()
            p.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--fetch-s", default="0.5,2")
    args = ap.parse_args()
    from daemon.models import init_tiny

    work = Path(tempfile.mkdtemp(prefix="reef-follow-models-"))
    try:
        model = init_tiny(work / "tiny", seed=0)
        variant = init_tiny(work / "tiny-1", seed=1)
        for fetch_s in (float(x) for x in args.fetch_s.split(",")):
            t = sorted(run(fetch_s, args.rounds, model, variant))
            print(f"chain_fetch_s={fetch_s}: publish on A -> first answer from it on B, {len(t)} rounds: "
                  f"median {statistics.median(t):.3f} s, min {t[0]:.3f} s, max {t[-1]:.3f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
