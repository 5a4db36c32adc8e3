"""Daemon start: launch to healthy, and launch to the default model loaded, against a bare interpreter's start in
the same run (goal: healthy under 1 s with the default model, SmolLM2, configured).

Each round starts ``python -m daemon`` on a fresh home whose ``models/smollm2`` is a link to one made model
directory (made first, as ``reef model init smollm2`` makes it, unless ``--model-dir`` names one), polls
``/healthz`` over the Unix socket until it answers, then until it lists the default model as loaded, and stops the
daemon; ``python -c pass`` runs between rounds as the baseline. Prints the median of each and the ratios.

Run: ``.venv/bin/python bench/daemon_start.py [--runs N] [--model-dir DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def healthz(sock_path: Path) -> dict | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(str(sock_path))
        s.sendall(b"GET /healthz HTTP/1.0\r\nHost: localhost\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        return json.loads(body) if head.startswith(b"HTTP/1.1 200") else None
    except (OSError, ValueError):
        return None
    finally:
        s.close()


def one_start(model_dir: Path) -> tuple[float, float]:
    home = Path(tempfile.mkdtemp(prefix="reef-bench-start-"))
    try:
        (home / "models").mkdir()
        (home / "models" / "smollm2").symlink_to(model_dir)
        env = {k: v for k, v in os.environ.items() if not k.startswith("REEF_")}
        env.update(REEF_HOME=str(home), REEF_PORT="0", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "daemon"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        healthy = loaded = None
        try:
            while loaded is None:
                h = healthz(home / "reef.sock")
                now = time.perf_counter()
                if h is not None and healthy is None:
                    healthy = now - t0
                if h is not None and "smollm2" in h.get("models", {}).get("loaded", []):
                    loaded = now - t0
                if h is not None and h.get("models", {}).get("failed"):
                    raise SystemExit(f"the model failed to load: {h['models']['failed']}")
                if proc.poll() is not None:
                    raise SystemExit(f"the daemon exited {proc.returncode}")
                time.sleep(0.01)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        assert healthy is not None
        return healthy, loaded
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model-dir", type=Path, help="a made smollm2 directory (default: make one in a temp dir)")
    args = ap.parse_args()
    model_dir = args.model_dir
    if model_dir is None:
        sys.path.insert(0, str(ROOT))
        from daemon.smollm2 import init_smollm2

        model_dir = init_smollm2(Path(tempfile.mkdtemp(prefix="reef-bench-smollm2-")) / "smollm2")
    bare, healthy, loaded = [], [], []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        bare.append(time.perf_counter() - t0)
        h, m = one_start(model_dir.resolve())
        healthy.append(h)
        loaded.append(m)
    med = statistics.median
    print(f"runs {args.runs}, load average {os.getloadavg()[0]:.1f}")
    print(f"python -c pass            {med(bare) * 1e3:8.0f} ms")
    print(f"launch -> healthy         {med(healthy) * 1e3:8.0f} ms  ({med(healthy) / med(bare):.1f}x a bare start; "
          f"goal < 1000 ms: {'met' if med(healthy) < 1 else 'not met'})")
    print(f"launch -> smollm2 loaded  {med(loaded) * 1e3:8.0f} ms  ({med(loaded) / med(bare):.1f}x a bare start)")


if __name__ == "__main__":
    main()
