"""The daemon's own memory on the default model with its prefix cache full: what the weights-recipe benches' short
prompts never reach.

A fresh ``REEF_HOME`` with no configuration but its port (the default model, SmolLM2-135M-Instruct, made once by
``reef model init smollm2`` or given with ``--model``), the daemon started as ``reef serve`` starts it, then
``--requests`` chat requests one at a time, each a distinct prompt of about ``--tokens`` tokens answered with one
token: each finished sequence's KV cache goes into the prefix cache (``prefix_cache_mb``, default 256), so after a few
the cache is at its budget. Then ``--publishes`` LoRA adapter releases (rank 8 on the trainer's target modules,
as a weights recipe makes them; random, so no training is waited for) are published on the same scenario one after
another, as the trainer publishes, each answered once: a superseded head's adapter must leave the daemon's memory.
Printed: the daemon's peak resident memory (VmHWM) and its current one (VmRSS) after starting, after each request and
each publish, and the releases the engine keeps (``/reef/status``), against ``bench/learning_real.py``'s
``DAEMON_BOUND_MB``.

Run (nothing else on the machine): ``.venv/bin/python bench/daemon_memory.py [--model DIR] [--tokens 3000]
[--requests 8] [--publishes 30]``
"""

from __future__ import annotations

import argparse
import os
import re
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
    ap.add_argument("--publishes", type=int, default=0, help="adapter releases published after the requests")
    ap.add_argument("--prefix-cache-mb", type=int, help="the model's prefix_cache_mb (default: the engine's default)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reef-bench-daemon-memory-"))
    proc = None
    try:
        model = args.model or make_model(work)
        home = work / "home"
        (home / "models").mkdir(parents=True)
        (home / "models" / "smollm2").symlink_to(model.resolve())
        port = free_port()
        config = f"port = {port}\n"
        if args.prefix_cache_mb is not None:
            config += f"[models.smollm2]\nengine = \"transformers\"\npath = \"{home / 'models' / 'smollm2'}\"\n" \
                      f"prefix_cache_mb = {args.prefix_cache_mb}\n"
        (home / "config.toml").write_text(config)
        proc = start(home, port)
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
                      f"{time.monotonic() - t:.1f} s; daemon peak {vm_hwm_mb(proc.pid):,.0f} MB, now "
                      f"{vm_rss_mb(proc.pid):,.0f} MB; load {os.getloadavg()[0]:.1f}", flush=True)
            if args.publishes:
                publish(c, home, model, work, args.publishes, proc.pid)
        peak = vm_hwm_mb(proc.pid)
        print(f"daemon peak {peak:,.0f} MB after {args.requests} requests and {args.publishes} publishes (bound "
              f"{DAEMON_BOUND_MB:,} MB: {'within' if peak <= DAEMON_BOUND_MB else 'OVER'})")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        shutil.rmtree(work, ignore_errors=True)


def vm_rss_mb(pid: int) -> float:
    """A live process's resident memory now (VmRSS), MB."""
    m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024 if m else float("nan")


def publish(c: httpx.Client, home: Path, model: Path, work: Path, n: int, pid: int) -> None:
    """Publish ``n`` adapter releases on the default scenario one after another, each answered once."""
    from bench.lora_models import adapter_variant, random_adapter
    from daemon.lora import AdapterManifest
    from daemon.releases import ReleaseStore, files_from_dir

    store = ReleaseStore(home / "artifacts.git")
    if store.head("default") is None:  # no request yet: the first one publishes the init release (the base)
        c.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 1,
                                             "messages": [{"role": "user", "content": "hi"}]}).raise_for_status()
    init = store.get(store.head("default"))
    first = random_adapter(model, work / "adapter-0", AdapterManifest(init.content_id, init.release_id))
    size = sum(f.stat().st_size for f in first.iterdir()) / 2**20
    print(f"publishing {n} adapter releases of {size:.1f} MiB each", flush=True)
    for i in range(n):
        adapter = first if i == 0 else adapter_variant(first, work / f"adapter-{i}", i)
        rel = store.publish("default", files_from_dir(adapter), expected_head=store.head("default"),
                            operation="train", kind="weights", recipe="record")
        r = c.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 1, "temperature": 0,
                                                 "messages": [{"role": "user", "content": f"release {i}"}]})
        r.raise_for_status()
        assert r.headers["x-reef-release-id"] == rel.release_id, r.headers
        resident = c.get("/reef/status").json()["models"]["smollm2"]["resident"]
        print(f"publish {i + 1}: daemon peak {vm_hwm_mb(pid):,.0f} MB, now {vm_rss_mb(pid):,.0f} MB; "
              f"{len(resident)} releases resident; load {os.getloadavg()[0]:.1f}", flush=True)
        if i:
            shutil.rmtree(adapter)


if __name__ == "__main__":
    main()
