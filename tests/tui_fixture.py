"""Fixed daemon data for the TUI's snapshot tests.

Snapshots must not change from run to run, and a real daemon's release ids (git commit ids) carry the time of
publication. So the snapshot tests hand the app this ``Source``: the same shapes the daemon's HTTP API
answers (taken from real answers), with fixed ids and times. The behaviour tests (``test_tui.py``) use a real
daemon instead.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

NOW = 1_800_000_000.0  # the clock the snapshot app is given


def rid(n: int) -> str:
    return f"{n:x}" * 40 if n < 16 else f"{n:040x}"


R0, R1, R2, R3, R4 = (rid(n) for n in (0xA, 0xB, 0xC, 0xD, 0xE))
C0, C1, C2 = (rid(n) for n in (1, 2, 3))


def _release(release_id: str, content: str, step: int, op: str, parent: str | None, created: float,
             metrics: dict[str, Any] | None = None, source: str | None = None) -> dict[str, Any]:
    return {
        "release_id": release_id, "content_id": content, "scenario": "alpha", "step": step, "operation": op,
        "kind": "weights", "recipe": "online-rl", "parent": parent, "source": source, "metrics": metrics or {},
        "receipts": [f"rec_{step:02d}{i:022d}" for i in range(3 if op == "train" else 0)],
        "settings": {"lr": 0.001, "gate": "compare"} if op == "train" else {"model": "tiny"},
        "created_at": created, "message": f"{op} alpha step {step}", "lfs": {},
    }


RELEASES = [
    _release(R4, C2, 4, "rollback", R3, NOW - 60, source=R2),
    _release(R3, C1, 3, "train", R2, NOW - 600, {"eval_reward": 0.31, "batch_reward": 0.28, "loss": 0.91}),
    _release(R2, C2, 2, "train", R1, NOW - 3600, {"eval_reward": 0.44, "batch_reward": 0.40, "loss": 0.73}),
    _release(R1, rid(4), 1, "train", R0, NOW - 7200, {"eval_reward": 0.21, "batch_reward": 0.19, "loss": 1.2}),
    _release(R0, C0, 0, "init", None, NOW - 90000),
]
PENDING = [_release(rid(0xF), rid(5), 5, "train", R4, NOW - 30, {  # held by the watchdog: the note says why
    "eval_reward": 0.52, "kl_from_base": 0.31,
    "watchdog": "watchdog: the policy moved 0.3100 nats per token from its base model (KL on the step's answers), "
                "more than max_kl 0.2; held for review (reef releases promote ID publishes it)"})]
REJECTED = [{
    "rejection_id": rid(6), "scenario": "alpha", "step": 5, "verdict": "rejected",
    "reason": "candidate 0.25 is not above base 0.44 by margin 1", "metrics": {"eval_reward": 0.25},
    "base": R4, "candidate": None, "content_id": None, "kind": "weights", "recipe": "online-rl",
    "receipts": ["rec_x"], "created_at": NOW - 300,
}]

DIFF = {
    "base": R1,
    "files": [
        {"path": "NOTES.md", "kind": "text", "status": "modified",
         "diff": "--- a/NOTES.md\n+++ b/NOTES.md\n@@ -1,2 +1,2 @@\n-release 1\n+release 2\n line two\n"},
        {"path": "model.safetensors", "kind": "safetensors", "status": "modified", "unchanged_tensors": 14,
         "tensors": [
             {"name": "model.embed_tokens.weight", "status": "changed", "shape": [512, 64], "diff_norm": 0.0213,
              "old_norm": 18.1},
             {"name": "lm_head.weight", "status": "changed", "shape": [512, 64], "diff_norm": 0.0187,
              "old_norm": 17.9},
         ]},
    ],
}

SCENARIOS = [
    {"name": "alpha", "recipe": "online-rl", "model": "tiny", "records": 96, "reports": 96, "mean_score": 0.4375,
     "created_at": NOW - 90000},
    {"name": "default", "recipe": "record", "model": "tiny", "records": 12, "reports": 0, "mean_score": None,
     "created_at": NOW - 80000},
    {"name": "harness", "recipe": "lessons", "model": "tiny", "records": 3, "reports": 2, "mean_score": 1.0,
     "created_at": NOW - 500},
]

RECORDS = [
    {"id": f"rec_{i:026d}", "kind": "exchange", "scenario": "alpha", "run": "run_demo", "created_at": NOW - 5 * i,
     "status": "complete", "release_id": R4, "timings": {"total_ms": 40.0 + i}, "score": [1.0, 0.25, None][i % 3],
     "feedback": ["exact", "near miss", None][i % 3]}
    for i in range(8)
]

RECORD = {
    **RECORDS[0], "format": "openai-chat", "engine": "transformers", "model": "tiny", "runtime_load_id": "e1:3",
    "usage": {"input_tokens": 9, "output_tokens": 2},
    "request": {"model": "tiny", "messages": [{"role": "user", "content": 'Say "window".'}]},
    "response": {"choices": [{"message": {"role": "assistant", "content": "window"}}]},
    "reports": [{"id": "rec_report0000000000000000", "created_at": NOW - 4,
                 "report": {"score": 1.0, "feedback": "exact"}}],
}


def _fig(value: float | None, source: str = "gate", n: int = 24) -> dict[str, Any]:
    if value is None:
        return {"status": "n/a", "reason": "not measured yet (reef eval measures it)"}
    return {"status": "ok", "value": value, "n": n, "source": source}


def evaluation(measured: bool) -> dict[str, Any]:
    """``reef eval`` of alpha (``daemon/evaluation.py``'s shape): its gate scores as the curve, the probes of the
    rolled-back release (step 3) lower than the base's; the base's probes not measured until ``measured``."""
    base_probes = 0.75 if measured else None
    rows = []
    for r, reward, probes in zip(RELEASES[::-1], (0.2, 0.21, 0.44, 0.31, 0.44),
                                 (base_probes, 0.75, 0.71, 0.46, 0.71), strict=True):
        forgetting = ({"status": "ok", "value": round(probes - base_probes, 4), "n": 24, "source": "against the base"}
                      if probes is not None and base_probes is not None else _fig(None))
        rows.append({"release_id": r["release_id"], "step": r["step"], "operation": r["operation"],
                     "content_id": r["content_id"], "kind": "weights", "created_at": r["created_at"],
                     "head": r["release_id"] == R4, "reward": _fig(reward, n=64),
                     "probes": _fig(probes, "measured" if r["operation"] == "init" else "gate"),
                     "forgetting": forgetting, "transfer": {"status": "n/a", "reason": "no transfer scenario asked"}})
    return {"scenario": "alpha", "recipe": "online-rl", "kind": "weights", "head": R4, "transfer": None,
            "base": {"release_id": R0, "step": 0, "probes": _fig(base_probes, "measured")},
            "reward_how": "the say scorer on 64 validation prompts (never trained on), greedy, 8 tokens: the gate's "
                          "eval_reward", "probes_how": "24 probes, greedy, 16 tokens", "transfer_how": None,
            "rows": rows, "measured": 1 if measured else 0, "cached": 0, "seconds": 1.5 if measured else 0.01}


def events() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    t = NOW - 120
    seq = 0

    def ev(kind: str, dt: float, **data: Any) -> None:
        nonlocal t, seq
        t += dt
        seq += 1
        out.append({"seq": seq, "time": t, "kind": kind, "scenario": "alpha", **data})

    for step in range(1, 4):
        for i in range(12):
            ev("report", 1.5, score=round(((i * 7 + step * 3) % 10) / 10 * (0.5 + step / 6), 3), references=[])
        ev("train.start", 0.5, job=f"job_{step}", base=rid(step), samples=64)
        ev("train.step", 4.0, job=f"job_{step}", step=step,
           metrics={"batch_reward": 0.2 + 0.1 * step, "loss": 1.3 - 0.2 * step, "train_s": 3.9}, seconds=4.0)
        accepted = step != 2
        ev("gate", 2.0, job=f"job_{step}", verdict="accepted" if accepted else "rejected",
           reason="candidate beats base" if accepted else "candidate 0.31 is not above base 0.40",
           release_id=rid(step) if accepted else None)
        if accepted:
            ev("release", 0.1, release_id=rid(step), operation="train", step=step)
    return out


class FixedSource:
    """A ``reef_cli.tui.api.Source`` answering fixed data, the way the daemon would."""

    def __init__(self) -> None:
        self.steered: list[tuple[str, str, str, str | None]] = []

    def where(self) -> str:
        return "/tmp/reef-snapshot/reef.sock"

    async def healthz(self) -> dict[str, Any]:
        return {"ok": True, "pid": 4242, "uptime_s": 1.0}

    async def status(self) -> dict[str, Any]:
        return {"pid": 4242, "learning": {"alpha": "waiting", "default": "idle"},
                "spend": {"alpha": {"kind": "weights", "trainer_seconds_today": 42.0, "seconds_per_point": 3.2,
                                    "capped": False},
                          "harness": {"kind": "harness", "proposer_tokens_today": 1520, "proposer_tokens_total": 1520,
                                      "capped": True}}}

    async def scenarios(self) -> list[dict[str, Any]]:
        return copy.deepcopy(SCENARIOS)

    async def releases(self, scenario: str, *, all_: bool = False, limit: int | None = None) -> dict[str, Any]:
        releases = RELEASES if scenario == "alpha" else [{**RELEASES[-1], "scenario": scenario}]
        body: dict[str, Any] = {"scenario": scenario, "head": releases[0]["release_id"],
                                "releases": copy.deepcopy(releases[:limit] if limit else releases)}
        if all_:
            body["pending"] = copy.deepcopy(PENDING) if scenario == "alpha" else []
            body["rejected"] = copy.deepcopy(REJECTED) if scenario == "alpha" else []
        return body

    async def release(self, release_id: str) -> dict[str, Any]:
        rel = next(r for r in RELEASES + PENDING if r["release_id"].startswith(release_id))
        return {**copy.deepcopy(rel), "head": R4, "diff": copy.deepcopy(DIFF)}

    async def records(self, *, limit: int = 50, scenario: str | None = None) -> list[dict[str, Any]]:
        return copy.deepcopy(RECORDS[:limit])

    async def record(self, receipt: str) -> dict[str, Any]:
        return copy.deepcopy(RECORD)

    async def steer(self, op: str, scenario: str, release_id: str, expected_head: str | None) -> dict[str, Any]:
        self.steered.append((op, scenario, release_id, expected_head))
        return {**RELEASES[0], "step": 5, "operation": op}

    async def canary(self, scenario: str, release_id: str, share: float) -> dict[str, Any]:
        self.steered.append(("canary", scenario, release_id, None))
        return {"scenario": scenario, "release_id": release_id, "base_id": RELEASES[0]["release_id"], "share": share}

    async def canary_end(self, scenario: str, *, promote: bool) -> dict[str, Any]:
        self.steered.append(("canary-end", scenario, "promote" if promote else "end", None))
        return {"verdict": "promoted" if promote else "ended", "release_id": None}

    async def evaluation(self, scenario: str, *, measure: bool = False, transfer: str | None = None,
                         progress: Any = None) -> dict[str, Any]:
        if measure and progress is not None:
            await progress({"release_id": R0, "step": 0, "done": 0, "total": 5, "measuring": ["probes"]})
        return evaluation(measure)

    async def events(self, after: int | None) -> AsyncIterator[dict[str, Any]]:
        for ev in events():
            yield ev
        await asyncio.Event().wait()  # the stream stays open, like the daemon's

    async def aclose(self) -> None:
        pass
