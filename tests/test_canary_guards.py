"""The canary's guards on a live daemon (issue 43): a candidate whose arm fails its exchanges, and one whose arm is
slower, each end a running canary that the learning loop started; a healthy candidate under the same traffic runs on.

Every candidate here is a real weights release that a real recipe trained, that passed the gate and the held-out
check, and that the engine really serves; what differs is in its weights (``ALTERED``, a recipe written for these
tests; the tiny model has random weights, so these are the failures that can be made real on it):
- ``poisoned``: the input embeddings of the tokens of one word (``trigger``) that no held-out probe uses are NaN,
  the output head left as it was (untied). Every prompt without that word is answered exactly as the head answers
  it (the held-out check sees no difference), and every prompt with it fails in the engine ("no finite logits"):
  a diverged row that only the users' own prompts reach, which only a live guard can catch.
- ``deeper``: ``extra_layers`` more decoder layers whose output projections are zero: each adds nothing to the
  residual stream, so its answers are the head's bit for bit, and each costs a layer's compute. A real slower arm.
- ``template``: the head's weights, with a chat template that raises (a division by zero, not a template error)
  on a prompt holding the trigger word: a failure of the engine's preparation that Reef's own error tree does not
  name, which no held-out probe reaches.
- ``looping``: every layer's output projections zero (the residual stream is the current token's embedding), one
  embedding dimension set to a constant that the final norm alone passes on, and an untied output head that turns
  it into one token's logit far above the rest: whatever it is asked, sampled or greedy, it says that token again
  and again. (Its greedy answers drift far from the head's, so its scenario runs with the held-out check off: the
  canary's own loop guard is what is tested.)
- ``same``: the head's weights copied: the healthy candidate, for the negative case.
"""

from __future__ import annotations

import json
from typing import Any

from tests.conftest import Daemon, assert_canonical_error
from tests.test_canary import canary_of
from tests.test_recipes import recipe_dir, with_recipe_paths  # noqa: F401 - the fixture, used by name
from tests.test_records_pg import _until

ALTERED = '''
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from recipes.base import Candidate, GateSettings, Recipe, Scores


@dataclass
class Settings(GateSettings):
    change: str = "same"  # same | poisoned | deeper | template | looping
    trigger: str = "zebra"  # poisoned: the word whose tokens' input embeddings are NaN; template: that raises
    extra_layers: int = 30  # deeper: layers added, each adding nothing to the residual stream


class Altered(Recipe):
    """A weights recipe whose candidate is the head's weights changed in one of three ways (the test's docstring)."""

    name = "altered"
    kind = "weights"
    source = "scores"
    Settings = Settings

    def batch(self, records):
        return records[:2] if len(records) >= 2 else None

    def train(self, job, state):
        import torch
        from safetensors.torch import load_file, save_file
        from tokenizers import Tokenizer

        from daemon.gating.heldout import PROBES_FILE

        base, out, s = Path(job.base_path), Path(job.work_dir), job.settings
        for f in base.iterdir():
            if f.is_file() and f.name not in ("model.safetensors", "config.json"):
                shutil.copyfile(f, out / f.name)
        config = json.loads((base / "config.json").read_text())
        weights = load_file(base / "model.safetensors")
        if s["change"] == "poisoned":
            tok = Tokenizer.from_file(str(base / "tokenizer.json"))
            probed = {i for p in json.loads(PROBES_FILE.read_text())["probes"] for i in tok.encode(p["prompt"]).ids}
            probed |= set(tok.encode("hi").ids)
            word = tok.encode(" " + s["trigger"])
            poisoned = [i for i, t in zip(word.ids, word.tokens) if i not in probed and len(t) > 1]
            assert poisoned, word.tokens
            embed = weights["model.embed_tokens.weight"]
            weights["lm_head.weight"] = embed.clone()  # the output head as it was
            embed[poisoned] = float("nan")
            config["tie_word_embeddings"] = False
        elif s["change"] == "deeper":
            n = config["num_hidden_layers"]
            first = {k[len("model.layers.0."):]: v for k, v in weights.items() if k.startswith("model.layers.0.")}
            for layer in range(n, n + s["extra_layers"]):
                for k, v in first.items():
                    zero = k.endswith(("o_proj.weight", "down_proj.weight"))
                    weights[f"model.layers.{layer}.{k}"] = torch.zeros_like(v) if zero else v.clone()
            config["num_hidden_layers"] = n + s["extra_layers"]
        elif s["change"] == "looping":
            tok = Tokenizer.from_file(str(base / "tokenizer.json"))
            word = tok.encode(" la").ids[-1]
            for k, v in weights.items():
                if k.endswith(("o_proj.weight", "down_proj.weight")):
                    weights[k] = torch.zeros_like(v)
            embed = weights["model.embed_tokens.weight"]
            head = torch.zeros_like(embed)
            head[word, 0] = 100.0
            embed[:, 0] = 10.0
            weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
            weights["model.norm.weight"][0] = 1.0
            weights["lm_head.weight"] = head
            config["tie_word_embeddings"] = False
        elif s["change"] == "template":
            tc = json.loads((out / "tokenizer_config.json").read_text())
            raises = "{% if '" + s["trigger"] + "' in (messages[-1]['content'] | string) %}{{ 1 // 0 }}{% endif %}"
            tc["chat_template"] = raises + tc["chat_template"]
            (out / "tokenizer_config.json").write_text(json.dumps(tc))
        (out / "config.json").write_text(json.dumps(config))
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        return Candidate(metrics={}, eval=Scores(candidate=[0.5] * 4, base=[0.5] * 4))
'''

ASK = {"model": "tiny", "max_tokens": 12, "temperature": 0,
       "messages": [{"role": "user", "content": "Tell me about the zebra."}]}


def altered(daemon_factory: Any, recipe_dir: Any) -> Daemon:  # noqa: F811
    (recipe_dir / "altered.py").write_text(ALTERED)
    return with_recipe_paths(daemon_factory, recipe_dir)


def start_canary(c: Any, name: str, change: str, **settings: Any) -> tuple[str, str]:
    """A scenario whose first candidate (``change``) serves as a canary by default: (head, candidate)."""
    made = c.post("/reef/scenarios", json={"name": name, "recipe": "altered:Altered",
                                           "settings": {"change": change, **settings}})
    assert made.status_code == 201, made.text
    head = made.json()["head"]
    hi = {**ASK, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(2):  # a batch, on the head
        r = c.post(f"/s/{name}/v1/chat/completions", headers={"x-reef-release-id": head}, json=hi)
        assert r.status_code == 200, r.text
        assert c.post("/reef/report", json={"references": [r.headers["x-reef-agent-record-id"]], "score": 1.0}
                      ).status_code == 201
    running = _until(f"the canary of {name}", lambda: canary_of(c, name), 300)
    assert running["base_id"] == head and running["share"] == 0.5
    return head, running["release_id"]


def test_failed_and_slow_exchanges_on_the_canary_arm_end_a_live_canary_and_a_healthy_one_runs_on(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    """Three scenarios, each with its first candidate as a canary at the defaults, under the same traffic: runs (no
    reports) asking a prompt with the trigger word. The poisoned candidate fails every exchange on its arm and is
    ended for its errors (``canary-errors``) once it has ``min_exchanges`` (20); the deeper one answers as the head
    does, slower, and is ended for latency (``canary-latency``); the copy of the head, after more canary exchanges
    than either had, still runs, undecided, with no failed exchange. The head arm of each answered every request.
    Bugs caught: failed exchanges not counted on the canary's arm (its errors read from the wrong column or arm),
    the error or latency guard not wired into the live judge, a guard that ends a healthy canary."""
    d = altered(daemon_factory, recipe_dir)
    with d.http() as c:
        arms = {name: start_canary(c, name, change) for name, change in
                (("gx", "poisoned"), ("gl", "deeper"), ("gs", "same"))}
        served: dict[str, dict[str, list[int]]] = {name: {"head": [], "canary": []} for name in arms}
        for i in range(400):
            running = [name for name in arms if canary_of(c, name) is not None]
            if running == ["gs"] and len(served["gs"]["canary"]) >= max(len(served[n]["canary"]) for n in arms) \
                    and len(served["gs"]["head"]) >= 20:  # (the arms split runs at random: both past min_exchanges)
                break
            if "gs" not in running:
                ended = c.get("/reef/scenarios/gs/releases", params={"all": "1"}).json()["rejected"]
                raise AssertionError(f"the healthy canary was ended: {ended}")
            for name in running:
                head, cand = arms[name]
                r = c.post(f"/s/{name}/r/run_{i:04d}/v1/chat/completions", json=ASK)
                # a failed exchange has a record too (its receipt in the header): it names the release it was on
                arm = r.headers.get("x-reef-release-id") or c.get(
                    f"/reef/records/{r.headers['x-reef-agent-record-id']}").json()["release_id"]
                assert arm in (head, cand), arm
                served[name]["canary" if arm == cand else "head"].append(r.status_code)
                if r.status_code != 200:
                    assert_canonical_error(r, 500)
        else:
            raise AssertionError(f"the guards did not end the canaries: {served}")
        for name, verdict, says in (("gx", "canary-errors", "failed"), ("gl", "canary-latency", "median time")):
            head, cand = arms[name]
            chain = c.get(f"/reef/scenarios/{name}/releases", params={"all": "1"}).json()
            assert chain["head"] == head, name
            ended = next(j for j in chain["rejected"] if j["candidate"] == cand)
            assert ended["verdict"] == verdict and says in ended["reason"], ended
            assert set(served[name]["head"]) == {200}, (name, served[name])
        assert set(served["gx"]["canary"]) == {500} and len(served["gx"]["canary"]) >= 20
        gx = next(j for j in c.get("/reef/scenarios/gx/releases", params={"all": "1"}).json()["rejected"])
        assert gx["metrics"]["canary_errors"] == gx["metrics"]["canary_exchanges"] >= 20, gx["metrics"]
        assert set(served["gl"]["canary"]) == {200}
        gl = next(j for j in c.get("/reef/scenarios/gl/releases", params={"all": "1"}).json()["rejected"])
        assert gl["metrics"]["canary_p50_ms"] > 2 * gl["metrics"]["head_p50_ms"], gl["metrics"]
        healthy = canary_of(c, "gs")
        assert healthy["release_id"] == arms["gs"][1] and healthy["decision"] is None, healthy
        f = healthy["figures"]
        assert f["canary_exchanges"] >= 20 and f["canary_errors"] == 0 and set(served["gs"]["canary"]) == {200}
        assert min(len(served["gs"]["head"]), len(served["gs"]["canary"])) >= 20, served["gs"]


def test_a_healthy_canary_under_bursts_of_concurrent_requests_is_not_ended_for_latency(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    """``reef demo``'s traffic: rounds of 64 requests at once, half on each arm. The copy of the head runs on after
    three rounds (more than ``min_exchanges`` on each arm from the first), undecided. Bug caught (found by the demo with its canary on): the candidate loaded by its first request, so the
    whole first round on its arm waited for the load behind the head's answers (medians of 343 ms against 156 ms:
    ended for latency, and so was the next candidate): its load is now an event before the canary's start (the burst
    alone shows the bug only on some runs, as the load's time and the round's order vary)."""
    from concurrent.futures import ThreadPoolExecutor

    d = altered(daemon_factory, recipe_dir)
    with d.http() as c:
        head, cand = start_canary(c, "gb", "same", canary_answers=10_000)  # no promotion on its guards here
        loaded = False  # the candidate's load (chains.preload's event), before its canary started
        with c.stream("GET", "/reef/events", params={"after": 0}, timeout=30) as resp:
            for line in resp.iter_lines():
                event = json.loads(line[6:]) if line.startswith("data: ") else {}
                loaded |= event.get("kind") == "engine.load" and event.get("release_id") == cand
                if event.get("kind") == "canary.start" and event.get("scenario") == "gb":
                    break
        assert loaded, "the candidate was not loaded before its canary started"

        def ask(i: int) -> str:
            r = c.post(f"/s/gb/r/run_{i:04d}/v1/chat/completions", json=ASK)
            assert r.status_code == 200, r.text
            return str(r.headers["x-reef-release-id"])

        with ThreadPoolExecutor(64) as pool:
            for round_ in range(3):
                served = list(pool.map(ask, range(64 * round_, 64 * (round_ + 1))))
                if set(served) != {head, cand}:
                    ended = c.get("/reef/scenarios/gb/releases", params={"all": "1"}).json()["rejected"]
                    raise AssertionError(f"the healthy canary was ended in round {round_}: {ended}")
        status = canary_of(c, "gb")
        assert status is not None and status["release_id"] == cand and status["decision"] is None, status
        f = status["figures"]
        assert min(f["canary_exchanges"], f["head_answers"]) >= 40, f



def test_failures_before_the_first_token_count_on_the_canary_arm_and_end_it(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    """A request routed to a canary's arm that fails before the engine has answered anything is an exchange that
    failed on that arm: answered with the error and its receipt, recorded on the candidate with status ``error`` and
    the reason, counted by the error guard, which ends the canary (``canary-errors``) once it has ``min_exchanges``;
    the head arm answers every request. Two such failures, each on a scenario of its own under one daemon:
    - ``gk``: the candidate's checkout, after a restart, finds its weights' object gone from the release store (a
      storage error before the engine is asked; the canary resumed after the restart). Its prompts lack the poisoned
      word, so the candidate would answer them as the head does: every failure is the checkout's.
    - ``gt``: the candidate's chat template raises ZeroDivisionError on its trigger word while the engine prepares
      the prompt (an error outside Reef's tree: recorded and answered as an internal error, its message kept out).
    Bugs caught: a failure before the exchange starts made no record (the checkout: the error guard never saw it,
    and the canary served errors to its share of runs for ever); an unexpected exception at the first event made no
    record either."""
    import hashlib
    import shutil

    d = altered(daemon_factory, recipe_dir)
    asks = {"gk": {**ASK, "messages": [{"role": "user", "content": "Tell me about the horse."}]},
            "gt": {**ASK, "messages": [{"role": "user", "content": "Tell me about the walrus."}]}}
    with d.http() as c:
        arms = {"gk": start_canary(c, "gk", "poisoned"), "gt": start_canary(c, "gt", "template", trigger="walrus")}
        content = c.get(f"/reef/releases/{arms['gk'][1]}").json()["content_id"]
    d.kill9()
    checkout = d.home / "cache" / "releases" / content
    weights = hashlib.sha256((checkout / "model.safetensors").read_bytes()).hexdigest()
    lost = [p for p in d.home.rglob(weights) if p.parent.parent.parent.name == "objects"]
    assert len(lost) == 1, lost  # the candidate's weights in the release store (its LFS object): lost
    lost[0].unlink()
    shutil.rmtree(checkout)
    (checkout.parent / f"{content}.ok").unlink()
    d.start()
    served: dict[str, dict[str, list[int]]] = {name: {"head": [], "canary": []} for name in arms}
    says = {"gk": (507, "LFS object"), "gt": (500, "internal error: ZeroDivisionError")}
    with d.http() as c:
        assert {canary_of(c, name)["release_id"] for name in arms} == {cand for _, cand in arms.values()}
        for i in range(200):
            running = [name for name in arms if canary_of(c, name) is not None]
            if not running:
                break
            for name in running:
                head, cand = arms[name]
                r = c.post(f"/s/{name}/r/run_{i:04d}/v1/chat/completions", json=asks[name])
                receipt = r.headers.get("x-reef-agent-record-id")
                assert receipt, (name, r.status_code, r.text)  # every request has a record, a failed one too
                rec = c.get(f"/reef/records/{receipt}").json()
                assert rec["release_id"] in (head, cand), rec["release_id"]
                served[name]["canary" if rec["release_id"] == cand else "head"].append(r.status_code)
                if rec["release_id"] == cand:
                    status, message = says[name]
                    assert assert_canonical_error(r, status)["message"].startswith(message), r.text
                    assert rec["status"] == "error", rec
                    assert rec["response"]["error"]["message"].startswith(message), rec["response"]
                else:
                    assert r.status_code == 200 and rec["status"] == "complete", r.text
        else:
            raise AssertionError(f"the canaries were not ended for their failed exchanges: {served}")
        for name, (head, cand) in arms.items():
            chain = c.get(f"/reef/scenarios/{name}/releases", params={"all": "1"}).json()
            assert chain["head"] == head, name
            ended = next(j for j in chain["rejected"] if j["candidate"] == cand)
            assert ended["verdict"] == "canary-errors" and "failed" in ended["reason"], ended
            assert ended["metrics"]["canary_errors"] == ended["metrics"]["canary_exchanges"] >= 20, ended["metrics"]
            assert len(served[name]["canary"]) >= 20 and set(served[name]["head"]) == {200}, (name, served[name])


def test_a_canary_whose_answers_loop_is_ended_by_its_loop_guard_and_a_healthy_one_runs_on(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    """Two scenarios under the same traffic (sampled answers of 12 tokens, as a user's): the looping candidate says
    one token again and again on its arm and is ended (``canary-loops``) once both arms have ``guard_answers`` (10)
    answers, before any report; the copy of the head, after as many answers on each arm, runs on with no answer
    looping. Bugs caught: the loop flags not read from the records or not passed to the live judge, the guard off at
    the defaults a learning canary starts with, a guard that ends a healthy canary."""
    d = altered(daemon_factory, recipe_dir)
    sampled = {**ASK, "temperature": 1.0}
    with d.http() as c:
        arms = {"gp": start_canary(c, "gp", "looping", heldout_check=False), "gq": start_canary(c, "gq", "same", canary_answers=10_000)}
        texts: dict[str, list[str]] = {"gp": [], "gq": []}
        for i in range(200):
            running = [name for name in arms if canary_of(c, name) is not None]
            if "gq" not in running:
                ended = c.get("/reef/scenarios/gq/releases", params={"all": "1"}).json()["rejected"]
                raise AssertionError(f"the healthy canary was ended: {ended}")
            f = canary_of(c, "gq")["figures"]
            if running == ["gq"] and min(f["canary_answers"], f["head_answers"]) >= 12:
                break
            for name in running:
                r = c.post(f"/s/{name}/r/run_{i:04d}/v1/chat/completions", json=sampled)
                assert r.status_code == 200, r.text
                if r.headers["x-reef-release-id"] == arms[name][1]:
                    texts[name].append(r.json()["choices"][0]["message"]["content"])
        else:
            raise AssertionError("the loop guard did not end the looping canary")
        chain = c.get("/reef/scenarios/gp/releases", params={"all": "1"}).json()
        assert chain["head"] == arms["gp"][0]
        ended = next(j for j in chain["rejected"] if j["candidate"] == arms["gp"][1])
        assert ended["verdict"] == "canary-loops" and "answers loop" in ended["reason"], ended
        m = ended["metrics"]
        assert m["canary_loop_rate"] == 1.0 and m["head_loop_rate"] == 0.0 and m["canary_reports"] == 0, m
        assert texts["gp"] and all(len(t) >= 8 and set(t) == set(t[0]) for t in texts["gp"]), texts["gp"][:3]
        healthy = canary_of(c, "gq")
        assert healthy["decision"] is None and healthy["figures"]["canary_loop_rate"] == 0.0, healthy["figures"]
