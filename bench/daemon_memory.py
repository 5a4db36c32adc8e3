"""The daemon's own memory on the default model with its prefix cache full: what the weights-recipe benches' short
prompts never reach.

A fresh ``REEF_HOME`` with no configuration but its port (the default model, SmolLM2-135M-Instruct, made once by
``reef model init smollm2`` or given with ``--model``), the daemon started as ``reef serve`` starts it, then
``--requests`` chat requests one at a time, each a distinct prompt of about ``--tokens`` tokens answered with one
token: each finished sequence's KV cache goes into the prefix cache (``prefix_cache_mb``, default 512), so after a few
the cache is at its budget. Printed: the daemon's peak resident memory (VmHWM) after starting, after the first
request and after the last, against ``bench/learning_real.py``'s ``DAEMON_BOUND_MB``.

Run (nothing else on the machine): ``.venv/bin/python bench/daemon_memory.py [--model DIR] [--tokens 3000]
[--requests 8]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.learning_real import DAEMON_BOUND_MB, free_port, make_model, start, vm_hwm_mb  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="SmolLM2's directory (default: made here, no download)")
    ap.add_argument("--tokens", type=int, default=3000, help="about this many prompt tokens a request")
    ap.add_argument("--requests", type=int, default=8)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reef-bench-daemon-memory-"))
    proc = None
    try:
        model = args.model or make_model(work)
        home = work / "home"
        (home / "models").mkdir(parents=True)
        (home / "models" / "smollm2").symlink_to(model.resolve())
        port = free_port()
        (home / "config.toml").write_text(f"port = {port}\n")
        proc, _ = start(home, port)
        token = (home / "token").read_text().strip()
        print(f"started: daemon peak {vm_hwm_mb(proc.pid):,.0f} MB", flush=True)
        words = "river stone cloud paper lamp garden window music bread winter".split()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"x-api-key": token}, timeout=600) as c:
            for i in range(args.requests):
                # distinct from the first token on, so no request reuses another's cached prefix
                text = f"{i} " + " ".join(words[(i + k) % len(words)] for k in range(args.tokens))
                t = time.monotonic()
                r = c.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 1, "temperature": 0,
                                                         "messages": [{"role": "user", "content": text}]})
                r.raise_for_status()
                print(f"request {i + 1}: {r.json()['usage']['prompt_tokens']} prompt tokens in "
                      f"{time.monotonic() - t:.1f} s; daemon peak {vm_hwm_mb(proc.pid):,.0f} MB; load "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
        peak = vm_hwm_mb(proc.pid)
        print(f"daemon peak {peak:,.0f} MB after {args.requests} requests (bound {DAEMON_BOUND_MB:,} MB: "
              f"{'within' if peak <= DAEMON_BOUND_MB else 'OVER'})")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
