"""openclaw-rl's judge votes, hint judge and KL term, against OpenClaw-RL's mechanisms: m votes of a judge model
with the plurality deciding (a tie, or every vote failing, is neutral), the longest positive hint among the hint
judge's votes (a turn without one trains on its reward alone, counted), and a KL(policy || base) term in the loss.
Through a real daemon, the judge is a configured model: a scripted one over real HTTP (an outside provider whose
answers the test chooses: a real judge cannot be made to disagree with itself on cue) and the daemon's own tiny
model."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from recipes.base import FeedbackReport, ScoredExchange, TurnVerdict
from recipes.online_rl import Sample, kl_from_base, token_logprobs, train_step, wrap_lora
from recipes.openclaw_rl import (
    HINT_PROMPT,
    JUDGE_PROMPT,
    MIN_HINT_CHARS,
    OpenClawRL,
    best_hint,
    majority,
    parse_hint_answer,
    parse_judge_answer,
)
from tests.conftest import Daemon
from tests.test_learning import published_step
from tests.test_openclaw_rl import chat, judged

# --- the votes and hints, as OpenClaw-RL counts them -------------------------------------------------------------


def votes(*answers: str | BaseException) -> TurnVerdict:
    return majority([parse_judge_answer(a, "j") if isinstance(a, str) else a for a in answers], "j")


def test_the_plurality_of_the_votes_decides_and_a_tie_is_neutral() -> None:
    assert votes("GOOD: a", "BAD: b", "GOOD: c").verdict == "good"
    v = votes("BAD: b", "GOOD: a", "BAD: c")
    assert v.verdict == "bad" and v.reason == "b" and v.votes == ("bad", "good", "bad")
    assert votes("GOOD: a", "BAD: b", "NEUTRAL: c").verdict == "neutral"  # one each: a tie
    assert votes("GOOD: a", "BAD: b").verdict == "neutral"
    assert votes("NEUTRAL: x", "NEUTRAL: y", "GOOD: a").verdict == "neutral"  # neutral can win too
    assert votes("GOOD: a", "GOOD: b", "BAD: c", "BAD: d", "BAD: e").verdict == "bad"


def test_failed_timed_out_and_unparseable_votes_abstain() -> None:
    v = votes("GOOD: a", TimeoutError(), RuntimeError("502"))
    assert v.verdict == "good" and not v.unparseable and v.votes == ("good", "timed out", "failed")
    v = votes("GOOD: a", "garbage", "BAD: b")  # one good, one bad left: a tie
    assert v.verdict == "neutral" and v.votes == ("good", "unparseable", "bad")
    for answers in (("GOOD: a", "garbage", "garbage"), ("garbage", "GOOD: a", "garbage"), ("garbage", "garbage",
                                                                                            "GOOD: a")):
        v = votes(*answers)  # the one vote that parsed decides: garbage counted as neutral would outvote it
        assert v.verdict == "good" and v.reason == "a" and not v.unparseable, (answers, v)
    v = votes("garbage", "NEUTRAL: n", "NEUTRAL: m")  # neutral won by the votes that parsed: the first of those
    assert v.verdict == "neutral" and v.reason == "n" and not v.unparseable, v
    v = votes("BAD: b", "garbage", "garbage", "GOOD: a", "BAD: c")
    assert v.verdict == "bad" and v.votes == ("bad", "unparseable", "unparseable", "good", "bad")
    v = votes(TimeoutError(), TimeoutError())
    assert v.verdict == "neutral" and v.unparseable and v.reason == "the judge failed: timed out"
    v = votes("sure", RuntimeError("boom"))
    assert v.verdict == "neutral" and v.unparseable and v.reason.startswith("unparseable judge answer")


def test_a_hint_needs_a_positive_decision_and_some_length() -> None:
    assert parse_hint_answer("\\boxed{1}\n[HINT_START] Answer with the word only. [HINT_END]") == \
        "Answer with the word only."
    assert parse_hint_answer("\\boxed{-1}\n[HINT_START] Answer with the word only. [HINT_END]") is None
    assert parse_hint_answer("[HINT_START] Answer with the word only. [HINT_END]") is None  # no decision
    assert parse_hint_answer("\\boxed{1} no block") is None
    assert parse_hint_answer("\\boxed{1} [HINT_START]be brief[HINT_END]") is None  # 8 characters: trivial
    # the source keeps a hint of more than 10 characters: 11 is kept (spaces around it do not count), 10 is not
    assert MIN_HINT_CHARS == 11
    assert parse_hint_answer("\\boxed{1} [HINT_START]  Be precise.  [HINT_END]") == "Be precise."
    assert parse_hint_answer("\\boxed{1} [HINT_START]  Be concise [HINT_END]") is None
    # the last decision and the last block count (a judge that changes its mind)
    assert parse_hint_answer("\\boxed{-1} hmm, \\boxed{1} [HINT_START]x[HINT_END] [HINT_START]Use snake_case "
                             "names.[HINT_END]") == "Use snake_case names."


def test_the_longest_positive_hint_among_the_votes_is_kept() -> None:
    short, long_ = "Say only the word.", "Say only the word, without quotes or a full stop."
    answers: list[str | BaseException] = [f"\\boxed{{1}} [HINT_START]{short}[HINT_END]",
                                          f"\\boxed{{1}} [HINT_START]{long_}[HINT_END]",
                                          f"\\boxed{{-1}} [HINT_START]{long_} And more, much more.[HINT_END]",
                                          TimeoutError()]
    for order in (answers, answers[::-1]):
        assert best_hint(order) == long_
    assert best_hint(["\\boxed{-1}", "garbage", RuntimeError("502")]) is None


# --- a scripted judge over real HTTP -------------------------------------------------------------------------------


class ScriptedJudge:
    """An OpenAI-compatible chat endpoint: a request whose system prompt is the verdict prompt gets the next
    queued verdict answer, the hint prompt the next hint answer (``status=N`` answers HTTP N); it keeps the bodies."""

    def __init__(self) -> None:
        self.queues: dict[str, list[str]] = {JUDGE_PROMPT: [], HINT_PROMPT: []}
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.bodies.append(body)
                    queue = judge.queues.get(body["messages"][0]["content"], [])
                    text = queue.pop(0) if queue else "nothing scripted"
                if text.startswith("status="):
                    self.send_response(int(text[7:]))
                    out = json.dumps({"error": {"message": "scripted failure"}}).encode()
                else:
                    self.send_response(200)
                    out = json.dumps({"id": "j", "object": "chat.completion", "created": 0, "model": body["model"],
                                      "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": text}}],
                                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
                                     ).encode()
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def script(self, verdicts: list[str], hints: list[str]) -> None:
        with self.lock:
            self.queues = {JUDGE_PROMPT: list(verdicts), HINT_PROMPT: list(hints)}
            self.bodies.clear()


@pytest.fixture
def scripted_judge() -> Iterator[ScriptedJudge]:
    j = ScriptedJudge()
    t = threading.Thread(target=j.server.serve_forever, daemon=True)
    t.start()
    yield j
    j.server.shutdown()
    j.server.server_close()


LONG = "Answer with the single word you were asked for, nothing else."


def test_votes_decide_the_verdict_and_the_longest_positive_hint_trains(daemon_factory: Any,
                                                                       scripted_judge: ScriptedJudge) -> None:
    cfg = (f'\n[models.judge]\nengine = "upstream"\nurl = "{scripted_judge.url}"\nformat = "openai-chat"\n'
           'upstream_model = "judge-1"\n\n[recipes.openclaw-rl]\ncanary_share = 0\njudge = "judge"\nhints = true\n'
           'judge_timeout_s = 10\nbatch_prompts = 2\ngate = "always"\nheldout_check = false\n')
    d: Daemon = daemon_factory(cfg)
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "ov", "recipe": "openclaw-rl"}).status_code == 201
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "Say file."}]
        receipts = []

        def turn(verdicts: list[str], hints: list[str], reply: str) -> None:
            """The next turn; the judge's answers for the turn it continues (judged as soon as it is recorded)."""
            scripted_judge.script(verdicts, hints)
            a, r = chat(c, "ov", msgs)
            receipts.append(r)
            msgs.extend([{"role": "assistant", "content": a}, {"role": "user", "content": reply}])

        turn([], [], "ok")
        # two of three votes good: good. The hints: a short one, a long one, a longer one with a negative decision
        turn(["GOOD: it moved on", "BAD: no", "GOOD: fine"],
             ["\\boxed{1} [HINT_START]Say only the word.[HINT_END]", f"\\boxed{{1}} [HINT_START]{LONG}[HINT_END]",
              f"\\boxed{{-1}} [HINT_START]{LONG} And much more besides this.[HINT_END]"], "next one")
        v = judged(c, receipts[0])["report"]
        assert v["score"] == 1.0 and v["feedback"] in ("it moved on", "fine")
        assert sorted(v["metadata"]["votes"]) == ["bad", "good", "good"] and v["metadata"]["hint"] == LONG
        sent = scripted_judge.bodies
        assert sorted(b["messages"][0]["content"] == HINT_PROMPT for b in sent) == [False] * 3 + [True] * 3
        assert all(b["temperature"] == 0.6 for b in sent)
        assert {b["max_tokens"] for b in sent if b["messages"][0]["content"] == HINT_PROMPT} == {256}
        # the majority flipped: bad; no vote of the hint judge gives a usable hint: none
        turn(["BAD: asked again", "GOOD: fine", "BAD: wrong"], ["\\boxed{-1}", "garbage", "\\boxed{1} no block"],
             "again")
        v = judged(c, receipts[1])["report"]
        assert v["score"] == 0.0 and "hint" not in v["metadata"]
        # a vote that fails (HTTP 500) abstains, and the other two tie: neutral, no score
        turn(["GOOD: fine", "status=500", "BAD: wrong"], [], "and another")
        v = judged(c, receipts[2])["report"]
        assert v.get("score") is None and v["metadata"]["verdict"] == "neutral"
        assert sorted(v["metadata"]["votes"]) == ["bad", "failed", "good"]
        # the two scored turns train: the hinted one with its teacher, the other on its reward alone (counted)
        rel = published_step(c, "ov")["releases"][0]
        assert sorted(rel["receipts"]) == sorted(receipts[:2])
        assert rel["metrics"]["hinted"] == 1 and rel["metrics"]["unhinted"] == 1
        assert rel["metrics"]["judge_good"] == 1 and rel["metrics"]["judge_bad"] == 1


def test_the_daemons_own_model_judges_with_sampled_votes(daemon_factory: Any) -> None:
    """The served tiny model as the judge: three votes, sampled through the embedded engine; its answers are
    noise, so each abstains and the turn is neutral (the verdict says so, vote by vote)."""
    d: Daemon = daemon_factory('\n[recipes.openclaw-rl]\ncanary_share = 0\njudge = "tiny"\njudge_max_tokens = 8\n')
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "ot", "recipe": "openclaw-rl"}).status_code == 201
        a, r = chat(c, "ot", [{"role": "user", "content": "Say file."}])
        chat(c, "ot", [{"role": "user", "content": "Say file."}, {"role": "assistant", "content": a},
                       {"role": "user", "content": "thanks"}])
        v = judged(c, r)["report"]
        assert v["metadata"]["judge"] == "tiny" and v["metadata"]["votes"] == ["unparseable"] * 3
        assert v.get("score") is None and v["metadata"]["verdict"] == "neutral"


def test_settings_that_could_not_work_are_refused(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory()
    refused = [
        ({"judge_votes": 3}, "needs a judge model"),  # the rule judge: three votes would be one
        ({"judge": "tiny", "judge_votes": 0}, "at least 1"),
        ({"judge": "tiny", "judge_temperature": 0}, "greedy"),  # three greedy votes: one answer three times
        ({"hints": True, "hint_coef": 0}, "hint_coef"),
        ({"kl_coef": 0.37, "lora": False}, "LoRA"),  # not the default (inert on whole weights): refused
        ({"kl_coef": -1}, "kl_coef"),
        ({"judge": "tiny", "hints": True, "hint_max_tokens": 0}, "hint_max_tokens"),
    ]
    with d.http() as c:
        for settings, why in refused:
            r = c.post("/reef/scenarios", json={"name": "os", "recipe": "openclaw-rl", "settings": settings})
            assert r.status_code == 400 and why in r.json()["error"]["message"], (settings, r.text)
        for i, settings in enumerate([{"judge": "tiny", "judge_votes": 1, "judge_temperature": 0},
                                      {"judge_votes": 1}, {"judge": "tiny", "judge_votes": 5, "hints": True},
                                      {"kl_coef": 0.02, "lora": True}]):
            r = c.post("/reef/scenarios", json={"name": f"ok{i}", "recipe": "openclaw-rl", "settings": settings})
            assert r.status_code == 201, (settings, r.text)


# --- the KL term to the base ----------------------------------------------------------------------------------------


def lora_policy(tiny_model: Any, moved: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.online_rl import OnlineRLSettings

    torch.manual_seed(0)
    model = wrap_lora(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                      OnlineRLSettings(lora_rank=4))
    if moved:  # away from the base: a fresh adapter (B = 0) is the base exactly
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
    return model.eval(), AutoTokenizer.from_pretrained(tiny_model)


def scored(model: Any) -> list[ScoredExchange]:
    batch = []
    for i, (prompt, answer, score) in enumerate([([5, 6, 7], [8, 9, 10], 1.0), ([5, 6, 11], [12, 13], 0.0)]):
        s = Sample(prompt_token_ids=prompt, token_ids=answer, logprobs=[0.0] * len(answer), reward=score, group="g")
        with torch.no_grad():
            lp = token_logprobs(model, [s])[0][0].tolist()
        batch.append(ScoredExchange(id=str(i), release_id=None, prompt_token_ids=prompt, token_ids=answer,
                                    logprobs=lp, report=FeedbackReport(id=f"rep_{i}", seq=i + 1, score=score)))
    return batch


def step(model: Any, tokenizer: Any, batch: list[ScoredExchange], kl_coef: float) -> dict[str, float]:
    recipe = OpenClawRL(OpenClawRL.parse_settings({"kl_coef": kl_coef, "lr": 0.05, "steps_per_batch": 1}))
    return train_step(model, recipe.samples(batch, model, tokenizer), recipe.settings)


def test_the_kl_term_is_zero_at_the_base_and_pulls_the_policy_back_to_it(tiny_model: Any) -> None:
    # at the base: the term and its gradient vanish, the step is the same as without it
    model, tok = lora_policy(tiny_model, moved=False)
    batch = scored(model)
    plain = copy.deepcopy(model)
    with_kl = step(model, tok, batch, kl_coef=1.0)
    without = step(plain, tok, batch, kl_coef=0.0)
    assert with_kl["kl_ref"] == pytest.approx(0.0, abs=1e-6) and "kl_ref" not in without
    assert with_kl["loss"] == pytest.approx(without["loss"], abs=1e-6)
    assert with_kl["grad_norm"] == pytest.approx(without["grad_norm"], rel=1e-4)
    # moved away from the base: the same step with the term ends nearer the base than without it
    model, tok = lora_policy(tiny_model, moved=True)
    batch = scored(model)
    samples = [Sample(prompt_token_ids=r.prompt_token_ids, token_ids=r.token_ids, logprobs=r.logprobs,
                      reward=r.score, group="g") for r in batch]
    start = kl_from_base(model, samples)
    assert start > 0.01
    plain = copy.deepcopy(model)
    with_kl = step(model, tok, batch, kl_coef=5.0)
    without = step(plain, tok, batch, kl_coef=0.0)
    assert with_kl["kl_ref"] > 0.01
    assert with_kl["loss"] == pytest.approx(without["loss"] + 5.0 * with_kl["kl_ref"], rel=1e-4)
    assert kl_from_base(model, samples) < kl_from_base(plain, samples)
    assert kl_from_base(model, samples) < start


def test_the_kl_term_refuses_a_policy_without_an_adapter(tiny_model: Any) -> None:
    """A policy training all its weights has no base in the trainer: the default coefficient is inert there (the
    step says so, ``kl_coef`` 0), another one fails the step rather than doing nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    batch = scored(model)
    recipe = OpenClawRL(OpenClawRL.parse_settings({"kl_coef": 0.37}))
    with pytest.raises(ValueError, match="LoRA adapter"):
        train_step(model, recipe.samples(batch, model, tok), recipe.settings)
    default = OpenClawRL(OpenClawRL.parse_settings({}))
    metrics = train_step(model, default.samples(batch, model, tok), default.settings)
    assert metrics["kl_coef"] == 0 and "kl_ref" not in metrics
