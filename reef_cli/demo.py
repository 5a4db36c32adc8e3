"""``reef demo``: watch a model learn from feedback, on the CPU, in a few minutes.

The demo plays a client of the real HTTP API: it creates a fresh ``online-rl`` scenario on the demo model
(the tiny model with a short supervised warm-up on the task family, so it starts with a little skill), sends a
stream of small verifiable tasks (``say``: answer with the quoted word), scores every answer with the family's
checker, and reports the score by receipt. The daemon trains on those reports in its worker process, the gate
compares each candidate with the serving release on held-out prompts, and winners go live. At the end the demo
measures the head and the first release on the same held-out prompts, greedy, through the API.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import typer

from reef_cli.common import edge, fail

DEMO_MODEL = "tiny-demo"
TARGET = 0.8


def _answer(c: Any, scenario: str, prompt: str, *, temperature: float, max_tokens: int,
            release: str | None = None) -> tuple[str, str, str]:
    headers = {"x-reef-scenario": scenario}
    if release:
        headers["x-reef-release-id"] = release
    resp = c.request("POST", "/v1/chat/completions", raw=True, json={
        "model": DEMO_MODEL, "max_tokens": max_tokens, "temperature": temperature,
        "messages": [{"role": "user", "content": prompt}]}, headers=headers)
    text = resp.json()["choices"][0]["message"]["content"] or ""
    return text, resp.headers["x-reef-agent-record-id"], resp.headers["x-reef-release-id"]


def held_out_reward(c: Any, scenario: str, release: str, tasks: list[Any], family: Any, max_tokens: int) -> float:
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda t: _answer(c, scenario, t.prompt, temperature=0, max_tokens=max_tokens,
                                                release=release)[0], tasks))
    return sum(family.exact(t, x) for t, x in zip(tasks, texts, strict=True)) / len(tasks)


class Board:
    """What the live display shows; fed by the client loop and the daemon's event stream."""

    def __init__(self) -> None:
        self.requests = 0
        self.rewards: deque[float] = deque(maxlen=256)
        self.steps = 0
        self.accepted = 0
        self.rejected = 0
        self.releases: list[dict[str, Any]] = []
        self.log: deque[str] = deque(maxlen=8)
        self.head_reward: float | None = None
        self.started = time.monotonic()
        self.lock = threading.Lock()

    def on_event(self, e: dict[str, Any]) -> None:
        with self.lock:
            kind = e["kind"]
            if kind == "train.step":
                self.steps += 1
                m = e.get("metrics", {})
                self.log.append(f"train step {e['step']}: batch reward {m.get('batch_reward', 0):.2f}, "
                                f"{m.get('train_s', 0):.1f}s")
            elif kind == "gate":
                m = e.get("metrics", {})
                if e["verdict"] == "accepted":
                    self.accepted += 1
                else:
                    self.rejected += 1
                self.log.append(f"gate {e['verdict']}: {e['reason']} (held-out {m.get('eval_reward', 0):.2f})")
                if e["verdict"] == "accepted" and isinstance(m.get("eval_reward"), (int, float)):
                    self.head_reward = m["eval_reward"]
            elif kind == "release":
                self.releases.append(e)

    def render(self) -> Any:
        from rich.panel import Panel
        from rich.table import Table

        with self.lock:
            mean = sum(self.rewards) / len(self.rewards) if self.rewards else 0.0
            t = Table.grid(padding=(0, 2))
            t.add_row("elapsed", f"{time.monotonic() - self.started:.0f}s")
            t.add_row("requests", str(self.requests))
            t.add_row("moving reward", f"{mean:.3f} (last {len(self.rewards)} answers)")
            t.add_row("training steps", str(self.steps))
            t.add_row("gate", f"{self.accepted} accepted, {self.rejected} rejected")
            t.add_row("releases", str(len(self.releases)))
            head = "-" if self.head_reward is None else f"{self.head_reward:.3f}"
            t.add_row("head held-out", f"{head} (target {TARGET})")
            for line in self.log:
                t.add_row("", line)
        return Panel(t, title="reef demo: learning to answer with the quoted word")


def _follow(client_factory: Any, board: Board, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            with client_factory() as c:
                for event in c.events():
                    board.on_event(event)
                    if stop.is_set():
                        return
        except Exception:
            time.sleep(0.5)


@edge
def demo(
    seed: int = typer.Option(0, help="Random seed (tasks and sampling): runs are repeatable."),
    minutes: float = typer.Option(5.0, help="Stop after this many minutes."),
    scenario: str = typer.Option(None, help="Scenario name (default: a fresh demo-<time>)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON instead of a live display."),
) -> None:
    """Show the whole loop on the CPU: answers, feedback, training, gate, live releases, a better model."""
    from rich.console import Console
    from rich.live import Live

    from daemon.learning import loop_settings
    from recipes.tasks import get_family
    from reef_cli.client import Client, ensure_daemon
    from reef_cli.common import config

    cfg = config()
    console = Console(stderr=json_out)
    with console.status("starting the daemon"):
        client = ensure_daemon(cfg)
    family = get_family("say")
    wanted = {"gate": "compare", "margin": 1, "eval_family": "say", "eval_n": 64, "eval_seed": seed}
    trainer = loop_settings(wanted).trainer
    name = scenario or f"demo-{int(time.time())}"
    with console.status("creating the scenario (the first time, the daemon builds the demo model: a warm-up of "
                        "under a minute)"):
        created = client.post("/reef/scenarios", {"name": name, "recipe": "online-rl", "model": DEMO_MODEL,
                                                  "settings": wanted}, timeout=600)
    first_release = created["head"]
    rng = random.Random(seed)
    tasks = family.train_tasks(seed)
    held = family.held_out(64, seed)
    board = Board()
    stop = threading.Event()
    follower = threading.Thread(target=_follow, args=(lambda: Client(cfg, timeout=None), board, stop), daemon=True)
    follower.start()
    deadline = time.monotonic() + minutes * 60
    group, max_tokens = trainer["group_size"], trainer["max_new_tokens"]

    def one(prompt_task: Any) -> None:
        text, receipt, _ = _answer(client, name, prompt_task.prompt, temperature=1.0, max_tokens=max_tokens)
        score = family.score(prompt_task, text)
        client.post("/reef/report", {"score": score, "references": [receipt], "scenario": name})
        with board.lock:
            board.requests += 1
            board.rewards.append(family.exact(prompt_task, text))

    reached = False
    with Live(board.render(), console=console, refresh_per_second=4, transient=json_out) as live, \
            ThreadPoolExecutor(group) as pool:
        while time.monotonic() < deadline:
            list(pool.map(one, [rng.choice(tasks)] * group))
            live.update(board.render())
            if board.head_reward is not None and board.head_reward >= TARGET:
                reached = True
                break
    stop.set()
    chain = client.get(f"/reef/scenarios/{name}/releases")
    head = chain["head"]
    before = held_out_reward(client, name, first_release, held, family, max_tokens)
    after = held_out_reward(client, name, head, held, family, max_tokens)
    elapsed = time.monotonic() - board.started
    result = {"scenario": name, "seed": seed, "seconds": round(elapsed, 1), "reports": board.requests,
              "training_steps": board.steps, "releases": len(chain["releases"]), "held_out_before": before,
              "held_out_after": after, "reached_target": after >= TARGET}
    if json_out:
        import json

        print(json.dumps(result, indent=2))
    else:
        from rich.table import Table

        table = Table(title=f"release chain of {name}", box=None, header_style="bold")
        for col in ("", "step", "operation", "release", "held-out", "batch reward"):
            table.add_column(col)
        for r in chain["releases"]:
            m = r.get("metrics") or {}
            table.add_row("*" if r["release_id"] == head else "", str(r["step"]), r["operation"],
                          r["release_id"][:12], f"{m['eval_reward']:.2f}" if "eval_reward" in m else "-",
                          f"{m['batch_reward']:.2f}" if "batch_reward" in m else "-")
        console.print(table)
        console.print(f"held-out reward (64 prompts with words never trained on, greedy): "
                      f"{before:.2f} before -> {after:.2f} after, in {elapsed:.0f}s and {board.requests} reports")
    if not reached and after < TARGET:
        fail(f"the head reached {after:.2f}, below {TARGET}, within {minutes:g} minutes", 1)
