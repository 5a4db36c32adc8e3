"""Two releases with clearly different weights decode side by side in the embedded engine, and every record's
log-probs are those of its own release's weights, never the other's.

The engine keeps one decode batch per load and runs the batches of all loads in the same step loop, so requests
pinned to two releases at once are in flight together. A bug that decodes a row with another release's weights
(one batch for all loads, or the wrong load looked up) leaves the first token right (it is sampled at prefill)
and every later log-prob wrong: the test re-scores every token of every record offline under both releases'
weights, taken from the release chain.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon
from tests.test_release_serving import make_weights, publish

PER_RELEASE = 6  # requests pinned to each release, sent at once (12 <= 2 * max_batch: all decode together)
MAX_TOKENS = 40


def pinned_burst(d: Daemon, scenario: str, releases: list[str]) -> list[tuple[str, str]]:
    """Send ``PER_RELEASE`` requests pinned to each release at once; (pinned release, receipt) per request."""
    jobs = [(i, rel) for i in range(PER_RELEASE) for rel in releases]  # interleaved: A, B, A, B, ...
    start = threading.Barrier(len(jobs))
    out: list[tuple[str, str]] = []
    failures: list[str] = []

    def send(i: int, rel: str) -> None:
        with d.http() as c:
            body = {"model": "tiny", "max_tokens": MAX_TOKENS, "seed": i,
                    "messages": [{"role": "user", "content": f"tell me about caches number {i}"}]}
            start.wait(30)
            resp = c.post(f"/s/{scenario}/v1/chat/completions", json=body, headers={"x-reef-release-id": rel})
            if resp.status_code != 200 or resp.headers.get("x-reef-release-id") != rel:
                failures.append(f"{resp.status_code} {resp.headers.get('x-reef-release-id')} {resp.text[:300]}")
                return
            out.append((rel, resp.headers["x-reef-agent-record-id"]))

    threads = [threading.Thread(target=send, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    assert len(out) == len(jobs)
    return out


def rescored(model: Any, rec: dict[str, Any]) -> list[float]:
    """Log-probs of the record's sampled tokens under ``model``, teacher-forced in one full forward."""
    import torch

    ids = rec["prompt_token_ids"] + rec["token_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    n = len(rec["prompt_token_ids"])
    return [float(logp[n - 1 + k, t]) for k, t in enumerate(rec["token_ids"])]


def test_concurrent_requests_on_two_releases_decode_with_their_own_weights(
        daemon_factory: Any, tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from daemon.releases import ReleaseStore

    d: Daemon = daemon_factory()
    with d.http() as c:
        first = c.post("/s/two/v1/chat/completions", json={"model": "tiny", "max_tokens": 1,
                                                            "messages": [{"role": "user", "content": "hi"}]})
        a = first.headers["x-reef-release-id"]
    b = publish(d, "two", make_weights(tiny_model, tmp_path / "b", seed=7))
    served = pinned_burst(d, "two", [a, b])
    with d.http() as c:
        records = {rid: c.get(f"/reef/records/{rid}").json() for _, rid in served}
    store = ReleaseStore(d.home / "artifacts.git")
    models = {rel: AutoModelForCausalLM.from_pretrained(store.checkout(rel, tmp_path / f"check-{rel}")).eval()
              for rel in (a, b)}

    # the premise: requests of both releases were decoding at the same time (server-side start and end of each)
    spans = {rid: (rec["created_at"] - rec["timings"]["total_ms"] / 1e3, rec["created_at"])
             for rid, rec in records.items()}
    by_rel = {rel: [spans[rid] for r, rid in served if r == rel] for rel in (a, b)}
    assert any(sa < eb and sb < ea for sa, ea in by_rel[a] for sb, eb in by_rel[b]), spans

    for rel, rid in served:
        rec = records[rid]
        assert rec["release_id"] == rel and len(rec["token_ids"]) == len(rec["logprobs"]) > 1, rec
        own = rescored(models[rel], rec)
        other = rescored(models[b if rel == a else a], rec)
        # every token, not just the first (sampled at prefill, before the sequence joins a decode batch)
        assert rec["logprobs"] == pytest.approx(own, abs=1e-4), (rid, rel)
        worst = max(abs(x - y) for x, y in zip(rec["logprobs"][1:], other[1:], strict=True))
        assert worst > 0.5, (rid, rel, worst)  # the two releases really are told apart by these tokens
    loads = {rel: {records[rid]["runtime_load_id"] for r, rid in served if r == rel} for rel in (a, b)}
    assert len(loads[a]) == len(loads[b]) == 1 and loads[a] != loads[b]

