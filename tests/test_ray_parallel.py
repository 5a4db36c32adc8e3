"""``trainer_workers``: online-rl's step as data-parallel Ray Train workers on a real Ray cluster of two nodes on this
machine (a head from ``ray start --head`` and a second node joined to it, each with one CPU and its own temp dir, on
127.0.0.1 only; ``tests/ray_cluster.py``). The model is the tiny one with LoRA adapters (``lora = true``): SmolLM2
would take minutes a step on this 2-core machine (``bench/ray_scaling.py`` measures it)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from daemon.releases import ReleaseStore
from recipes.base import FeedbackReport, ScoredExchange, TrainJob
from recipes.online_rl import OnlineRLSettings
from tests.conftest import Daemon, make_home
from tests.ray_cluster import RAY_ENV, Cluster
from tests.test_learning import releases, wait_for

# the 2-worker adapter's distance from the 1-worker one, relative to how far the step moved it: measured 4e-7 to
# 1.3e-4 on a first step (the same sums in another order, which AdamW's first step, about lr * sign(gradient),
# amplifies where a gradient is near 0), against 1.4 for the same step on another batch
TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        c.head()
        c.join(resources='{"second": 1}')
        yield c  # starting (the daemon starts meanwhile and waits for it)
    finally:
        c.close()
        # nothing of it left running: no process of any node (a Ray worker whose raylet was killed leaves on its
        # own, within seconds), found by the node's temp dir in its command line
        wait_for(lambda: not c.leftovers(), timeout=60, what="the cluster's processes to leave")


HELD = '''
import os
import time
from dataclasses import dataclass
from pathlib import Path

from recipes.online_rl import OnlineRL, OnlineRLSettings


@dataclass
class Settings(OnlineRLSettings):
    hold: str = ""  # a directory: each worker writes started-<pid> there, then waits while a file named wait is there


class HeldRL(OnlineRL):
    """online-rl, whose step waits at its start while the test says so (to lose a node in the middle of a step)."""

    Settings = Settings

    def train(self, job, state):
        hold = Path(self.settings.hold)
        (hold / f"started-{os.getpid()}").write_text(job.id)
        deadline = time.monotonic() + 120  # a hang guard only: the test removes wait
        while (hold / "wait").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().train(job, state)
'''
# small batches (2 prompts x 2 answers), LoRA on the tiny model, straight to the head: these tests are about where and
# how a step runs, not the gate (the held-out check and the canary have their own tests)
SETTINGS = {"lora": True, "lr": 1e-2, "batch_prompts": 2, "group_size": 2, "canary_share": 0, "heldout_check": False}


@pytest.fixture(scope="module")
def daemon(cluster: Cluster, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon training on the cluster with trainer_workers = 2 (a worker on each node)."""
    recipes = tmp_path_factory.mktemp("held-recipes")
    (recipes / "heldrl.py").write_text(HELD)
    home, port, env = make_home(tiny_model)
    cfg = home / "config.toml"
    cfg.write_text(f'trainer = "ray"\nray_address = "{cluster.address}"\ntrainer_workers = 2\n'
                   f'recipe_paths = [{json.dumps(str(recipes))}]\n' + cfg.read_text())
    env.update(RAY_ENV)
    d = Daemon(home=home, port=port, env=env).start()
    cluster.wait_cpus(2)
    yield d
    d.stop()
    shutil.rmtree(home, ignore_errors=True)


_asked = iter(range(10**6))


def ask_and_score(c: httpx.Client, scenario: str, n: int = 4) -> list[str]:
    """``n`` answers served on ``scenario``, two to a prompt, reported with scores 0 and 1 in turn: a batch."""
    receipts = []
    for _ in range(n):
        word = next(_asked) // 2
        r = c.post(f"/s/{scenario}/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": f'Say "w{word}".'}]})
        assert r.status_code == 200, r.text
        receipts.append(r.headers["x-reef-agent-record-id"])
    for i, rec in enumerate(receipts):
        assert c.post("/reef/report", json={"score": float(i % 2), "references": [rec]}).status_code == 201
    return receipts


def served_by(c: httpx.Client, scenario: str) -> str:
    r = c.post(f"/s/{scenario}/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    return r.headers["x-reef-release-id"]


def scored_batch(model_dir: Path, seed: int, prompts: int = 2, group: int = 4) -> list[ScoredExchange]:
    """Answers the tiny model samples to ``prompts`` prompts, ``group`` each, scored so that every group carries
    signal; ``seed`` picks the prompts' words and the samples."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.online_rl import eos_ids, generate, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    words = ["file", "window", "river", "stone", "cloud", "paper"]
    ids = [render_prompt(tokenizer, f"Say {words[(seed * prompts + i) % len(words)]}.") for i in range(prompts)]
    rows = [i for i in range(prompts) for _ in range(group)]
    outs = generate(model, [ids[i] for i in rows], eos=eos_ids(model, tokenizer), max_new_tokens=6,
                    generator=torch.Generator().manual_seed(seed))
    return [ScoredExchange(id=f"rec_{seed}_{n}", release_id=None, prompt_token_ids=ids[i], token_ids=tokens,
                           logprobs=logprobs, report=FeedbackReport(id=f"rep_{seed}_{n}", seq=n + 1, score=n % 2))
            for n, (i, (tokens, logprobs)) in enumerate(zip(rows, outs, strict=True))]


def adapter(path: str | None) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from daemon import lora

    assert path is not None
    return load_file(str(Path(path) / lora.WEIGHTS))


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """How far adapter ``a`` is from ``b``, relative to how far ``b``'s step moved it from ``start``."""
    assert a.keys() == b.keys() == start.keys()
    moved = sum(float((b[k] - start[k]).norm() ** 2) for k in b) ** 0.5
    return sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5 / moved


def recorded(c: httpx.Client, receipts: list[str]) -> list[ScoredExchange]:
    """The scored exchanges behind ``receipts`` (scored 0 and 1 in turn, as ``ask_and_score`` reported them)."""
    out = []
    for n, rid in enumerate(receipts):
        rec = c.get(f"/reef/records/{rid}").json()
        out.append(ScoredExchange(id=rid, release_id=rec["release_id"], prompt_token_ids=rec["prompt_token_ids"],
                                  token_ids=rec["token_ids"], logprobs=rec["logprobs"],
                                  report=FeedbackReport(id=f"rep_{n}", seq=n + 1, score=float(n % 2))))
    return out


def test_two_nodes_train_online_rl_into_served_releases_equal_to_the_one_worker_steps(
        daemon: Daemon, tiny_model: Path, tmp_path: Path) -> None:
    from safetensors.torch import load as load_bytes

    from daemon import lora
    from daemon.trainer.step import run_job

    steps = []
    with daemon.http() as c:
        r = c.post("/reef/scenarios", json={"name": "dp", "recipe": "online-rl", "settings": SETTINGS})
        assert r.status_code == 201, r.text
        init = releases(c, "dp")["releases"][-1]
        for n in (1, 2):  # the second goes on from the first (the workers keep its model and optimizer)
            receipts = ask_and_score(c, "dp")
            chain = wait_for(lambda: ((x := releases(c, "dp", all_=True))["releases"][0]["step"] == n  # noqa: B023
                                      or x["rejected"]) and x, timeout=300, what=f"step {n}")  # a hang guard
            assert chain["rejected"] == [], chain["rejected"]
            head = chain["releases"][0]
            assert head["operation"] == "train" and sorted(head["receipts"]) == sorted(receipts)
            # two workers, one a node, each on half of the batch's 4 answers
            assert head["metrics"]["trainer_workers"] == 2 and head["metrics"]["shard_samples"] == 2
            assert served_by(c, "dp") == head["release_id"]
            steps.append((recorded(c, receipts), head))
    store = ReleaseStore(daemon.home / "artifacts.git")
    # the same steps in one process (the local trainer's), and the first on another batch
    settings = OnlineRLSettings(**SETTINGS).to_dict()

    def one(states: dict[str, Any], batch: list[ScoredExchange], name: str, base: tuple[str, str]
            ) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
        job = TrainJob(id=name, recipe="online-rl", settings=settings, batch=batch, base_key=base[0],
                       base_path=base[1], head_key=init["content_id"], head_path=str(tiny_model), candidate_key=name,
                       model_key=init["content_id"], model_release=init["release_id"], model_path=str(tiny_model))
        candidate = run_job(states, job, tmp_path / name)
        assert candidate.path is not None
        return adapter(candidate.path), candidate.metrics, candidate.path

    states: dict[str, Any] = {}
    first, first_metrics, first_dir = one(states, steps[0][0], "first", (init["content_id"], str(tiny_model)))
    second, second_metrics, _ = one(states, steps[1][0], "second", ("first", first_dir))
    other, _, _ = one({}, scored_batch(tiny_model, seed=1, prompts=2, group=2), "other",
                      (init["content_id"], str(tiny_model)))
    start = {k: v if "lora_A" in k else torch.zeros_like(v) for k, v in first.items()}  # B starts at 0, A seeded
    for (_, head), mine, metrics, before in ((steps[0], first, first_metrics, start),
                                             (steps[1], second, second_metrics, first)):
        published = load_bytes(store.read_file(head["release_id"], lora.WEIGHTS))
        near = distance(published, mine, before)
        print(f"step {head['step']}: 2 workers vs 1: {near:.2e}")
        assert near < TOLERANCE
        # the summed gradient is the whole batch's, not a multiple of it (AdamW's step hides a scale; these do not)
        for key in ("grad_norm", "pg_loss", "kl_ref", "ratio_mean", "clip_frac", "kl_from_base"):
            assert abs(head["metrics"][key] - metrics[key]) <= 1e-4 * max(1.0, abs(metrics[key])), key
    far = distance(other, first, start)
    print(f"another batch: {far:.2e}")
    assert far > TOLERANCE


def test_a_lost_node_a_short_cluster_a_stranger_node_and_no_cluster(daemon: Daemon, cluster: Cluster,
                                                                     tmp_path: Path) -> None:
    from tests.conftest import ROOT

    hold = tmp_path / "hold"
    hold.mkdir()
    with daemon.http() as c:
        r = c.post("/reef/scenarios", json={"name": "ft", "recipe": "heldrl:HeldRL",
                                            "settings": {**SETTINGS, "hold": str(hold)}})
        assert r.status_code == 201, r.text
        # a node lost in the middle of a step: the step goes again on the node left, and is published once
        (hold / "wait").touch()
        receipts = ask_and_score(c, "ft")
        first = wait_for(lambda: len(x := sorted(hold.glob("started-*"))) == 2 and x, timeout=300,
                         what="both workers to start the step")
        cluster.nodes[1].kill()
        cluster.wait_cpus(1)
        (hold / "wait").unlink()
        while releases(c, "ft")["releases"][0]["step"] == 0:  # serving goes on meanwhile
            assert served_by(c, "ft")
            time.sleep(0.2)
        chain = releases(c, "ft", all_=True)
        head = chain["releases"][0]
        assert sorted(head["receipts"]) == sorted(receipts) and chain["rejected"] == []
        assert head["metrics"]["trainer_workers"] == 1  # on the node left
        retried = [p for p in hold.glob("started-*") if p not in first]
        assert len(retried) == 1 and retried[0].read_text() == first[0].read_text()  # the same job, once more
        assert served_by(c, "ft") == head["release_id"]

        def failed(n: int) -> str:
            chain = wait_for(lambda: (len((x := releases(c, "ft", all_=True))["rejected"]) == n
                                      or x["releases"][0]["release_id"] != head["release_id"]) and x, timeout=300,
                             what=f"failed step {n}")
            assert chain["releases"][0]["release_id"] == head["release_id"]  # nothing else published
            step = chain["rejected"][0]
            assert step["verdict"] == "failed", step
            return str(step["reason"])

        # trainer_workers above the cluster's CPUs: refused with both numbers
        ask_and_score(c, "ft")
        reason = failed(1)
        assert f"trainer_workers = 2 needs 2 CPUs (one a worker); the Ray cluster at {cluster.address} has 1 CPU " \
               "on 1 node" in reason, reason
        # a node whose torch is another version than the daemon's: refused, naming both
        fake = tmp_path / "fake" / "torch-0.0.1.dist-info"
        fake.mkdir(parents=True)
        (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 0.0.1\n")
        cluster.join(env={"PYTHONPATH": f"{fake.parent}:{ROOT}"})
        cluster.wait_cpus(2)
        ask_and_score(c, "ft")
        reason = failed(2)
        assert "torch 0.0.1 where the daemon has torch " + torch.__version__ in reason, reason
        # the cluster gone: the step fails with the reason at once, once, and serving goes on (the driver may be the
        # same process or a restarted one: Ray's core worker sometimes exits when its head is lost; a full run saw
        # the trainer's pid change here)
        for node in cluster.nodes:
            node.kill()
        ask_and_score(c, "ft")
        reason = failed(3)
        assert f"the Ray cluster at {cluster.address} does not answer: Connection refused" in reason, reason
        assert served_by(c, "ft") == head["release_id"]
        assert len(releases(c, "ft", all_=True)["rejected"]) == 3


# --- the parts that need no cluster ----------------------------------------------------------------------------


def test_the_mailbox_hands_a_job_out_three_times_at_most_and_stops_an_old_session() -> None:
    from daemon.trainer.ray_parallel import STOP, TRIES, _Mailbox

    box = _Mailbox(TRIES)
    box.open(1)
    assert box.take(1, 0) is None  # nothing yet
    box.submit(7, "payload")
    for _ in range(TRIES):  # the first try and two retries, each a group that lost a worker and asks again
        assert box.take(1, 0) == 7 and box.job(7) == "payload"
    assert box.take(1, 0) is None
    kind, why = box.status(7, 0)["result"]
    assert kind == "failed" and f"lost {TRIES} times" in why
    box.submit(8, "next")
    assert box.take(1, 0) == 8
    box.post(8, "done", "candidate")
    box.post(8, "failed", "a late word")  # the first word on a job stands
    assert box.status(8, 0)["result"] == ("done", "candidate")
    assert box.take(1, 0) is None  # answered and handed over: never run again
    box.open(2)  # a new session: the old one's rank 0 is told to stop
    assert box.take(1, 0) == STOP
    box.end(2)
    assert box.take(2, 0) == STOP


def test_a_lost_peer_is_told_from_a_recipe_error() -> None:
    from daemon.trainer.ray_parallel import _comm_error

    # what gloo raised on the worker left when its peer's node was killed (measured, torch 2.13)
    assert _comm_error(RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                                    "Connection closed by peer [127.0.0.1]:2975"))
    assert not _comm_error(RuntimeError("CUDA out of memory"))
    assert not _comm_error(ValueError("train_step needs at least one sample"))


def test_versions_differ_only_where_both_are_known() -> None:
    from daemon.trainer.ray_parallel import mismatch

    daemon = {"torch": "2.13.0", "reef": "0.1.0"}
    assert mismatch(daemon, dict(daemon)) is None
    assert mismatch(daemon, {"torch": "2.13.0", "reef": None}) is None  # Reef's code travels with the job
    assert mismatch(daemon, {"torch": "2.12.1", "reef": "0.2.0"}) == \
        "torch 2.12.1 where the daemon has torch 2.13.0; reef 0.2.0 where the daemon has reef 0.1.0"


@pytest.mark.parametrize(("toml", "message"), [
    ("trainer_workers = 2", 'trainer_workers needs trainer = "ray"'),
    ('trainer = "ray"\ntrainer_workers = 0', "at least 1, got 0"),
    ('trainer = "ray"\ntrainer_workers = "2"', "at least 1, got '2'"),
    ('trainer = "ray"\ntrainer_workers = true', "at least 1, got True"),
])
def test_a_worker_count_that_cannot_work_is_refused(tmp_path: Path, toml: str, message: str) -> None:
    from daemon.config import load_config
    from daemon.errors import BadRequest

    (tmp_path / "config.toml").write_text(toml + "\n")
    with pytest.raises(BadRequest, match=message):
        load_config({"REEF_HOME": str(tmp_path)})


def test_a_cluster_address_where_nothing_listens_fails_at_once() -> None:
    import socket

    from daemon.errors import StepFailed
    from daemon.trainer.ray_trainer import _reachable
    from tests.conftest import free_port

    port = free_port()
    with pytest.raises(StepFailed, match=f"the Ray cluster at 127.0.0.1:{port} does not answer: Connection refused"):
        _reachable(f"127.0.0.1:{port}")
    with socket.create_server(("127.0.0.1", 0)) as server:
        _reachable(f"127.0.0.1:{server.getsockname()[1]}")  # something answers: Ray takes it from there
    for left_to_ray in ("auto", "ray://127.0.0.1:10001", "localhost"):
        _reachable(left_to_ray)
