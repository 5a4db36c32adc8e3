"""openclaw-rl: turns judged by what came next. The session index, the rule judge and the strict judge-model parse
on their own; then through a real daemon: verdicts become reports on the judged receipts, an explicit report takes
precedence, the judge model gets the documented request (a stand-in upstream: an outside provider cannot run here),
a judge that answers garbage or times out is neutral and never blocks serving, and hindsight hints train."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import torch

from daemon.exchange import Message, Part, ToolCall
from daemon.sessions import NextState, SessionIndex, Turn
from recipes.base import FeedbackReport, ScoredExchange
from recipes.online_rl import OnlineRLSettings, Sample, token_logprobs, train_step
from recipes.openclaw_rl import JUDGE_PROMPT, JUDGE_QUESTION, hinted_prompt, parse_judge_answer, rule_verdict
from tests.conftest import Daemon
from tests.test_learning import published_step, releases, wait_for
from tests.test_upstream import stub  # noqa: F401 - the scripted upstream stands in for a judge model


def user(text: str) -> Message:
    return Message("user", [Part("text", text=text)])


def assistant(text: str, *calls: tuple[str, str]) -> Message:
    return Message("assistant", [Part("text", text=text)] + [Part("tool_call", id=f"c{i}", name=n, arguments=a)
                                                             for i, (n, a) in enumerate(calls)])


def tool(text: str, error: bool = False) -> Message:
    return Message("tool", [Part("tool_result", text=text, tool_call_id="c0", is_error=error)])


# --- sessions ------------------------------------------------------------------------------------------------------


def test_a_request_that_continues_a_turn_finds_it_and_what_came_next() -> None:
    idx = SessionIndex()
    assert idx.follow("s", Turn("r1", None, (user("fix it"),), "done")) is None
    prev, nxt = idx.follow("s", Turn("r2", None, (user("fix it"), assistant("done"), user("no, the other file")),
                                     "ok"))
    assert prev.receipt == "r1" and nxt.user_text == "no, the other file" and not nxt.retry
    # the longest continued prefix wins: r3 continues r2, not r1
    prev, _ = idx.follow("s", Turn("r3", None, (user("fix it"), assistant("done"), user("no, the other file"),
                                                assistant("ok"), user("thanks")), "bye"))
    assert prev.receipt == "r2"
    # another scenario, or an answer the client changed, continues nothing
    assert idx.follow("t", Turn("x", None, (user("fix it"), assistant("done"), user("?")), "")) is None
    assert idx.follow("s", Turn("y", None, (user("fix it"), assistant("done!"), user("?")), "")) is None


def test_tool_calls_match_whatever_the_key_order_and_sessions_scope_the_look_up() -> None:
    idx = SessionIndex()
    idx.follow("s", Turn("r1", "run=a", (user("weather?"),), "", (ToolCall("id1", "get", '{"a": 1, "b": 2}'),)))
    prev, nxt = idx.follow("s", Turn("r2", "run=a", (user("weather?"), assistant("", ("get", '{"b":2,"a":1}')),
                                                     tool("Traceback: boom", error=True)), "sorry"))
    assert prev.receipt == "r1" and nxt.tool_results == [("Traceback: boom", True)]
    # the same history in another session is not that session's turn
    assert idx.follow("s", Turn("r3", "run=b", (user("weather?"), assistant("", ("get", '{"a":1,"b":2}')),
                                                tool("sunny")), "")) is None


def test_a_retry_in_the_same_session_judges_the_last_turn() -> None:
    idx = SessionIndex()
    idx.follow("s", Turn("r1", "x-session-id=9", (user("say hi"),), "hello"))
    prev, nxt = idx.follow("s", Turn("r2", "x-session-id=9", (user("say hi"),), "hi"))
    assert prev.receipt == "r1" and nxt.retry
    assert idx.follow("s", Turn("r3", "x-session-id=10", (user("say hi"),), "hi")) is None  # another session


def test_session_less_requests_with_the_same_last_user_message_are_no_retry() -> None:
    """Without a session (no session header, no run) nothing ties two requests together: two clients asking the
    same thing, or one asking it again in a new conversation, is not a retry of the other's turn (that would be
    a "bad" verdict on a turn nobody complained about). Continuation still works without a session."""
    idx = SessionIndex()
    assert idx.follow("s", Turn("r1", None, (user("what is 2+2?"),), "4")) is None
    assert idx.follow("s", Turn("r2", None, (user("what is 2+2?"),), "four")) is None
    assert idx.follow("s", Turn("r3", None, (user("hello"), assistant("hi"), user("what is 2+2?")), "4")) is None
    prev, nxt = idx.follow("s", Turn("r4", None, (user("what is 2+2?"), assistant("four"), user("thanks")), ""))
    assert prev.receipt == "r2" and not nxt.retry


# --- judges ----------------------------------------------------------------------------------------------------


def test_the_rule_judge() -> None:
    cases = [
        (NextState(retry=True), "bad"),
        (NextState((user("No, use snake_case"),)), "bad"),
        (NextState((user("that's wrong"),)), "bad"),
        (NextState((user("You forgot the tests"),)), "bad"),
        (NextState((tool("Traceback (most recent call last): ..."),)), "bad"),
        (NextState((tool("ok", error=True),)), "bad"),
        (NextState((user("thanks!"),)), "good"),
        (NextState((user("Now add a README"),)), "good"),  # moving on ("Now" is not "no")
        (NextState((user("Nothing else, what is 2+2?"),)), "good"),
        (NextState((tool("3 files changed"),)), "good"),
        (NextState(()), "neutral"),
    ]
    for nxt, want in cases:
        assert rule_verdict(nxt).verdict == want, (nxt, rule_verdict(nxt))
    assert rule_verdict(NextState((user("No, use snake_case"),))).hint == "No, use snake_case"
    assert rule_verdict(NextState((user("thanks"),))).hint is None


def test_judge_answers_are_parsed_strictly() -> None:
    assert parse_judge_answer("GOOD: it compiled", "j").verdict == "good"
    assert parse_judge_answer("\n  BAD: the user had to repeat it\nmore", "j").reason == "the user had to repeat it"
    for garbage in ("good: lowercase", "GOOD", "GOOD:", "Sure! GOOD: x", "VERDICT: GOOD", "", "BAD - no colon"):
        v = parse_judge_answer(garbage, "j")
        assert v.verdict == "neutral" and v.unparseable, garbage


# --- hindsight hints ---------------------------------------------------------------------------------------------


def test_a_hint_goes_just_before_the_answer_in_the_models_template(tiny_model: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tok.backend_tokenizer.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Say file."}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False).ids
    hinted = hinted_prompt(tok, prompt, "use snake_case")
    text = tok.decode(hinted)
    assert text.index("Say file.") < text.index("Hint: use snake_case") and text.endswith("<|im_start|>assistant\n")
    assert hinted_prompt(tok, prompt[:-1], "x") is None  # not ending in the generation prompt: no hint


def test_a_token_bonus_alone_moves_the_policy_its_way(tiny_model: Any) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    before = copy.deepcopy(model)
    s = Sample(prompt_token_ids=[5, 6, 7], token_ids=[8, 9], logprobs=[0.0, 0.0], reward=0.0, group="g",
               token_bonus=[2.0, -2.0])
    with torch.no_grad():
        s.logprobs = token_logprobs(model, [s])[0][0].tolist()
    metrics = train_step(model, [s], OnlineRLSettings(lr=1e-2, steps_per_batch=1))  # one sample: advantage 0
    assert metrics["skipped"] == 0.0
    with torch.no_grad():
        old, new = token_logprobs(before, [s])[0][0], token_logprobs(model, [s])[0][0]
    assert new[0] > old[0] and new[1] < old[1]  # the teacher-favoured token up, the other down


# --- through a real daemon ----------------------------------------------------------------------------------------


def chat(c: httpx.Client, scenario: str, messages: list[dict[str, Any]], sampling: dict[str, Any] | None = None,
         **headers: str) -> tuple[str, str]:
    r = c.post(f"/s/{scenario}/v1/chat/completions", headers=headers, json={
        # sampled at the default temperature 1: what online-rl's ratio can train on (test_learning: others are not)
        "model": "tiny", "max_tokens": 4, "messages": messages, **(sampling or {})})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.headers["x-reef-agent-record-id"]


def judged(c: httpx.Client, receipt: str) -> dict[str, Any]:
    """The judge's report on a receipt, once it is there."""
    def look() -> Any:
        reports = c.get(f"/reef/records/{receipt}").json()["reports"]
        return next((r for r in reports if (r["report"].get("metadata") or {}).get("source") == "judge"), None)

    return wait_for(look, what=f"the judge's verdict on {receipt}")


def test_sessions_are_judged_into_reports_and_an_explicit_report_wins(daemon_factory: Any) -> None:
    # the held-out check has its own tests (test_heldout.py): off here, so a tiny model's greedy answers cannot hold
    # the step this test reads (the test failed in CI waiting for the release, passing on this machine)
    d: Daemon = daemon_factory('\n[recipes.openclaw-rl]\ncanary_share = 0\nbatch_prompts = 3\ngate = "always"\n'
                               'heldout_check = false\n')
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "oc", "recipe": "openclaw-rl"}).status_code == 201
        msgs: list[dict[str, Any]] = [{"role": "user", "content": 'Say "apple".'}]
        a1, r1 = chat(c, "oc", msgs)
        msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "No, that's wrong: just apple"}]
        a2, r2 = chat(c, "oc", msgs)
        v1 = judged(c, r1)
        assert v1["report"]["score"] == 0.0 and v1["report"]["metadata"]["verdict"] == "bad"
        assert v1["report"]["metadata"]["hint"] == "No, that's wrong: just apple"
        # the user rates r2 themselves before the next turn judges it: their score is the one that counts
        assert c.post("/reef/report", json={"references": [r2], "score": 1.0}).status_code == 201
        msgs += [{"role": "assistant", "content": a2}, {"role": "user", "content": "no"}]
        a3, r3 = chat(c, "oc", msgs)
        assert judged(c, r2)["report"]["metadata"]["verdict"] == "bad"
        msgs += [{"role": "assistant", "content": a3}, {"role": "user", "content": "thanks, next one"}]
        chat(c, "oc", msgs)
        assert judged(c, r3)["report"]["score"] == 1.0
        head = published_step(c, "oc")
        rel = head["releases"][0]
        assert sorted(rel["receipts"]) == sorted([r1, r2, r3])
        assert rel["metrics"]["batch_reward"] == round(2 / 3, 4)  # r1 0 (judged), r2 1 (explicit), r3 1 (judged)
        assert rel["metrics"]["judge_bad"] == 2 and rel["metrics"]["judge_good"] == 1
    shown = d.cli("records", "show", r1)
    assert "judge" in shown.stdout


def test_the_judge_model_gets_the_documented_request_and_garbage_is_neutral(
        daemon_factory: Any, stub: str) -> None:  # noqa: F811
    cfg = (f'\n[models.judge]\nengine = "upstream"\nurl = "{stub}"\nformat = "openai-chat"\n'
           'upstream_model = "judge-1"\n\n[recipes.openclaw-rl]\ncanary_share = 0\njudge = "judge"\njudge_timeout_s = 5\n'
           "batch_prompts = 100\n")
    d: Daemon = daemon_factory(cfg)
    with d.http() as c, httpx.Client(base_url=stub) as s:
        assert c.post("/reef/scenarios", json={"name": "oj", "recipe": "openclaw-rl"}).status_code == 201
        a1, r1 = chat(c, "oj", [{"role": "user", "content": "Say file."}])
        s.delete("/_stub/requests")
        nxt = "[stub:text=BAD: the user asked for one word]"
        a2, r2 = chat(c, "oj", [{"role": "user", "content": "Say file."}, {"role": "assistant", "content": a1},
                                {"role": "user", "content": nxt}])
        v = judged(c, r1)["report"]
        assert v["score"] == 0.0 and v["feedback"] == "the user asked for one word"
        assert v["metadata"] == {"source": "judge", "judge": "judge", "verdict": "bad", "votes": ["bad"] * 3}
        sent = [r for r in s.get("/_stub/requests").json() if r["path"].endswith("/chat/completions")]
        assert len(sent) == 3  # judge_votes: 3 by default with a judge model, each sampled at 0.6
        for body in (r["body"] for r in sent):
            assert body["model"] == "judge-1" and body["temperature"] == 0.6 and body["max_tokens"] == 64
            assert body["messages"] == [
                {"role": "system", "content": JUDGE_PROMPT},
                {"role": "user", "content": JUDGE_QUESTION.format(turn=a1.strip() or "(no text)",
                                                                  next=f"[user] {nxt}")},
            ]
        # garbage: neutral, no score, counted as unparseable
        msgs = [{"role": "user", "content": "Say file."}, {"role": "assistant", "content": a1},
                {"role": "user", "content": nxt}, {"role": "assistant", "content": a2},
                {"role": "user", "content": "[stub:text=I think it was fine]"}]
        a3, r3 = chat(c, "oj", msgs)
        v = judged(c, r2)["report"]
        assert v.get("score") is None and v["metadata"]["verdict"] == "neutral" and v["metadata"]["unparseable"]
        assert v["metadata"]["votes"] == ["unparseable"] * 3  # each abstains: no vote left is neutral
        # a judge slower than judge_timeout_s: neutral, and the request it judged from was answered meanwhile
        # the request it judges from is answered while the judge still waits (the verdict is not there yet)
        msgs += [{"role": "assistant", "content": a3}, {"role": "user", "content": "[stub:slow=30]"}]
        chat(c, "oj", msgs)
        assert not [r for r in c.get(f"/reef/records/{r3}").json()["reports"]
                    if (r["report"].get("metadata") or {}).get("source") == "judge"]
        v = judged(c, r3)["report"]
        assert v.get("score") is None and "timed out" in v["feedback"] and v["metadata"]["verdict"] == "neutral"
        assert v["metadata"]["votes"] == ["timed out"] * 3


def test_bad_settings_for_the_judge_are_refused_and_the_cli_binds_the_recipe(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory()
    with d.http() as c:
        r = c.post("/reef/scenarios", json={"name": "ob", "recipe": "openclaw-rl", "settings": {"judge": "nope"}})
        assert r.status_code == 400 and "nope" in r.text
        r = c.post("/reef/scenarios", json={"name": "ob", "recipe": "openclaw-rl",
                                            "settings": {"judge_timeout_s": 0}})
        assert r.status_code == 400 and "judge_timeout_s" in r.text
        assert "ob" not in json.dumps(c.get("/reef/scenarios").json())
    out = d.cli("scenarios", "create", "cli-oc", "--recipe", "openclaw-rl")
    assert out.returncode == 0, out.stderr
    with d.http() as c:
        assert c.get("/reef/scenarios/cli-oc").json()["recipe"] == "openclaw-rl"


def test_the_training_screen_shows_the_judges_counts() -> None:
    from reef_cli.tui.format import key_metrics

    shown = key_metrics({"kl": 0.1, "grad_norm": 1.0, "judge_good": 5, "batch_reward": 0.5, "judge_bad": 2}, 3)
    assert shown.startswith("batch_reward 0.5") and "judge_bad 2" in shown and "judge_good 5" in shown


def test_judged_sessions_train_toward_what_the_user_accepted(daemon_factory: Any, tmp_path: Any) -> None:
    """Learning from the next state alone: two sessions, one answer the user moved on from and one they
    corrected; the trained release makes the accepted answer more likely and the corrected one less likely."""
    from transformers import AutoModelForCausalLM

    from daemon.releases import ReleaseStore
    from tests.test_hot_swap_weights import rescored

    d: Daemon = daemon_factory('\n[recipes.openclaw-rl]\ncanary_share = 0\nbatch_prompts = 2\ngate = "always"\nlr = 0.01\n'
                               "steps_per_batch = 4\n")
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "ol", "recipe": "openclaw-rl"}).status_code == 201
        init = releases(c, "ol")["head"]
        turns = {}
        for prompt, reply in (("Say file.", "thanks, now the next one"), ("Say door.", "No, that's wrong")):
            # sampled (two different answers: a greedy random model could give both prompts the same tokens)
            answer, receipt = chat(c, "ol", [{"role": "user", "content": prompt}], {"temperature": 1, "seed": 7},
                                   **{"x-reef-session": prompt})
            chat(c, "ol", [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer},
                           {"role": "user", "content": reply}], **{"x-reef-session": prompt})
            turns[reply] = receipt
        head = published_step(c, "ol")
        trained = head["releases"][0]["release_id"]
        records = {k: c.get(f"/reef/records/{r}").json() for k, r in turns.items()}
    store = ReleaseStore(d.home / "artifacts.git")
    before = AutoModelForCausalLM.from_pretrained(store.checkout(init, tmp_path / "before")).eval()
    after = AutoModelForCausalLM.from_pretrained(store.checkout(trained, tmp_path / "after")).eval()
    good, bad = records["thanks, now the next one"], records["No, that's wrong"]
    assert sum(rescored(after, good)) > sum(rescored(before, good))
    assert sum(rescored(after, bad)) < sum(rescored(before, bad))


def test_hints_give_only_the_hinted_turns_a_teacher_signal(tiny_model: Any) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.openclaw_rl import OpenClawRL

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompt = tok.backend_tokenizer.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Say file."}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False).ids
    batch = [ScoredExchange(id=rid, release_id=None, prompt_token_ids=prompt, token_ids=[11, 12, 13],
                            logprobs=[-8.0, -8.0, -8.0],
                            report=FeedbackReport(id=f"rep_{rid}", seq=1, score=0.0, hint=hint, source="judge"))
             for rid, hint in (("a", "just the word"), ("b", None))]
    on = OpenClawRL(OpenClawRL.parse_settings({"hints": True, "hint_coef": 0.5})).samples(batch, model, tok)
    assert on[0].token_bonus is not None and len(on[0].token_bonus) == 3 and on[1].token_bonus is None
    teacher = Sample(prompt_token_ids=hinted_prompt(tok, prompt, "just the word"), token_ids=[11, 12, 13],
                     logprobs=[0.0] * 3, reward=0.0, group="t")
    with torch.no_grad():
        t = token_logprobs(model, [teacher])[0][0].tolist()
    assert on[0].token_bonus == [0.5 * (x + 8.0) for x in t]
    off = OpenClawRL(OpenClawRL.parse_settings({})).samples(batch, model, tok)
    assert all(s.token_bonus is None for s in off)  # hints are off by default


def test_kill_9_during_a_step_publishes_nothing_half_and_consumes_nothing_twice(daemon_factory: Any) -> None:
    """The judged turns of an interrupted step are trained on again after a restart, once: the verdicts are
    reports (durable), and the interrupted candidate never reaches the chain."""
    d: Daemon = daemon_factory('\n[recipes.openclaw-rl]\ncanary_share = 0\nbatch_prompts = 2\ngate = "always"\n'
                               "steps_per_batch = 800\n")  # a few seconds a step

    def session(c: httpx.Client, prompt: str, reply: str) -> str:
        answer, receipt = chat(c, "crash", [{"role": "user", "content": prompt}], **{"x-reef-session": prompt})
        chat(c, "crash", [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer},
                          {"role": "user", "content": reply}], **{"x-reef-session": prompt})
        judged(c, receipt)
        return receipt

    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "crash", "recipe": "openclaw-rl"}).status_code == 201
        first = [session(c, "Say file.", "thanks, next"), session(c, "Say door.", "No, that's wrong")]
        published = wait_for(lambda: (r := releases(c, "crash"))["releases"][0]["step"] == 1 and r, timeout=180,
                             what="the first release")["releases"][0]
        second = [session(c, "Say a.", "thanks"), session(c, "Say b.", "no")]
        wait_for(lambda: c.get("/reef/status").json()["learning"].get("crash") == "training", what="training")
    d.kill9()
    d.start()
    with d.http() as c:
        chain = releases(c, "crash", True)
        assert chain["head"] == published["release_id"]  # nothing of the interrupted step published
        assert [r["operation"] for r in chain["releases"]] == ["train", "init"]
        chain = wait_for(lambda: (r := releases(c, "crash"))["releases"][0]["step"] == 2 and r, timeout=180,
                         what="the interrupted step trained again")
        assert chain["releases"][0]["parent"] == published["release_id"]
        assert sorted(chain["releases"][0]["receipts"]) == sorted(second)
        full = releases(c, "crash", True)
        got = [r for x in full["releases"] + full["rejected"] for r in x.get("receipts", [])]
        assert sorted(got) == sorted(first + second) and len(got) == len(set(got))
