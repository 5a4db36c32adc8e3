"""On a lent GPU: serve a local model through vLLM or SGLang under Reef, publish an adapter release and a
full-weights release under load, and print update times and the per-response weight-version checks.

Needs the server installed in a venv of its own (``--server-python``: vLLM's GPU build, or SGLang) and a local
HF model directory (``--model``; nothing is downloaded). Steps, in one bounded run:
1. the daemon starts the server (time to healthy printed); 4 clients keep sending chat requests (half streamed);
2. a random LoRA adapter on the model is published as a release: publish -> first answer from it;
3. a full-weights release (the model with perturbed embeddings) is published: publish -> first answer from it
   (the server's weight-update call from the materialised directory, after the running requests finish);
4. every record is read back: its ``runtime_load_id`` must be the load of its own release (the server's reported
   weight version was checked per response by the engine); failed requests and mismatches are counted.

Run: ``python bench/gpu_server.py --engine vllm|sglang --server-python /opt/vllm/bin/python --model DIR``
(``--cpu`` runs the same on vLLM's CPU build with the tiny model, as a check of the script itself).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.vllm_proxy import free_port, start_reef  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--server-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--cpu", action="store_true", help="vLLM's CPU build and a tiny random model")
    ap.add_argument("--seconds", type=float, default=20.0, help="load after each update")
    args = ap.parse_args()
    from bench.lora_models import random_adapter
    from daemon.lora import AdapterManifest
    from daemon.models import TinyConfig, init_tiny
    from daemon.releases import ReleaseStore, files_from_dir
    from tests.test_release_serving import make_weights

    work = Path(tempfile.mkdtemp(prefix="reef-gpu-server-"))
    try:
        model = args.model.resolve() if args.model else init_tiny(work / "tiny32",
                                                                   config=TinyConfig(num_attention_heads=2))
        home = work / "home"
        (home / "logs").mkdir(parents=True)
        port = free_port()
        # the config refuses keys an engine does not read: kv_cache_gb and device are vLLM's (SGLang picks its own)
        if args.cpu:
            extra = ('kv_cache_gb = 1\n' if args.engine == "vllm" else "") + 'server_args = ["--dtype", "float32"]\n'
        else:
            extra = 'device = "cuda"\n' if args.engine == "vllm" else ""
        (home / "config.toml").write_text(
            f'port = {port}\ndefault_model = "m"\n[models.m]\nengine = "{args.engine}"\npath = "{model}"\n'
            f'server = "{args.server_python}"\nserver_log = "{work}/server.log"\nmax_model_len = 4096\n'
            f'max_new_tokens = 32\nstartup_timeout_s = 1200\n' + extra)
        t0 = time.perf_counter()
        proc, server = start_reef(home, port)
        print(f"{args.engine} {server.get('version')} healthy in {time.perf_counter() - t0:.1f} s", flush=True)
        token = (home / "token").read_text().strip()
        base_url, headers = f"http://127.0.0.1:{port}", {"x-api-key": token}
        store = ReleaseStore(home / "artifacts.git")
        body = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "write about caches"}]}
        with httpx.Client(base_url=base_url, headers=headers, timeout=600) as c:
            c.post("/s/gpu/v1/chat/completions", json=body).raise_for_status()
        init = store.get(store.head("gpu"))
        receipts: list[str] = []
        failures: list[str] = []
        stop = threading.Event()

        def client(i: int) -> None:
            with httpx.Client(base_url=base_url, headers=headers, timeout=600) as cc:
                n = 0
                while not stop.is_set():
                    stream = (n + i) % 2 == 0
                    r = cc.post("/s/gpu/v1/chat/completions", json={**body, "stream": stream})
                    n += 1
                    if r.status_code != 200 or (stream and "[DONE]" not in r.text):
                        failures.append(f"{r.status_code} {r.text[:200]}")
                    else:
                        receipts.append(r.headers["x-reef-agent-record-id"])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        lat: list[float] = []
        try:
            for what, files in (
                ("adapter", files_from_dir(random_adapter(model, work / "ad", AdapterManifest(
                    init.content_id, init.release_id), rank=8))),
                ("full weights", files_from_dir(make_weights(model, work / "full", 7))),
            ):
                t1 = time.perf_counter()
                rel = store.publish("gpu", files, expected_head=store.head("gpu"), operation="train",
                                    kind="weights", recipe="record")
                with httpx.Client(base_url=base_url, headers=headers, timeout=600) as c:
                    while True:
                        t2 = time.perf_counter()
                        r = c.post("/s/gpu/v1/chat/completions", json=body)
                        if r.headers.get("x-reef-release-id") == rel.release_id:
                            lat.append((time.perf_counter() - t2) * 1e3)
                            break
                print(f"{what} release: publish -> first answer from it {time.perf_counter() - t1:.2f} s", flush=True)
                time.sleep(args.seconds)
        finally:
            stop.set()
            for t in threads:
                t.join()
        with httpx.Client(base_url=base_url, headers=headers, timeout=600) as c:
            records = [c.get(f"/reef/records/{r}").json() for r in receipts]
        loads: dict[str, set[str]] = {}
        for rec in records:
            loads.setdefault(rec["release_id"], set()).add(rec["runtime_load_id"])
        shared = [r for r in loads if any(loads[r] & loads[o] for o in loads if o != r)]
        print(f"{len(records)} answers, {len(failures)} failed; releases served: {len(loads)}; "
              f"a load id shared by two releases: {len(shared)} (must be 0)")
        if lat:
            print(f"first answer after an update: median {statistics.median(lat):.0f} ms")
        for f in failures[:3]:
            print("failure:", f)
        proc.terminate()
        proc.wait(120)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
