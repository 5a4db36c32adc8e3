"""One big export against a real daemon: how long the event loop stalls and how much memory the daemon takes.

Starts ``python -m daemon`` with the tiny model in a throwaway ``REEF_HOME``, imports ``--mb`` megabytes of
exchanges (records of ``--record-kb`` each), then reads ``GET /reef/records/export`` to the end while asking
``/healthz`` every 20 ms on another connection. Prints the export's size and time, the longest ``/healthz`` wait
while it streamed, the daemon's own loop lag and held figures (``bench/big_body.py``), and its RSS before and at
its peak (``VmHWM``, reset before the export).

Run: ``.venv/bin/python bench/big_export.py [--mb 300] [--record-kb 1024]``
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.big_body import healthz, loop_lag_buckets, worst_lag  # noqa: E402


def status_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=300)
    ap.add_argument("--record-kb", type=int, default=1024)
    args = ap.parse_args()
    import httpx

    from bench.reef_proc import free_port, start
    from daemon.models import init_tiny

    tiny = init_tiny(Path(tempfile.gettempdir()) / "reef-bench-models" / "tiny", seed=0)
    home, port = Path(tempfile.mkdtemp(prefix="reef-bench-", dir="/tmp")), free_port()
    (home / "config.toml").write_text(f'port = {port}\n\n[models.tiny]\nengine = "transformers"\npath = "{tiny}"\n')
    proc = start(home, port)
    try:
        token = (home / "token").read_text().strip()
        warm = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=600,  # the load is not measured
                          headers={"Authorization": f"Bearer {token}"},
                          json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert warm.status_code == 200, warm.text
        size = args.record_kb * 1024
        records = int(args.mb * 2**20) // size
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"},
                          timeout=900) as c:
            batch = max(1, (32 << 20) // size)
            for start in range(0, records, batch):
                items = [{"id": f"rec_big{i:06d}", "scenario": "big",
                          "prompt": [{"role": "user", "content": f"{i:06d} " + "x" * size}],
                          "completion": [{"role": "assistant", "content": "ok"}]}
                         for i in range(start, min(records, start + batch))]
                r = c.post("/reef/records/import", json={"items": items})
                assert r.status_code == 201, r.text
            time.sleep(2)
            lag_before, held_before = loop_lag_buckets(port, token), loop_lag_buckets(port, token, "held")
            rss = status_mb(proc.pid, "VmRSS")
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")
            waits: list[float] = []
            done = threading.Event()

            def probe() -> None:
                while not done.is_set():
                    waits.append(healthz(port))
                    time.sleep(0.02)

            prober = threading.Thread(target=probe, daemon=True)
            prober.start()
            t0, got, lines = time.perf_counter(), 0, 0
            with c.stream("GET", "/reef/records/export", params={"scenario": "big"}) as r:
                for line in r.iter_lines():
                    got += len(line)
                    lines += 1
            took = time.perf_counter() - t0
            done.set()
            prober.join()
            peak = status_mb(proc.pid, "VmHWM")
            lag = worst_lag(lag_before, loop_lag_buckets(port, token))
            held = worst_lag(held_before, loop_lag_buckets(port, token, "held"))
        print(f"export of {lines} records, {got / 1e6:.0f} MB, in {took:.1f} s")
        print(f"/healthz during it: {len(waits)} answers, longest {max(waits) * 1e3:.0f} ms; the daemon's own loop"
              f" lag: at most {lag * 1e3:.0f} ms, of it held by its work: at most {held * 1e3:.0f} ms")
        print(f"RSS MB: before {rss:.0f}  peak during the export {peak:.0f} (+{peak - rss:.0f})")
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
