"""A separate process that publishes on a release chain, for the multi-process tests in test_releases.py.

release_worker.py contend REPO SCENARIO WORKER START_AT ROUNDS PERIOD LOCK_TIMEOUT
    At START_AT + r * PERIOD (wall clock) for each round r: read the head, publish with it as the expected
    head, print one JSON line {worker, round, read, outcome: win|head_moved|lock_busy, release_id}.
release_worker.py loop REPO SCENARIO READY
    Publish forever (a text file and an LFS file per release), reading the head each time; touch READY
    after the first win. The test kills it with SIGKILL at a random moment.
release_worker.py hold-lock REPO SCENARIO READY
    Take the chain's ref lock the way a live publisher does (guard flock shared + ``<ref>.lock``), touch
    READY, and hold it until killed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemon.errors import HeadMoved, LockBusy  # noqa: E402
from daemon.releases import SCENARIOS_REF, ReleaseStore  # noqa: E402


def contend(repo: str, scenario: str, worker: int, start_at: float, rounds: int, period: float, timeout: float) -> None:
    store = ReleaseStore(repo, lock_timeout=timeout)
    for r in range(rounds):
        delay = start_at + r * period - time.time()
        if delay > 0:
            time.sleep(delay)
        read = store.head(scenario)
        out = {"worker": worker, "round": r, "read": read, "release_id": None}
        try:
            rel = store.publish(
                scenario,
                {"AGENTS.md": f"worker {worker} round {r}\n", "notes/round.txt": f"{r}\n"},
                expected_head=read,
                operation="train",
                kind="harness",
                recipe="lessons",
                metrics={"worker": worker, "round": r},
            )
            out.update(outcome="win", release_id=rel.release_id)
        except HeadMoved as e:
            out.update(outcome="head_moved", actual=e.actual)
        except LockBusy:
            out.update(outcome="lock_busy")
        print(json.dumps(out), flush=True)


def loop(repo: str, scenario: str, ready: str) -> None:
    store = ReleaseStore(repo, lfs_threshold=4096, lock_timeout=5.0, stale_lock_after=60.0)
    n = 0
    while True:
        head = store.head(scenario)
        try:
            store.publish(
                scenario,
                {"AGENTS.md": f"release {n} from {os.getpid()}\n", "weights.bin": os.urandom(8192)},
                expected_head=head,
                operation="train",
                kind="harness",
                recipe="lessons",
            )
        except (HeadMoved, LockBusy):
            continue
        n += 1
        if n == 1:
            Path(ready).touch()


def hold_lock(repo: str, scenario: str, ready: str) -> None:
    store = ReleaseStore(repo)
    name = SCENARIOS_REF + scenario
    with store.refs.guard(exclusive=False, blocking=True):
        tx = store.repo.git().transaction()
        tx.lock_ref(name)
        Path(ready).touch()
        time.sleep(3600)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "contend":
        contend(args[0], args[1], int(args[2]), float(args[3]), int(args[4]), float(args[5]), float(args[6]))
    elif mode == "loop":
        loop(*args)
    elif mode == "hold-lock":
        hold_lock(*args)
    else:
        raise SystemExit(f"unknown mode {mode}")
