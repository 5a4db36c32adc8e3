"""``reef demo``: watch a model learn from feedback, on the CPU, in a few minutes.

The demo plays a client of the real HTTP API: it creates a fresh ``online-rl`` scenario on the demo model
(the tiny model with a short supervised warm-up on the task family, so it starts with a little skill), sends
rounds of small verifiable tasks (``say``: answer with the word asked for; each round is ``batch_prompts``
prompts asked ``group_size`` times each, sampled at temperature 1), scores every answer with the family's
checker, and reports the score by receipt. The daemon trains on those reports in its worker process, the gate
compares each candidate with the serving release on validation prompts, and winners go live. The demo measures
the head on held-out prompts (words never trained on, and not the gate's), greedy, through the API: when the
gate's figure nears the target, and at the end for the head and the first release.

``--recipe sao`` runs the same with one scored answer per training step (each step a release): two prompts at a
time, each its own step, the client waiting until the trainer has taken them before it asks the next two.

``--model smollm2`` (or any configured model other than the tiny ones: a real model) runs the same loop on
SmolLM2-135M-Instruct with a user preference it does not have: yes/no questions answered with ``Yes`` or ``No``
first (the ``yes-no`` family, recipes/tasks.py; held-out questions are about nouns training never asks about).
The recipe trains LoRA adapters (each release a few-MB adapter); the target is a rise of ``RISE`` over the head's
measured start, and at the end the demo prints one held-out answer before and after, verbatim. Settings
(``REAL_SETTINGS``, tuned offline with bench/preference_offline.py on one thread): see docs/learning.md, "The
demo on a real model".
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import typer

from reef_cli.common import edge, fail

if TYPE_CHECKING:  # recipes load where the demo runs
    from recipes.tasks import Task, TaskFamily

DEMO_MODEL = "tiny-demo"
TARGET = 0.8
# The demo scenario's recipe settings (over OnlineRLSettings' defaults): the regression gate publishes a candidate
# shown, at error rate 0.05, not to score 0.1 or more below the serving release on 128 validation prompts (paired;
# daemon/gate.py). 0.1 rather than 0.05: at 0.05 on 128 prompts a candidate as good as the head is turned away
# about half the time (when a tenth of the prompts differ), at 0.1 one time in fifteen (tests/test_gate_noise.py).
LEAD = 2  # rounds the client may be ahead of the trainer
# How long the client waits on a trainer that is not training before it asks the next round anyway: a round need not
# make a step (the held-out check reserves a share of the prompts, never trained on, so a round can fall short of a
# batch; records served too far behind the head are dropped). Measured: waiting out the full bound on each such
# round (10 s) was half of a demo's time (a 10 s silence every 8-10 steps)
IDLE_S = 1.0
# The tiny model trains all its weights (no LoRA), measured at lr 2e-3, batches of 8 x 8, two steps a batch;
# online-rl's defaults are for real models (LoRA, lr 3e-3, 4 x 8, one step: bench/learning_real.py)
# No canary (weights recipes have one by default, docs/releases.md), and the demo says so and why (``canary_note``):
# each release waits for its canary's verdict (one step trains ahead meanwhile), and a step of the demo moves its reward by far less than a canary tells
# apart in its 400 reports an arm: measured with the canary on, every canary ended as a tie (the head stays) and 5
# minutes made no release. The gate decides each step.
DEMO_SETTINGS: dict[str, Any] = {"gate": "regression", "margin": 0.1, "eval_family": "say", "eval_n": 128,
                                 "lr": 2e-3, "batch_prompts": 8, "steps_per_batch": 2, "canary_share": 0}
# sao (one rollout per step, each step a release): its periodic gate checks every 20th step on the same validation
# prompts; the client asks SAO_PARALLEL prompts at once and waits until the trainer has taken them (SAO_LEAD rounds
# ahead: none), since a record served more than one release behind the head is not trained on (its staleness
# bound): measured, a client 2 rounds ahead had most of its reports dropped and waited out its timeouts
SAO_SETTINGS: dict[str, Any] = {"gate": "periodic", "margin": 0.1, "eval_family": "say", "eval_n": 128,
                                "eval_every": 20, "canary_share": 0}
SAO_PARALLEL, SAO_LEAD = 2, 0
RECIPES = ("online-rl", "sao")
TINY_MODELS = ("tiny", "tiny-demo")  # built for the say family; any other model is a real one (yes-no)
# a real model (SmolLM2-135M-Instruct): the yes-no preference, LoRA adapters; batch and rate tuned offline
# (bench/preference_offline.py, docs/learning.md "The demo on a real model"): a smaller batch than the tiny model's
# (each answer costs ~300x more), one optimizer step per batch, and a higher learning rate (LoRA's usual range)
# its gate: margin 0.1 on 64 prompts (34 is the fewest on which 0.1 can be shown at 0.05; 32 could never decide);
# batch and rate are online-rl's defaults (4 x 8, one step, lr 3e-3)
REAL_SETTINGS: dict[str, Any] = {"gate": "regression", "margin": 0.1, "eval_family": "yes-no", "eval_n": 64,
                                 "lora": True, "lora_rank": 8, "lora_alpha": 16, "max_new_tokens": 8, "canary_share": 0}
REAL_TIMEOUT_S = 600.0  # a real model's requests (the default client's 30 s is the tiny model's)
RISE = 0.3  # a real model's target: its measured held-out start plus this
EXAMPLE_TOKENS = 40  # the before/after example answer: long enough to read as an answer
TITLES = {"say": "learning to answer with the word asked for",
          "yes-no": "learning to answer yes/no questions with Yes or No first"}


def _answer(c: Any, scenario: str, prompt: str, *, temperature: float, max_tokens: int,
            release: str | None = None, seed: int | None = None, model: str = DEMO_MODEL) -> tuple[str, str, str]:
    headers = {"x-reef-scenario": scenario}
    if release:
        headers["x-reef-release-id"] = release
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
                            "messages": [{"role": "user", "content": prompt}]}
    if seed is not None:
        body["seed"] = seed
    resp = c.request("POST", "/v1/chat/completions", raw=True, json=body, headers=headers)
    text = resp.json()["choices"][0]["message"]["content"] or ""
    return text, resp.headers["x-reef-agent-record-id"], resp.headers["x-reef-release-id"]


def canary_note(scores: list[float], before: float, after: float, releases: int) -> dict[str, Any]:
    """Why the demo runs without the canary a weights recipe has by default, in this run's own figures: the
    smallest difference a canary at its defaults tells apart on these scores (``betting.detectable`` at its
    ``max_reports`` pairs, with the variance of a difference of two of them), against what each release moved the
    held-out reward. Each release waits for its canary's verdict, and a canary that cannot tell its candidate from the
    head ends as a tie: the head stays, and the demo would not learn."""
    from daemon import betting
    from daemon.canary import DEFAULTS

    pairs, alpha = int(DEFAULTS["max_reports"] or 0), float(DEFAULTS["alpha"] or 0)
    mean = sum(scores) / len(scores) if scores else 0.0
    var = 2 * sum((x - mean) ** 2 for x in scores) / len(scores) if scores else 0.5  # of a paired difference
    smallest = betting.detectable(pairs, max(var, 1e-6), alpha)
    each = (after - before) / releases if releases else None
    told = "no difference" if smallest is None else f"differences of {smallest:.2f} or more"
    moved = ("far more than a step of the demo moves it" if each is None else
             f"while this run's {releases} releases moved the held-out reward by {each:+.3f} each on average")
    why = (f"canary: off in this demo (canary_share = 0). A weights recipe serves each candidate to half of new runs "
           f"as a canary by default, and each release waits for its verdict; at its defaults ({pairs} reports an arm, "
           f"alpha {alpha:g}) a canary tells apart {told} on these scores, {moved}: each canary would end as a tie, "
           "the head would stay, and the demo would not learn in minutes (docs/releases.md).")
    return {"canary_share": 0, "detectable": None if smallest is None else round(smallest, 3),
            "per_release": None if each is None else round(each, 4), "why": why}


def held_out_reward(c: Any, scenario: str, release: str, tasks: list[Task], family: TaskFamily, max_tokens: int,
                    model: str = DEMO_MODEL) -> float:
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda t: _answer(c, scenario, t.prompt, temperature=0, max_tokens=max_tokens,
                                                release=release, model=model)[0], tasks))
    return sum(family.exact(t, x) for t, x in zip(tasks, texts, strict=True)) / len(tasks)


class Board:
    """What the live display shows; fed by the client loop and the daemon's event stream."""

    def __init__(self, scenario: str, target: float = TARGET, recipe: str = "online-rl", family: str = "say") -> None:
        self.scenario, self.target, self.recipe, self.family = scenario, target, recipe, family
        self.requests = 0
        self.rewards: deque[float] = deque(maxlen=256)
        self.steps = 0
        self.done = 0  # steps finished (their gate verdict given, a release published or not): what the client paces on
        self.training = False  # a step started and not yet judged
        self.changed = time.monotonic()  # when a step last started or ended
        self.accepted = 0
        self.rejected = 0
        self.releases: list[dict[str, Any]] = []
        self.log: deque[str] = deque(maxlen=8)
        self.gate_reward: float | None = None  # the head's score on the gate's validation prompts
        self.held_out: float | None = None  # the head's held-out reward, last measured by the demo
        self.scores: deque[float] = deque(maxlen=4096)  # the scores reported (what a canary would judge)
        self.warning: str | None = None  # the early warning, when it paused the scenario's learning
        self.started = time.monotonic()
        self.lock = threading.Lock()

    def on_event(self, e: dict[str, Any]) -> None:
        if e.get("scenario") != self.scenario:
            return
        with self.lock:
            kind = e["kind"]
            if kind in ("train.start", "gate"):
                self.training, self.changed = kind == "train.start", time.monotonic()
            if kind == "train.step":
                self.steps += 1
                m = e.get("metrics", {})
                value = f", value loss {m['value_loss']:.3f}" if isinstance(m.get("value_loss"), (int, float)) else ""
                self.log.append(f"train step {e['step']}: batch reward {m.get('batch_reward', 0):.2f}{value}, "
                                f"{m.get('train_s', 0):.2f}s")
            elif kind == "gate":
                self.done += 1
                m = e.get("metrics", {})
                if e["verdict"] == "accepted":
                    self.accepted += 1
                else:
                    self.rejected += 1
                self.log.append(f"gate {e['verdict']}: {e['reason']} (validation {m.get('eval_reward', 0):.2f})")
                if e["verdict"] == "accepted" and isinstance(m.get("eval_reward"), (int, float)):
                    self.gate_reward = m["eval_reward"]
            elif kind == "release":
                self.releases.append(e)
            elif kind == "warning" and e.get("state") == "warned":
                self.warning = str(e.get("reason") or e.get("says"))

    def render(self) -> Any:
        from rich.panel import Panel
        from rich.table import Table

        with self.lock:
            mean = sum(self.rewards) / len(self.rewards) if self.rewards else 0.0
            t = Table.grid(padding=(0, 2))
            t.add_row("elapsed", f"{time.monotonic() - self.started:.0f}s")
            t.add_row("requests", str(self.requests))
            t.add_row("moving reward", f"{mean:.3f} (right answers, last {len(self.rewards)}, temperature 1)")
            t.add_row("training steps", str(self.steps))
            t.add_row("gate", f"{self.accepted} accepted, {self.rejected} rejected")
            t.add_row("releases", str(len(self.releases)))
            gate = "-" if self.gate_reward is None else f"{self.gate_reward:.3f}"
            t.add_row("head validation", f"{gate} (the gate's prompts)")
            held = "-" if self.held_out is None else f"{self.held_out:.3f}"
            t.add_row("head held-out", f"{held} (target {self.target})")
            t.add_row("canary", "off in this demo: its steps are far smaller than a canary tells apart (why: at the "
                      "end)")
            for line in self.log:
                t.add_row("", line)
        return Panel(t, title=f"reef demo: {TITLES.get(self.family, self.family)}")


def _example(c: Any, scenario: str, model: str, held: list[Task], family: TaskFamily, before: str, after: str
             ) -> dict[str, str]:
    """A held-out question answered greedily by the first release and the head (``EXAMPLE_TOKENS`` tokens): the
    first one the head answers the preferred way and the first release does not, else the first question."""
    def ask(job: tuple[Any, str]) -> str:
        return _answer(c, scenario, job[0].prompt, temperature=0, max_tokens=EXAMPLE_TOKENS, release=job[1],
                       model=model)[0]

    asked = held[:8]
    with ThreadPoolExecutor(8) as pool:  # batched by the engine
        old = list(pool.map(ask, [(t, before) for t in asked]))
        new = list(pool.map(ask, [(t, after) for t in asked]))
    pick = next((i for i, t in enumerate(asked) if family.exact(t, new[i]) and not family.exact(t, old[i])), 0)
    return {"question": asked[pick].prompt, "before": old[pick], "after": new[pick]}


def _make_built_in(cfg: Any, model: str, console: Any) -> None:
    """A built-in real model (smollm2) that is not made yet is made here, as ``reef model init`` makes it, so the
    wait shows; without the package it is made from, the error says what to install (``ModelUnavailable``)."""
    from daemon.model_dirs import BUILT_IN, init_built_in
    from daemon.models import is_complete

    entry = cfg.models[model]
    path = entry.path
    if path is None or path.parent != cfg.models_dir or path.name not in BUILT_IN or is_complete(path):
        return
    if path.name == "smollm2":
        from daemon.smollm2 import gguf_path

        gguf_path()  # what to install, before anything else
    with console.status(f"making the {path.name} model (once; reef model init {path.name} does the same)") as status:
        init_built_in(path, path.name, progress=lambda msg: status.update(msg))


def _follow(client_factory: Any, board: Board, stop: threading.Event) -> None:
    # from the daemon's recent history, not from now: a step that lands before the stream is connected must still
    # count (the client paces itself on the steps; sao's first step comes within a tenth of a second)
    last = 0
    while not stop.is_set():
        try:
            with client_factory() as c:
                for event in c.events(after=last):  # a reconnect misses nothing
                    last = event.get("seq", last)
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
    recipe: str = typer.Option("online-rl", help="The recipe that learns: online-rl (batches of scored groups) "
                               "or sao (one scored answer per step)."),
    target: float = typer.Option(None, help=f"Stop once the head's held-out reward reaches this (default: {TARGET} "
                                 f"on the tiny demo model, the measured start + {RISE} on a real model)."),
    model: str = typer.Option(DEMO_MODEL, help="The model that learns: tiny-demo (the say task), or a real model "
                              "such as smollm2 (a configured [models.NAME] entry: the yes-no preference, LoRA)."),
    max_reports: int = typer.Option(0, help="Stop after this many reports (0: no limit)."),
) -> None:
    """Show the whole loop on the CPU: answers, feedback, training, gate, live releases, a better model."""
    from rich.console import Console
    from rich.live import Live

    from recipes import load_recipe
    from recipes.tasks import get_family
    from reef_cli.client import Client, ensure_daemon
    from reef_cli.common import config

    if recipe not in RECIPES:
        fail(f"reef demo runs one of the recipes {', '.join(RECIPES)}, not {recipe!r}", 2)
    cfg = config()
    if model not in cfg.models:
        fail(f"unknown model {model!r}: configure it in {cfg.home / 'config.toml'} ([models.{model}] with "
             f"engine = \"transformers\" and path = \"/a/model/directory\"), or pick one of "
             f"{', '.join(sorted(cfg.models))}", 2)
    real = model not in TINY_MODELS
    if real and recipe != "online-rl":
        fail(f"reef demo on a real model runs the online-rl recipe (not {recipe!r})", 2)
    console = Console(stderr=json_out)
    if real:
        _make_built_in(cfg, model, console)
    with console.status("starting the daemon"):
        client = ensure_daemon(cfg)
    if real:  # a round's answers queue behind the engine's batches, on a CPU that also trains: minutes, not seconds
        client = Client(cfg, timeout=REAL_TIMEOUT_S)
    family = get_family("yes-no" if real else "say")
    sao = recipe == "sao"
    wanted = dict(REAL_SETTINGS if real else SAO_SETTINGS if sao else DEMO_SETTINGS, eval_seed=seed)
    trainer = dataclasses.asdict(load_recipe(recipe).parse_settings(wanted))
    name = scenario or f"demo-{int(time.time())}"
    building = "loading the model" if real else "the first time, the daemon builds the demo model: a supervised " \
        "warm-up of well under a minute"
    with console.status(f"creating the scenario ({building})"):
        created = client.post("/reef/scenarios", {"name": name, "recipe": recipe, "model": model,
                                                  "settings": wanted}, timeout=600)
    first_release = created["head"]
    rng = random.Random(seed)
    tasks = family.train_tasks(seed)
    held = family.held_out(64, seed)
    max_tokens = trainer["max_new_tokens"]
    start = None
    if real:  # the target is a rise over where this model starts, so measure the start first
        with console.status("measuring the model's start on 64 held-out questions"):
            start = held_out_reward(client, name, first_release, held, family, max_tokens, model)
        if target is None:
            target = min(1.0, round(start + RISE, 4))
    target = TARGET if target is None else target
    board = Board(name, target, recipe, family.name)
    board.held_out = start
    stop = threading.Event()
    follower = threading.Thread(target=_follow, args=(lambda: Client(cfg, timeout=None), board, stop), daemon=True)
    follower.start()
    deadline = time.monotonic() + minutes * 60
    # one round: online-rl's batch (batch_prompts prompts, each asked group_size times at once), trained as one
    # step; or sao's SAO_PARALLEL single prompts, each its own step
    prompts, group = (SAO_PARALLEL, 1) if sao else (trainer["batch_prompts"], trainer["group_size"])
    steps_per_round, lead = (prompts, SAO_LEAD) if sao else (1, LEAD)
    counter = iter(range(1 << 62))
    # each of the round's threads has its own client: with one client shared by 64 threads (its pool keeps 20
    # connections alive) a `reef demo` died once of EBADF reading a connection; the cause is not proven, and no
    # connection is shared between threads now
    local, made = threading.local(), []

    def own() -> Any:
        if getattr(local, "client", None) is None:
            local.client = Client(cfg, timeout=REAL_TIMEOUT_S if real else 30.0)
            with board.lock:
                made.append(local.client)
        return local.client

    def one(task: Any, request_seed: int) -> None:
        mine = own()
        text, receipt, _ = _answer(mine, name, task.prompt, temperature=1.0,
                                   max_tokens=max_tokens, seed=request_seed, model=model)
        score = family.score(task, text)
        mine.post("/reef/report", {"score": score, "references": [receipt], "scenario": name})
        with board.lock:
            board.requests += 1
            board.scores.append(score)
            board.rewards.append(family.exact(task, text))

    rounds, reached, forgiven = 0, False, 0
    warned: str | None = None  # the early warning the demo accepted
    measured_at = (None, -1e9)  # (head release, when)
    with Live(board.render(), console=console, refresh_per_second=4, transient=json_out) as live, \
            ThreadPoolExecutor(prompts * group) as pool:
        while time.monotonic() < deadline and not (max_reports and board.requests >= max_reports):
            if board.warning is not None and warned is None:
                # the early warning paused learning: the demo says so and accepts it, as a user may, and goes on. Its
                # scorer gives partial credit to an answer that starts with the word and runs on (0.4), so a tiny
                # model on its way to the exact word passes through repeating it, which the warning reads as
                # degenerate answers rewarded (measured: about one demo run in four, "held-out answers degenerate
                # 12% -> 38%" 70 s in, on the way to 0.3 held out)
                warned = board.warning
                client.post(f"/reef/scenarios/{name}/accept-warning", {})
                with board.lock:
                    board.log.append("early warning: " + warned.split(". Learning on")[0] + "; the demo accepts it "
                                     "and goes on (reef scenarios accept-warning)")
            # at most `lead` steps ahead of training: the trainer stays busy, and it trains on answers of the
            # current head (fresh samples), not on a backlog; a trainer that stops does not stop the client (a
            # record dropped as too stale makes no step, hence the bounded wait)
            wait_until = min(deadline, time.monotonic() + (2 if sao else 10))
            # (paced on finished steps: a round asked while the last step's release is still being published is
            # served by the release before it, and its second answer would then be too stale to train on)
            need = (rounds - lead) * steps_per_round - forgiven
            asked = time.monotonic()
            while board.done < need and time.monotonic() < wait_until and (
                    board.training or time.monotonic() - max(asked, board.changed) < IDLE_S):
                time.sleep(0.005 if sao else 0.02)
            forgiven += max(0, need - board.done)  # dropped as too stale (they never make a step): not waited on again
            rounds += 1
            round_tasks = [t for t in rng.sample(tasks, prompts) for _ in range(group)]
            list(pool.map(one, round_tasks, [seed * 1_000_003 + next(counter) for _ in round_tasks]))
            live.update(board.render())
            if board.gate_reward is not None and board.gate_reward >= target - 0.1:
                head = client.get(f"/reef/scenarios/{name}/releases", limit=1)["head"]
                if head != measured_at[0] and time.monotonic() - measured_at[1] > 5:
                    board.held_out = held_out_reward(client, name, head, held, family, max_tokens, model)
                    measured_at = (head, time.monotonic())
                    if board.held_out >= target:
                        reached = True
                        break
    stop.set()
    for made_client in made:
        made_client.close()
    elapsed = time.monotonic() - board.started
    chain = client.get(f"/reef/scenarios/{name}/releases")
    head = chain["head"]
    before = start if start is not None else held_out_reward(client, name, first_release, held, family, max_tokens,
                                                             model)
    after = board.held_out if reached and board.held_out is not None else \
        held_out_reward(client, name, head, held, family, max_tokens, model)
    result: dict[str, Any] = {
        "scenario": name, "seed": seed, "seconds": round(elapsed, 1), "reports": board.requests,
        "training_steps": board.steps, "releases": len(chain["releases"]), "held_out_before": before,
        "held_out_after": after, "reached_target": after >= target, "recipe": recipe, "target": target,
        "model": model, "family": family.name,
        "canary": canary_note(list(board.scores), before, after, len(chain["releases"]) - 1),
        **({"warning_accepted": warned} if warned else {})}
    if real:  # one held-out question the head now gets right (the first one, if none), answered by both, verbatim
        example = _example(client, name, model, held, family, first_release, head)
        result["example"] = example
    if json_out:
        import json

        print(json.dumps(result, indent=2))
    else:
        from rich.table import Table

        console.print()  # piped output: the live panel's last frame ends without a newline
        table = Table(title=f"release chain of {name}", box=None, header_style="bold")
        for col in ("", "step", "operation", "release", "validation", "batch reward"):
            table.add_column(col)
        shown = chain["releases"]
        if len(shown) > 16:  # newest first: the last 14 and the init release
            table.caption = f"{len(shown) - 15} releases between not shown (reef releases list -s {name})"
            shown = shown[:14] + shown[-1:]
        for r in shown:
            m = r.get("metrics") or {}
            table.add_row("*" if r["release_id"] == head else "", str(r["step"]), r["operation"],
                          r["release_id"][:12], f"{m['eval_reward']:.2f}" if "eval_reward" in m else "-",
                          f"{m['batch_reward']:.2f}" if "batch_reward" in m else "-")
        console.print(table)
        unseen = "questions about nouns never trained on" if real else "prompts with words never trained on"
        console.print(f"held-out reward (64 {unseen}, greedy): "
                      f"{before:.2f} before -> {after:.2f} after, in {elapsed:.0f}s and {board.requests} reports")
        console.print(result["canary"]["why"], markup=False, highlight=False)
        if warned:
            console.print(f"early warning (accepted by the demo, which went on): {warned}", markup=False,
                          highlight=False)
        if real:
            console.print(f"{example['question']}\n  before: {example['before']!r}\n  after:  {example['after']!r}",
                          markup=False, highlight=False)
    if after < target:
        limit = f"{minutes:g} minutes" + (f" or {max_reports} reports" if max_reports else "")
        fail(f"the head reached {after:.2f}, below {target}, within {limit}", 1)
