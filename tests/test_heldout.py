"""The held-out check (``daemon/gating/heldout.py``) and the gate's named steps (``daemon/gating/steps.py``).

The figures and the decision are pure functions, tested on answers written here. Through a real daemon, its
trainer worker and the tiny model's engine: a candidate that answers nothing is held (and never serves, even
after a restart), one that keeps answering is served, the check turned off says ``unchecked``, a check that
cannot run fails the step with the reason, malformed settings are refused naming them, and the reserved recorded
prompts are asked by the check and never trained on. The candidate that answers nothing is crafted, not
trained: its final norm's weight is zeroed, so every logit is 0 and greedy decoding takes token 0, the tiny
model's ``<|endoftext|>`` (an end of sequence): the empty answer to every prompt, deterministically."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest

from daemon.engines.base import Engine
from daemon.errors import BadRequest, CheckFailed
from daemon.gating import steps
from daemon.gating.heldout import (
    Answer,
    CheckSettings,
    Probe,
    degenerate,
    figures,
    parse_probes,
    reserved,
    shipped_probes,
)
from daemon.gating.outcome import GateRun
from daemon.gating.steps import STEPS
from daemon.loops import REPEAT, TAIL, loops, said_twice
from tests.conftest import Daemon
from tests.test_learning import events_of, releases, serve_and_report, settings_toml, wait_for
from tests.test_recipes import recipe_dir, with_recipe_paths  # noqa: F401 - the fixture, used by name

CRAFTED = '''
import shutil
from dataclasses import dataclass
from pathlib import Path

from recipes.base import Candidate, GateSettings, Recipe, Scores


@dataclass
class Settings(GateSettings):
    silent: bool = True  # the candidate answers nothing (crafted weights), or keeps answering (nudged weights)
    canary_share: float | None = 0.0  # a candidate the check passes is published: these tests are about the check
    score: float | None = None  # the gate's evaluation of the candidate (one task), for the gates that need one


class Crafted(Recipe):
    """A weights recipe whose candidate is crafted, not trained (see the test module's docstring)."""

    name = "crafted"
    kind = "weights"
    source = "scores"
    Settings = Settings

    def batch(self, records):
        return records[:2] if len(records) >= 2 else None

    def train(self, job, state):
        from safetensors.torch import load_file, save_file

        base, out = Path(job.base_path), Path(job.work_dir)
        for f in base.iterdir():
            if f.is_file() and f.name != "model.safetensors":
                shutil.copyfile(f, out / f.name)
        weights = load_file(base / "model.safetensors")
        if job.settings["silent"]:  # every logit 0: greedy takes token 0, an end of sequence
            weights["model.norm.weight"] = weights["model.norm.weight"] * 0
        else:
            weights = {k: v * (1 + 1e-4) for k, v in weights.items()}
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        score = job.settings["score"]
        return Candidate(metrics={}, eval=None if score is None else Scores([score]))
'''

ASK = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def _crafted(daemon_factory: Any, recipe_dir: Any) -> Daemon:  # noqa: F811
    (recipe_dir / "crafted.py").write_text(CRAFTED)
    return with_recipe_paths(daemon_factory, recipe_dir)


def _candidates_loaded(c: Any) -> list[str]:
    """The candidates the daemon's engine keeps loaded (the held-out check loads each under ``candidate:JOB``)."""
    return [k for k in c.get("/reef/status").json()["models"]["tiny"]["resident"] if k.startswith("candidate:")]


def _report(c: Any, name: str, n: int = 2) -> list[str]:
    receipts = []
    for _ in range(n):
        rec = c.post(f"/s/{name}/v1/chat/completions", json=ASK).headers["x-reef-agent-record-id"]
        assert c.post("/reef/report", json={"references": [rec], "score": 1.0}).status_code == 201
        receipts.append(rec)
    return receipts


# --- the figures and the decision (pure) ------------------------------------------------------------------------


def _a(text: str, tokens: int | None = None) -> Answer:
    n = len(text.split()) + 1 if tokens is None else tokens
    return Answer(text, (1, 2), tuple(range(n)), tuple([-0.1] * n))


PROBES = [Probe(f"What is {i} + 1?", (str(i + 1),)) for i in range(20)]
SETTINGS = CheckSettings(probes=tuple(PROBES))


def test_a_candidate_that_answers_nothing_is_held_and_one_like_the_head_is_not() -> None:
    head = [_a(f"It is {i + 1}.") for i in range(20)]
    silent = figures([_a("", 1)] * 20, head, PROBES, 0, 0.05, SETTINGS)
    assert silent.hold is not None and "stops answering" in silent.hold and silent.empty == 1.0
    assert silent.probe_accuracy == 0 and silent.head_probe_accuracy == 1 and "forgets" in silent.hold
    same = figures(list(head), head, PROBES, 0, 0.05, SETTINGS)
    assert same.hold is None and same.length_ratio == 1.0 and same.degenerate == same.head_degenerate == 0
    m = same.metrics()
    assert m["heldout"] == "passed" and m["heldout_kl"] == 0.05 and "too little traffic" in m["heldout_note"]


def test_a_probe_loss_within_the_checks_noise_passes_and_beyond_it_holds() -> None:
    head = [_a(f"It is {i + 1}.") for i in range(20)]
    # two lost, one gained: within the noise (2 * sqrt(3) = 3.5); shorter but still answering
    some = [_a("I do not know.") if i in (0, 1) else _a(f"{i + 1}") for i in range(20)]
    assert figures(some, head, PROBES, 0, None, SETTINGS).hold is None
    lost = [_a("I do not know.") if i < 8 else _a(f"It is {i + 1}.") for i in range(20)]
    fig = figures(lost, head, PROBES, 0, None, SETTINGS)
    assert fig.hold is not None and "forgets" in fig.hold and fig.probes_lost == 8 and fig.probes_gained == 0
    assert "stops answering" not in fig.hold and "KL" in fig.metrics()["heldout_note"]


def _knowing(wrong: set[int]) -> list[Answer]:
    """Answers to ``PROBES``, right except at ``wrong``."""
    return [_a("I do not know.") if i in wrong else _a(f"It is {i + 1}.") for i in range(20)]


def test_a_lineage_that_forgot_what_the_base_knew_is_held_though_each_step_was_within_its_noise() -> None:
    """Two steps from the base, each losing 3 probes against its head (within the noise: 3 < 2 sqrt(3) = 3.5),
    have lost 6 of what the base knew (6 > 2 sqrt(6) = 4.9): held, saying so with both accuracies. Compared with
    different lineages: the same candidate without the base's answers passes (the head's test alone), one that
    lost 5 since the base with 1 won back is within the noise there (4 < 2 sqrt(6)); a base that knew less than the
    head is no loss. Bugs caught: the base never compared, lost and gained swapped, the noise taken as a bound
    to reach (>=) rather than pass, the base's figures left out of the metrics."""
    base, head = _knowing(set()), _knowing({0, 1, 2})
    cand = _knowing({0, 1, 2, 3, 4, 5})
    alone = figures(cand, head, PROBES, 0, None, SETTINGS)
    assert alone.hold is None and alone.probes_lost == 3  # each step alone: within its noise
    fig = figures(cand, head, PROBES, 0, None, SETTINGS, base=base)
    assert fig.hold is not None and "forgets what the base knew" in fig.hold, fig.hold
    assert "70% against the base's 100%" in fig.hold and "6 probes lost, 0 gained since the base" in fig.hold
    assert (fig.probes_lost_base, fig.probes_gained_base, fig.base_probe_accuracy) == (6, 0, 1.0)
    m = fig.metrics()
    assert m["heldout_base_probe_accuracy"] == 1.0 and m["heldout_probes_lost_base"] == 6
    assert m["heldout_probes_gained_base"] == 0 and m["heldout_base_probe_noise"] == pytest.approx(4.899, abs=1e-3)
    assert "heldout_base_probe_accuracy" not in alone.metrics()
    from daemon.gating.heldout import describe

    said = describe(m)
    assert said is not None and "probes 70% right (head 85%, first release 100%, noise 3.5)" in said, said
    assert "first release" not in str(describe(alone.metrics()))
    # 5 lost since the base, 1 won back: a net 4 within the noise of 6 flips (4.9)
    near = figures(_knowing({0, 1, 2, 3, 4}), head, PROBES, 0, None, SETTINGS, base=_knowing({19}))
    assert near.hold is None and (near.probes_lost_base, near.probes_gained_base) == (5, 1)
    assert near.base_probe_accuracy == 0.95  # 19 of 20: a share, not a whole division
    # a net loss exactly at the noise passes: 4 lost, none gained is 4 = 2 sqrt(4)
    edge = figures(_knowing({0, 1, 2, 3}), head, PROBES, 0, None, SETTINGS, base=base)
    assert edge.hold is None and edge.base_probe_noise == 4.0
    # a base that knew less than the candidate: gains, no loss
    assert figures(head, head, PROBES, 0, None, SETTINGS, base=_knowing(set(range(10)))).hold is None
    # a first look with a net loss against the base is not clean, though even with the head: the rest is asked
    same = figures(head, head, PROBES, 0, None, SETTINGS, base=base)
    assert same.hold is None and not heldout_clean(same) and heldout_clean(figures(head, head, PROBES, 0, None,
                                                                                  SETTINGS))


def heldout_clean(fig: Any) -> bool:
    from daemon.gating import heldout

    return heldout.clean(fig, SETTINGS)


def test_the_kept_answer_sets_are_the_four_most_recently_used() -> None:
    """A lineage's checks read the head's set and the first release's, then a publish keeps the new head's (or a
    canary start the canary's): the first release's set, read at every check, is never the one let go. Bugs
    caught: the oldest inserted dropped rather than the least recently read (the first release asked again at every
    step), no bound at all."""
    from daemon.gating.heldout import KeptAnswers

    kept = KeptAnswers()
    first = {"q": Answer("base")}
    kept(("c_0", 16), first)
    for step in range(1, 6):
        assert kept(("c_0", 16)) is first  # the check reads the first release's...
        kept((f"c_{step}", 16), {"q": Answer(f"head {step}")})  # ...and a publish keeps the new head's
    assert kept(("c_0", 16)) is first and all(kept((f"c_{i}", 16)) is not None for i in (3, 4, 5))
    assert kept(("c_2", 16)) is None and kept(("c_1", 16)) is None  # four sets, no more


def test_the_first_release_is_read_once_and_is_none_where_the_head_is_it() -> None:
    calls: list[str] = []
    first = SimpleNamespace(release_id="rel_0", content_id="c_5")

    async def history(name: str, n: int | None = None) -> list[Any]:
        calls.append(name)
        return [SimpleNamespace(release_id="rel_2", content_id="c_2"), first]

    host, st = SimpleNamespace(chains=SimpleNamespace(history=history)), SimpleNamespace()
    scenario = SimpleNamespace(name="s")
    for later in ("c_2", "c_9"):  # content ids that sort before and after the first's
        assert asyncio.run(steps.first_release(host, st, scenario, SimpleNamespace(content_id=later))) is first
    same = "".join(["c_", "5"])  # equal, not the same object
    assert asyncio.run(steps.first_release(host, st, scenario, SimpleNamespace(content_id=same))) is None
    assert calls == ["s"]  # kept after the first read: a chain only grows at its head


def test_a_candidate_past_the_drift_bound_is_held() -> None:
    head = [_a(f"It is {i + 1}.") for i in range(20)]
    assert figures(head, head, PROBES, 0, 1.5, SETTINGS).hold is not None
    assert "drifts" in str(figures(head, head, PROBES, 0, 1.5, SETTINGS).hold)
    assert figures(head, head, PROBES, 0, 0.9, SETTINGS).hold is None
    assert figures(head, head, PROBES, 0, 1.0, SETTINGS).hold is None  # at heldout_max_kl itself: passes


def test_degenerate_answers() -> None:
    long = _a("one two three four five six seven eight nine ten")
    assert degenerate(_a("  \n", 1)) == "empty"
    assert degenerate(_a(".", 2), long) == "short" and degenerate(_a(".", 2)) is None
    assert degenerate(_a(" -", 1), long) == "short" and degenerate(_a("I", 1), long) == "short"
    # a terse answer holds a word or a number: a right one-word answer is no silence (reef demo's "say the word"
    # answers were held as cut short; so would a user's "answer in one word" be)
    assert degenerate(_a("Paris.", 2), long) is None and degenerate(_a("ok", 2), long) is None
    assert degenerate(_a("4", 1), long) is None and degenerate(_a("été", 2), long) is None
    assert degenerate(_a("ok", 2), _a("fine", 2)) is None  # the head was short too
    assert degenerate(Answer("yes no " * 8)) == "loop" and degenerate(long) is None  # no tokens: in words
    looping = Answer("orersorersorersorersorers", (1,), (7, 8) * 6)  # one word, a loop in tokens
    assert degenerate(looping) == "loop" and degenerate(Answer("a b c d e f g h i", (1,), tuple(range(9)))) is None


def test_a_sentence_said_twice_after_an_opener_is_a_loop() -> None:
    """A greedy answer that says a sentence again after a long opener (a learned head's answer to "Tell me about
    volcanoes." on SmolLM2) is a loop although few of its token pairs repeat; an honest answer that repeats a phrase
    apart, or says five tokens twice, or a run once and then only part of it, is not. Bugs caught: the rule missing
    (the pairs rule alone passes it), a run of REPEAT - 1 counted, a run said apart counted, an off-by-one at the
    end of the answer (the second saying's last token)."""
    opener = tuple(range(100, 114))  # 14 tokens, none repeated
    sentence = tuple(range(200, 211))  # 11 tokens
    twice = Answer("x", (1,), opener + sentence + sentence)
    assert degenerate(twice) == "loop"
    pairs = list(zip(twice.token_ids, twice.token_ids[1:], strict=False))
    assert len(set(pairs)) > len(pairs) / 2  # the pairs rule alone would pass it
    assert degenerate(Answer("x", (1,), opener + sentence + sentence[:-1])) is None  # not said in full again
    assert degenerate(Answer("x", (1,), opener + sentence + (7,) + sentence)) is None  # said again, apart
    six, five = tuple(range(300, 306)), tuple(range(300, 305))
    assert said_twice((1, 2, *six, *six), REPEAT) and not said_twice((1, 2, *five, *five, 3), REPEAT)
    assert said_twice((*six, *six), REPEAT) and not said_twice((*six, *six[:-1]), REPEAT)
    assert degenerate(Answer("y", (1,), opener + (9, 9) + sentence)) is None  # a token twice is no sentence
    # in words where there are no tokens
    words = "The sea is deep and wide. The sea is deep and wide."
    assert degenerate(Answer("Well, here is what I know about it: " + words)) == "loop"
    # only the tail is read: a loop at the end of a long answer is one, a sentence said twice long before is not
    honest = tuple(range(1000, 1000 + TAIL))
    assert loops(honest + sentence * 4) and not loops(sentence * 2 + honest)
    assert loops(tuple(range(1000, 1000 + TAIL - 2 * len(sentence))) + sentence * 2)  # exactly the tail: read


def test_loops_in_the_answers_to_the_scenarios_own_prompts_hold_though_the_probes_dilute_them() -> None:
    """A candidate whose answers to the recorded prompts loop (a learned head said a sentence again and again after
    a good opener, 7 of 12 everyday answers) while every probe answer is fine: over all 56 answers its degenerate
    share rises 0.12, under the bound, so the share over the recorded prompts alone decides. Bugs caught: the
    recorded share not judged (held by nothing), judged with ``>=`` (4 of 16 is exactly 0.25: passes), judged
    below ``ENOUGH`` recorded prompts (5 of 8 would hold on the noise of a handful), the head's own loops not
    subtracted, and ``clean`` passing a first look that shows loops there."""
    from daemon.gating.heldout import ENOUGH, clean

    opener = tuple(range(100, 114))
    sentence = tuple(range(200, 211))
    fine = Answer("An answer.", (1,), opener + tuple(range(300, 334)))
    looped = Answer("A volcano is a volcano that erupts.", (1,), opener + sentence * 3)
    probes_h = [_a(f"It is {i + 1}.") for i in range(20)]

    def fig(cand_loops: int, head_loops: int = 0, recorded: int = ENOUGH) -> Any:
        cand = [looped] * cand_loops + [fine] * (recorded - cand_loops)
        head = [looped] * head_loops + [fine] * (recorded - head_loops)
        return figures([*cand, *probes_h], [*head, *probes_h], PROBES, recorded, None, SETTINGS)

    seven = fig(7)
    assert seven.degenerate - seven.head_degenerate <= SETTINGS.max_degenerate  # diluted by the probes...
    assert seven.hold is not None and "own prompts degenerate: 44% of 16" in seven.hold  # ...seen on its own
    assert seven.metrics()["heldout_recorded_degenerate"] == 0.4375
    assert seven.metrics()["heldout_head_recorded_degenerate"] == 0
    from daemon.gating.heldout import describe

    assert "on recorded prompts 44% (head 0%)" in str(describe(seven.metrics()))  # reef releases show says it
    assert "on recorded prompts" not in str(describe(fig(0, recorded=0).metrics()))  # none asked: nothing to say
    assert fig(4).hold is None and fig(5).hold is not None  # 0.25 is the bound itself: a rise beyond it holds
    assert fig(7, head_loops=3).hold is None  # the head looped too: a rise of 4 of 16
    assert fig(7, head_loops=3).head_recorded_degenerate == 3 / 16
    assert fig(5, recorded=8).hold is None  # too few recorded prompts: the probe set decides
    assert not clean(fig(3), SETTINGS) and clean(fig(2), SETTINGS)  # 3 of 16 is past half the bound: ask the rest


def test_the_recorded_prompts_are_answered_longer_than_the_probes_so_a_late_loop_shows() -> None:
    """The check asks the recorded prompts for ``heldout_recorded_tokens`` (48) and the probes for
    ``heldout_max_tokens`` (16): a candidate that opens well and then says a sentence again and again (the loop
    starts after the probes' 16 tokens) is held at 48 and passed at 16. A prompt that is also a probe is asked as
    a probe. Bugs caught: every prompt asked at one length (a late loop unseen, or the probes' cost tripled), the
    lengths swapped, a recorded probe asked at two lengths by different checks."""
    from daemon.gating import heldout

    recorded = [f"Tell me about thing {i}." for i in range(16)]

    class Late(_Engine):
        asked_tokens: dict[str, int]

        async def generate(self, exchange: Any, release: Any) -> Any:
            from daemon.exchange import Completion, Finish

            prompt = exchange.messages[-1].text
            self.asked_tokens = {**getattr(self, "asked_tokens", {}), prompt: exchange.sampling.max_tokens}
            if prompt in recorded:  # a 14-token opener, then (the candidate, 7 of 16) a sentence over and over
                late = release == "cand" and recorded.index(prompt) < 7
                ids = (*range(100, 114), *(tuple(range(200, 208)) * 8 if late else range(300, 364)))
            else:
                ids = (5, 6, 2)
            ids = ids[:exchange.sampling.max_tokens]
            yield Finish(Completion(text="words " * len(ids), prompt_token_ids=[1], token_ids=list(ids),
                                    logprobs=[-0.1] * len(ids)))

    engine = Late()
    fig, _, _ = asyncio.run(heldout.run(engine, "tiny", "cand", "head", "base", recorded, SETTINGS))
    assert fig.hold is not None and "own prompts degenerate: 44%" in fig.hold  # 7 of all 36 answers: 19%
    assert {engine.asked_tokens[p] for p in recorded} == {48}
    assert {engine.asked_tokens[p.prompt] for p in PROBES} == {16}
    short = CheckSettings(probes=tuple(PROBES), recorded_tokens=16)  # the old length: the loop is never reached
    assert asyncio.run(heldout.run(Late(), "tiny", "cand", "head", "base", recorded, short))[0].hold is None
    both = [PROBES[0].prompt, *recorded[1:]]  # a recorded prompt that is also a probe is asked as a probe
    assert SETTINGS.asking(both) == (16, frozenset(recorded[1:]), 48)


def test_the_shipped_probe_set_and_a_users_malformed_one() -> None:
    probes = shipped_probes()
    assert 24 <= len(probes) <= 40 and len({p.prompt for p in probes}) == len(probes)
    assert Probe("Capital of France?", ("Paris",)).right("The capital is Paris.")
    assert not Probe("How many legs?", ("8",)).right("18 legs")  # a whole word, not a substring
    for bad in ([{"prompt": "x", "accept": ["y"]}] * 3, [{"prompt": "", "accept": ["y"]}] * 8,
                [{"prompt": "x", "accept": []}] * 8, [{"prompt": "x", "accept": ["?!"]}] * 8, "probes"):
        with pytest.raises(BadRequest) as e:
            parse_probes(bad)
        assert e.value.data["param"] == "settings.heldout_probes"


def test_the_reserved_share_of_prompts_is_stable() -> None:
    prompts = [[i, i * 7 % 13, 5] for i in range(2000)]
    picked = [reserved(p, 0.1) for p in prompts]
    assert 0.07 < sum(picked) / len(picked) < 0.13
    assert picked == [reserved(p, 0.1) for p in prompts]  # the same prompt, the same answer, every time
    assert not any(reserved(p, 0.0) for p in prompts)


def test_each_held_out_setting_is_refused_past_its_bounds_and_taken_at_them() -> None:
    """``check_settings``: each bound is taken, a step past it refused naming the setting; ``heldout_max_kl`` and
    ``heldout_timeout_s`` are open at 0; not a number, not finite, or a malformed probe set is refused. Bugs caught:
    a bound moved (``heldout_max_tokens`` 513 taken, ``heldout_max_kl`` 100 refused), either end of a range dropped,
    the open ends closed or dropped, the probes not read."""
    from daemon.gating.heldout import check_settings

    bounds = {"heldout_share": (0, 0.5), "heldout_max_degenerate": (0, 1), "heldout_probe_z": (0.5, 10),
              "heldout_max_kl": (0, 100), "heldout_max_tokens": (4, 512), "heldout_recorded_tokens": (4, 512),
              "heldout_timeout_s": (0, 3600)}
    open_at_0 = {"heldout_max_kl", "heldout_timeout_s"}

    def refused(key: str, value: Any) -> bool:
        try:
            check_settings(SimpleNamespace(**{key: value}))
        except BadRequest as e:
            assert e.data["param"] == f"settings.{key}" and key in e.message, e.message
            return True
        return False

    for key, (lo, hi) in bounds.items():
        step = 1 if isinstance(hi, int) and hi > 100 else 0.01
        assert not refused(key, hi) and refused(key, hi + step), key
        assert refused(key, lo - step) and refused(key, -lo - 1), key
        assert refused(key, lo) == (key in open_at_0), key
        assert not refused(key, lo + step), key
        for bad in ("1", float("nan"), float("inf"), [1]):
            assert refused(key, bad), (key, bad)
    check_settings(SimpleNamespace())  # nothing set: the defaults
    assert not refused("heldout_timeout_s", 0.5) and not refused("heldout_max_kl", 0.001)  # open at 0, not at 1
    with pytest.raises(BadRequest, match="heldout_probes"):
        check_settings(SimpleNamespace(heldout_probes=[{"prompt": "x", "accept": ["y"]}]))
    with pytest.raises(BadRequest) as e:  # the probe named by its setting and its place
        check_settings(SimpleNamespace(heldout_probes=[{"prompt": "x", "accept": ["y"]}] * 8 + [{"prompt": "x"}]))
    assert e.value.message.startswith("heldout_probes[8] must be")
    assert e.value.data["param"] == "settings.heldout_probes"


def test_every_figure_of_a_mixed_check_is_its_share_of_the_answers() -> None:
    """Two recorded prompts and four probes, answered each way there is: the candidate empty, looping, right, cut
    short, wrong where the head was right, right where the head was empty. Every figure is read, so each share's
    numerator and denominator count (a share times the answers, or a whole-number mean, shows), and one probe set of
    one probe is right or wrong as a whole."""
    long = "It is 2 and that is all there is to say."
    cand = [_a("", 1), Answer("x y", (1,), (7, 8) * 6), _a("It is 1."), _a(".", 2), _a("I do not know."),
            _a("It is 4.")]
    head = [_a("a b c d e f g h i", 10), _a("a b c d e f g h", 9), _a("It is 1."), _a(long), _a("It is 3."),
            _a("", 1)]
    fig = figures(cand, head, PROBES[:4], 2, 0.5, SETTINGS)
    assert [degenerate(c, h) for c, h in zip(cand, head, strict=True)] == ["empty", "loop", None, "short", None,
                                                                           None]
    ctok, htok = 1 + 12 + 4 + 2 + 5 + 4, 10 + 9 + 4 + 12 + 4 + 1
    assert (fig.recorded, fig.probes) == (2, 4)
    assert (fig.empty, fig.head_empty, fig.silent, fig.head_silent) == pytest.approx((1 / 6, 1 / 6, 2 / 6, 1 / 6))
    assert (fig.degenerate, fig.head_degenerate) == pytest.approx((3 / 6, 1 / 6))
    assert (fig.recorded_degenerate, fig.head_recorded_degenerate) == (1.0, 0.0)
    assert (fig.probe_accuracy, fig.head_probe_accuracy, fig.probes_lost, fig.probes_gained) == (0.5, 0.75, 2, 1)
    assert fig.probe_noise == pytest.approx(2 * 3 ** 0.5) and fig.kl == 0.5
    assert (fig.tokens, fig.head_tokens, fig.length_ratio) == pytest.approx((ctok / 6, htok / 6, ctok / htok))
    assert (fig.base_probe_accuracy, fig.probes_lost_base, fig.probes_gained_base, fig.base_probe_noise) == (
        None, 0, 0, 0.0)  # no first release to compare with: nothing lost against it
    assert fig.hold is not None and "answers degenerate: 50%" in fig.hold and "forgets" not in fig.hold
    one = [Probe("What is 0 + 1?", ("1",))]
    assert figures([_a("It is 1.")], [_a("no")], one, 0, None, SETTINGS).probe_accuracy == 1.0
    assert figures([_a("no")], [_a("It is 1.")], one, 0, None, SETTINGS).head_probe_accuracy == 1.0
    assert figures([_a("no")], [_a("no")], one, 0, None, SETTINGS, base=[_a("It is 1.")]).base_probe_accuracy == 1.0


def test_answers_that_do_not_pair_with_the_prompts_are_an_error() -> None:
    """``figures`` is given the candidate's, the head's and the base's answers in the prompts' order: a list of
    another length is a caller's bug, said with the lengths, never figures of a shifted pairing."""
    head = [_a(f"It is {i + 1}.") for i in range(20)]
    for cand, heads in ((head + [_a("x")], head), (head, head + [_a("x")]), (head[:-1], head[:-1]),
                        (head + [_a("x")], head + [_a("x")]), (head[:-1], head)):
        with pytest.raises(AssertionError):
            figures(cand, heads, PROBES, 0, None, SETTINGS)
    for base in (head[:-1], head + [_a("x")]):
        with pytest.raises(AssertionError):
            figures(head, head, PROBES, 0, None, SETTINGS, base=base)


def test_a_large_probe_set_is_figured_like_a_small_one() -> None:
    """A user's probe set has no upper bound: 300 probes (lengths past the integers Python keeps as one object)
    are paired and figured as 20 are. Bug caught: the answers' lengths compared by identity (``is``)."""
    many = [Probe(f"What is {i} + 1?", (str(i + 1),)) for i in range(300)]
    right = [_a(f"It is {i + 1}.") for i in range(300)]
    fig = figures(right, list(right), many, 0, None, CheckSettings(probes=tuple(many)), base=list(right))
    assert fig.hold is None and (fig.probe_accuracy, fig.base_probe_accuracy) == (1.0, 1.0)


def _figs(**kw: Any) -> Any:
    from daemon.gating.heldout import Figures

    zero = dict(recorded=16, probes=20, empty=0.0, head_empty=0.0, silent=0.0, head_silent=0.0, degenerate=0.0,
                head_degenerate=0.0, recorded_degenerate=0.0, head_recorded_degenerate=0.0, length_ratio=1.0,
                probe_accuracy=0.5, head_probe_accuracy=0.5, probes_lost=0, probes_gained=0, probe_noise=0.0, kl=None)
    return Figures(**(zero | kw))


def test_a_first_look_exactly_half_the_bound_from_the_head_is_clean_and_past_it_is_not() -> None:
    """``clean``: each share (silent, degenerate, the recorded prompts' degenerate) within half of
    ``heldout_max_degenerate`` of the head's passes the first look, a little past it asks the rest; so does a
    net probe loss against the head or the base. Bugs caught: ``<`` for ``<=`` at half, a share's test dropped."""
    from daemon.gating.heldout import clean

    half = SETTINGS.max_degenerate / 2
    assert clean(_figs(), SETTINGS)
    for share in ("silent", "degenerate", "recorded_degenerate"):
        assert clean(_figs(**{share: 0.5 + half, f"head_{share}": 0.5}), SETTINGS), share
        assert not clean(_figs(**{share: 0.5 + half + 0.01, f"head_{share}": 0.5}), SETTINGS), share
        assert clean(_figs(**{share: 0.5, f"head_{share}": 0.5 + half + 0.01}), SETTINGS), share
        assert not clean(_figs(**{share: half + 0.01}), SETTINGS), share  # from a head at 0
    assert not clean(_figs(probes_lost=2, probes_gained=1), SETTINGS) and clean(_figs(probes_lost=1,
                                                                                     probes_gained=1), SETTINGS)
    assert not clean(_figs(probes_lost_base=2, probes_gained_base=1), SETTINGS)
    assert clean(_figs(probes_lost_base=1, probes_gained_base=1), SETTINGS)


def test_the_metrics_say_each_figure_at_its_precision() -> None:
    """``Figures.metrics``: shares and ratios to 4 places, the noises and the seconds to 3, mean lengths to 2; the
    base's figures only where there was a first release, the lengths only where both were measured."""
    third, seventh = 1 / 3, 1 / 7
    fig = _figs(recorded=3, probes=7, empty=seventh, head_empty=2 * seventh, silent=3 * seventh,
                head_silent=4 * seventh, degenerate=5 * seventh, head_degenerate=6 * seventh,
                recorded_degenerate=third, head_recorded_degenerate=2 * third, length_ratio=1 / 9,
                probe_accuracy=2 / 9, head_probe_accuracy=4 / 9, probes_lost=3, probes_gained=1,
                probe_noise=1 / 11, kl=1 / 13, base_probe_accuracy=5 / 9, probes_lost_base=4, probes_gained_base=2,
                base_probe_noise=2 / 11, seconds=1 / 17, answer_seconds=2 / 17, kl_seconds=3 / 17, head_sampled=5,
                prefetch_seconds=4 / 17, tokens=10 / 3, head_tokens=20 / 3, notes=["a", "b"], hold="why")
    assert fig.metrics() == {
        "heldout": "held", "heldout_recorded": 3, "heldout_probes": 7,
        "heldout_empty": 0.1429, "heldout_head_empty": 0.2857, "heldout_silent": 0.4286, "heldout_head_silent": 0.5714,
        "heldout_degenerate": 0.7143, "heldout_head_degenerate": 0.8571, "heldout_recorded_degenerate": 0.3333,
        "heldout_head_recorded_degenerate": 0.6667, "heldout_probe_accuracy": 0.2222,
        "heldout_head_probe_accuracy": 0.4444, "heldout_probes_lost": 3, "heldout_probes_gained": 1,
        "heldout_probe_noise": 0.091, "heldout_seconds": 0.059, "heldout_answer_seconds": 0.118,
        "heldout_kl_seconds": 0.176, "heldout_head_sampled": 5, "heldout_base_probe_accuracy": 0.5556,
        "heldout_probes_lost_base": 4, "heldout_probes_gained_base": 2, "heldout_base_probe_noise": 0.182,
        "heldout_prefetch_seconds": 0.235, "heldout_length_ratio": 0.1111, "heldout_tokens": 3.33,
        "heldout_head_tokens": 6.67, "heldout_kl": 0.0769, "heldout_note": "a; b", "heldout_reason": "why"}
    plain = _figs(length_ratio=None, tokens=2.0).metrics()
    assert plain["heldout"] == "passed" and not {"heldout_length_ratio", "heldout_tokens", "heldout_head_tokens",
                                                 "heldout_kl", "heldout_note", "heldout_reason",
                                                 "heldout_base_probe_accuracy", "heldout_prefetch_seconds"} & set(plain)


def test_the_users_prompt_is_the_last_user_text_of_the_recorded_request() -> None:
    """``user_prompt``: the last user message with text (stripped), tool results left out, in each format; None for
    a record without a known format, a request that is not an object or does not parse, or no user text."""
    from daemon.gating.heldout import user_prompt

    calls = [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    chat = {"model": "m", "messages": [{"role": "user", "content": "first"}, {"role": "assistant", "content": "b"},
                                       {"role": "user", "content": "  second  "},
                                       {"role": "assistant", "content": None, "tool_calls": calls},
                                       {"role": "tool", "tool_call_id": "t1", "content": "a result"}]}
    assert user_prompt({"format": "openai-chat", "request": chat}) == "second"
    anthropic = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}]}
    assert user_prompt({"format": "anthropic", "request": anthropic}) == "q1"
    assert user_prompt({"format": "openai-chat", "request": {"model": "m", "messages": [
        {"role": "assistant", "content": "only me"}, {"role": "user", "content": "   "}]}}) is None
    for bad in ({"request": chat}, {"format": "nope", "request": chat}, {"format": "openai-chat", "request": "x"},
                {"format": "openai-chat"}, {"format": "openai-chat", "request": {"model": "m", "messages": "no"}}):
        assert user_prompt(bad) is None, bad


class _Engine:
    """A stand-in engine: the same answer to everything, a fixed KL; what it was asked, by whom."""

    answer_many = Engine.answer_many  # the default paths, each answer a request (the transformers engine's: below)
    divergence_many = Engine.divergence_many

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []
        self.unloaded: Any = None

    async def generate(self, exchange: Any, release: Any) -> Any:
        from daemon.exchange import Completion, Finish

        self.asked.append((release, exchange.messages[-1].text))
        yield Finish(Completion(text="It is 2.", prompt_token_ids=[1], token_ids=[5, 6, 2], logprobs=[-0.1] * 3))

    async def divergence(self, prompt: Any, tokens: Any, release: Any, reference: Any) -> list[float]:
        return [0.01] * len(tokens)

    async def unload(self, release: Any) -> None:
        self.unloaded = release


def test_the_head_is_asked_only_what_it_was_not_asked_before_and_the_candidate_is_dropped() -> None:
    from daemon.gating import heldout

    engine = _Engine()
    known = {p.prompt: _a("It is 2.") for p in PROBES}
    fig, cands, heads = asyncio.run(heldout.run(engine, "tiny", "cand", "head", "base", ["Tell me about rain."],
                                                SETTINGS, known))
    assert [p for who, p in engine.asked if who == "head"] == ["Tell me about rain."] and fig.head_sampled == 1
    # no sign of harm on the recorded prompt and every other probe: the second half is never asked
    first = [p.prompt for p in PROBES[::2]]
    assert [p for who, p in engine.asked if who == "cand"] == ["Tell me about rain.", *first]
    assert engine.unloaded == "cand" and fig.probes == len(first) and "first 10 of 20 probes" in fig.notes[-1]
    assert fig.kl == pytest.approx(0.01) and set(cands) == {"Tell me about rain.", *first}
    assert set(heads) == {"Tell me about rain.", *known}


class _Forgetful(_Engine):
    """The head answers every probe right; the candidate says "I do not know." to the ones in ``forgets``."""

    def __init__(self, forgets: set[int]) -> None:
        super().__init__()
        self.forgets = forgets

    async def generate(self, exchange: Any, release: Any) -> Any:
        from daemon.exchange import Completion, Finish

        prompt = exchange.messages[-1].text
        self.asked.append((release, prompt))
        i = next(i for i, p in enumerate(PROBES) if p.prompt == prompt)
        text = "I do not know." if release == "cand" and i in self.forgets else f"It is {i + 1}."
        yield Finish(Completion(text=text, prompt_token_ids=[1], token_ids=[5, 6, 7, 2], logprobs=[-0.1] * 4))


def test_a_loss_in_the_first_half_of_the_probes_asks_the_rest_and_decides_on_all() -> None:
    from daemon.gating import heldout

    # one probe lost in the first half (within its noise there) and six in the second: held on the whole set
    engine = _Forgetful({0, 1, 3, 5, 7, 9, 11})
    fig, cands, _ = asyncio.run(heldout.run(engine, "tiny", "cand", "head", "base", [], SETTINGS))
    assert len([1 for who, _ in engine.asked if who == "cand"]) == len(PROBES) and fig.probes == len(PROBES)
    assert fig.probes_lost == 7 and fig.hold is not None and "forgets" in fig.hold and len(cands) == len(PROBES)
    assert not [n for n in fig.notes if "passed on the first" in n]  # decided on both halves
    # the same candidate decided on the first half alone would pass: the second stage is what holds it
    first = PROBES[::2]
    half = heldout.figures([cands[p.prompt] for p in first], [_a(f"It is {2 * i + 1}.") for i in range(10)],
                           first, 0, fig.kl, SETTINGS)
    assert half.hold is None and not heldout.clean(half, SETTINGS)
    # one that forgets nothing in the first half is not asked the second
    engine = _Forgetful({1, 3})
    fig, _, _ = asyncio.run(heldout.run(engine, "tiny", "cand", "head", "base", [], SETTINGS))
    assert fig.probes == 10 and fig.hold is None and len([1 for w, _ in engine.asked if w == "cand"]) == 10


class _Lineage(_Engine):
    """Every probe right from the base ("first"); the head forgot ``head_wrong``, the candidate ``cand_wrong``."""

    def __init__(self, head_wrong: set[int], cand_wrong: set[int]) -> None:
        super().__init__()
        self.wrong = {"first": set(), "head": head_wrong, "cand": cand_wrong}

    async def generate(self, exchange: Any, release: Any) -> Any:
        from daemon.exchange import Completion, Finish

        prompt = exchange.messages[-1].text
        self.asked.append((release, prompt))
        i = next((i for i, p in enumerate(PROBES) if p.prompt == prompt), -1)
        text = "I do not know." if i in self.wrong[release] else f"It is {i + 1}."
        yield Finish(Completion(text=text, prompt_token_ids=[1], token_ids=[5, 6, 7, 2], logprobs=[-0.1] * 4))


def test_the_first_releases_answers_are_asked_once_for_the_probes_only_and_decide_with_the_heads() -> None:
    """The check compares the candidate's probe answers with the chain's first release's too: asked of it once
    (kept in the caller's dict; a second check asks it nothing), and only the probes (not the recorded prompts,
    which no figure compares with the base). A lineage whose head already lost 3 (within the noise) and whose
    candidate loses 3 more is held on the whole set; without the first release it passes."""
    from daemon.gating import heldout

    firsts: dict[str, Answer] = {}
    engine = _Lineage({0, 2, 4}, {0, 2, 4, 6, 8, 10})
    fig, _, _ = asyncio.run(heldout.run(engine, "tiny", "cand", "head", "base", ["Tell me about rain."], SETTINGS,
                                        first_release="first", first_known=firsts))
    asked_first = [p for who, p in engine.asked if who == "first"]
    assert sorted(asked_first) == sorted(p.prompt for p in PROBES) and set(firsts) == set(asked_first)
    assert fig.probes == 20 and fig.hold is not None and "forgets what the base knew" in fig.hold, fig.hold
    again = _Lineage({0, 2, 4}, {0, 2, 4, 6, 8, 10})
    fig2, _, _ = asyncio.run(heldout.run(again, "tiny", "cand", "head", "base", [], SETTINGS, first_release="first",
                                         first_known=firsts))
    assert not [p for who, p in again.asked if who == "first"] and fig2.hold == fig.hold
    plain = _Lineage({0, 2, 4}, {0, 2, 4, 6, 8, 10})
    fig3, _, _ = asyncio.run(heldout.run(plain, "tiny", "cand", "head", "base", [], SETTINGS))
    assert fig3.hold is None and fig3.base_probe_accuracy is None


def test_the_checks_settings_are_read_from_a_recipes_and_default_to_its_own() -> None:
    """``CheckSettings.of``: each ``heldout_*`` setting read, the check's defaults where a recipe's settings have
    none, the same as a recipe's ``GateSettings`` defaults; the shipped probes read once. Bugs caught: a default of
    the class apart from the recipe's (the check off by default), a setting not read, the probe file read again
    at every check."""
    from recipes.base import GateSettings

    assert CheckSettings.of(SimpleNamespace()) == CheckSettings(probes=shipped_probes()) == CheckSettings.of(
        GateSettings())
    assert CheckSettings().on and shipped_probes() is shipped_probes()
    own = [{"prompt": f"Say {w}.", "accept": [w]} for w in "abcdefgh"]
    got = CheckSettings.of(SimpleNamespace(heldout_check=False, heldout_share=0.2, heldout_probes=own,
                                           heldout_max_degenerate=0.3, heldout_probe_z=3, heldout_max_kl=2,
                                           heldout_max_tokens=20, heldout_recorded_tokens=30, heldout_timeout_s=9))
    assert got == CheckSettings(on=False, share=0.2, probes=parse_probes(own), max_degenerate=0.3, probe_z=3.0,
                                max_kl=2.0, max_tokens=20, recorded_tokens=30, timeout_s=9.0)
    assert got.lengths == (20, 30)


def test_the_check_asks_enough_recorded_prompts_for_their_own_share_to_be_judged() -> None:
    """The recorded prompts' degenerate share is judged once ``ENOUGH`` are asked: the check asks as many
    (``RECORDED``, which the learner reads): fewer and the rule never fires, more and every check pays answers that
    change nothing. Bug caught: ``RECORDED`` moved off ``ENOUGH``."""
    from daemon.gating.heldout import ENOUGH, RECORDED

    assert RECORDED == ENOUGH


def test_cut_short_is_at_most_two_tokens_where_the_head_said_eight_or_more() -> None:
    """``degenerate``'s ``short`` at its edges (``SHORT`` 2, ``LONG`` 8): 2 tokens against a head's 8 is cut short, 3
    tokens, or a head of 7, is not; a loop of exactly ``LOOP`` tokens is read in tokens. Bugs caught: either bound
    moved, ``<`` for ``<=``, ``>`` for ``>=`` at ``LOOP``."""
    head, shorter = _a("x", 8), _a("x", 7)
    assert degenerate(_a(".", 2), head) == "short" and degenerate(_a(". . .", 3), head) is None
    assert degenerate(_a(".", 2), shorter) is None and degenerate(_a(".", 1), _a("x", 13)) == "short"
    from daemon.loops import LOOP

    assert degenerate(Answer(" ".join(f"w{i}" for i in range(LOOP)), (1,), (7, 8) * (LOOP // 2))) == "loop"


def test_a_net_loss_of_one_probe_never_holds_however_small_the_noise() -> None:
    """``MIN_LOST``: at ``heldout_probe_z`` 0.5 one probe lost net is past its noise (0.5) and still passes; two
    (noise 0.71) hold; against the base the same. Bugs caught: ``MIN_LOST`` 1, ``!=`` for ``>=``."""
    z = CheckSettings(probes=tuple(PROBES), probe_z=0.5)
    head = _knowing(set())
    one, two = figures(_knowing({0}), head, PROBES, 0, None, z), figures(_knowing({0, 1}), head, PROBES, 0, None, z)
    assert one.hold is None and one.probe_noise == 0.5
    flips = figures(_knowing({0, 1}), _knowing({19}), PROBES, 0, None, z)  # 2 lost, 1 gained: a net 1 of 3 flips
    assert flips.hold is None and flips.probe_noise < 1, flips.hold
    base_flips = figures(_knowing({0, 1}), _knowing({0, 1}), PROBES, 0, None, z, base=_knowing({19}))
    assert base_flips.hold is None and base_flips.base_probe_noise < 1, base_flips.hold
    # a net loss exactly at the noise passes against the head too: 4 lost, none gained is 4 = 2 sqrt(4)
    edge = figures(_knowing({0, 1, 2, 3}), head, PROBES, 0, None, SETTINGS)
    assert edge.hold is None and edge.probe_noise == 4.0
    assert two.hold is not None and "it forgets: probe accuracy 90%" in two.hold
    three = figures(_knowing({0, 1, 2}), head, PROBES, 0, None, z)
    assert three.hold is not None and "(3 probes lost, 0 gained" in three.hold
    assert figures(_knowing({0}), _knowing({0}), PROBES, 0, None, z, base=head).hold is None
    # 5 lost and 3 gained is a net 2, within the noise of 8 flips (5.7): the net loss is judged, not the flips
    assert figures(_knowing({0, 1, 2, 3, 4}), _knowing({10, 11, 12}), PROBES, 0, None, SETTINGS).hold is None
    assert "forgets what the base knew" in str(figures(_knowing({0, 1}), _knowing({0, 1}), PROBES, 0, None, z,
                                                       base=head).hold)


def test_a_silent_head_counts_against_the_candidates_silence() -> None:
    """The silent share is judged as a rise over the head's: a head 20% silent and a candidate 40% is a rise of
    0.2, within ``heldout_max_degenerate``. Bug caught: the shares added rather than subtracted."""
    head = [_a("", 1) if i < 4 else _a(f"It is {i + 1}.") for i in range(20)]
    cand = [_a("", 1) if i < 8 else _a(f"It is {i + 1}.") for i in range(20)]
    fig = figures(cand, head, PROBES, 0, None, CheckSettings(probes=tuple(PROBES), probe_z=10))
    assert (fig.silent, fig.head_silent) == (0.4, 0.2) and fig.hold is None, fig.hold


def test_the_first_look_is_clean_when_it_gains_probes() -> None:
    """``clean`` reads a net loss: a candidate that gains probes (against the head or the base) and loses fewer is
    clean. Bug caught: ``==`` (``is``) for ``<=``."""
    from daemon.gating.heldout import clean

    assert clean(_figs(probes_lost=1, probes_gained=3), SETTINGS)
    assert clean(_figs(probes_lost_base=0, probes_gained_base=3), SETTINGS)
    assert clean(_figs(probes_lost_base=300, probes_gained_base=300), SETTINGS)  # equal, not the same object


def test_the_kl_is_the_mean_per_token_over_at_most_twelve_answers_spread_over_all() -> None:
    """``kl_from_base``: every ``ceil(n / KL_ANSWERS)``-th answer with tokens (13 of them: 7, 24: 12, 12: all), the
    mean over their tokens (not of the answers' means); None when no answer has tokens, the engine cannot score, or
    it scores no token. Bugs caught: ``KL_ANSWERS`` moved, the step rounded down, a mean of means."""
    from daemon.gating.heldout import kl_from_base

    class Scores:
        def __init__(self, kls: Any = "by length") -> None:
            self.rows: list[tuple[list[int], list[int]]] = []
            self.kls = kls

        async def divergence_many(self, rows: Any, candidate: Any, base: Any) -> Any:
            assert (candidate, base) == ("cand", "base")
            self.rows += rows
            if self.kls != "by length":
                return self.kls
            return [[1.0] if len(t) == 1 else [0.0] * len(t) for _, t in rows]

    def answers(n: int) -> list[Answer]:
        return [Answer("a", (i,), (i,) if i % 2 else (i, i, i)) for i in range(n)]

    for n, picked in ((13, list(range(0, 13, 2))), (24, list(range(0, 24, 2))), (12, list(range(12))),
                      (25, list(range(0, 25, 3)))):
        engine = Scores()
        kl = asyncio.run(kl_from_base(engine, answers(n), "cand", "base"))
        assert [p[0] for p, _ in engine.rows] == picked, n
        ones = sum(1 for i in picked if i % 2)
        assert kl == pytest.approx(ones / (ones + 3 * (len(picked) - ones))), n
    none = [Answer("", (1,), ())] * 5
    assert asyncio.run(kl_from_base(Scores(), none, "cand", "base")) is None
    assert asyncio.run(kl_from_base(Scores(), [*none, Answer("a", (1,), (1,))], "cand", "base")) == 1.0
    assert asyncio.run(kl_from_base(Scores(None), answers(3), "cand", "base")) is None
    assert asyncio.run(kl_from_base(Scores([[], [], []]), answers(3), "cand", "base")) is None


def test_the_checks_seconds_are_its_answers_and_its_kls_on_the_clock() -> None:
    """``run``'s timings, on a clock the stand-in engine moves (a second an answer, half one a KL row): the answers'
    seconds (the head's and the candidate's), the KL's, and the whole. Bugs caught: a duration made a quotient or
    a floor division of two readings of the clock."""
    from daemon.gating import heldout

    now = [1.0]  # a clock read near its start: a duration is not the remainder of two readings

    class Timed(_Engine):
        async def generate(self, exchange: Any, release: Any) -> Any:
            now[0] += 1.0
            async for out in super().generate(exchange, release):
                yield out

        async def divergence(self, prompt: Any, tokens: Any, release: Any, reference: Any) -> list[float]:
            now[0] += 0.5
            return await super().divergence(prompt, tokens, release, reference)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(heldout, "time", SimpleNamespace(perf_counter=lambda: now[0]))
        fig, _, _ = asyncio.run(heldout.run(Timed(), "tiny", "cand", "head", "base", ["Tell me about rain."],
                                            SETTINGS))
    assert (fig.answer_seconds, fig.kl_seconds, fig.seconds) == (22.0, 5.5, 27.5)  # 11 prompts, twice; 11 rows
    assert fig.head_sampled == 11


def test_describe_says_the_figures_a_release_has_and_no_others() -> None:
    """``describe``: a line of the figures present, the reason and the note; a release with no probe noise or
    length written says none (an older manifest), one never checked says nothing."""
    from daemon.gating.heldout import describe

    assert describe({}) is None
    assert describe({"heldout": "unchecked"}) == "held-out check: unchecked (heldout_check = false)"
    m = {"heldout": "passed", "heldout_probe_accuracy": 0.5, "heldout_recorded": 2, "heldout_probes": 10}
    assert describe(m) == ("held-out check: passed; probes 50% right (head 0%, noise 0.0); on 2 recorded prompt(s) "
                           "and 10 probes")
    assert describe({"heldout": "passed"}) == "held-out check: passed; on 0 recorded prompt(s) and 0 probes"
    assert describe({"heldout": "passed", "heldout_degenerate": 0.5, "heldout_recorded": 3,
                     "heldout_recorded_degenerate": 0.25}) == (
        "held-out check: passed; degenerate answers 50% (head 0%), on recorded prompts 25% (head 0%), empty 0%; "
        "on 3 recorded prompt(s) and 0 probes")
    full = {**m, "heldout": "held", "heldout_degenerate": 0.25, "heldout_length_ratio": 0.5, "heldout_kl": 0.1234,
            "heldout_reason": "why", "heldout_note": "a note"}
    assert describe(full) == ("held-out check: held; degenerate answers 25% (head 0%), empty 0%; probes 50% right "
                              "(head 0%, noise 0.0); length 0.50x the head's; KL from base 0.123 nats/token; on 2 "
                              "recorded prompt(s) and 10 probes. why (a note)")


def test_a_check_the_engine_fails_says_why_and_still_drops_the_candidate() -> None:
    """``run`` when the engine fails: a Reef error's own words, another exception's type and words, a timeout's
    bound, a ``CheckFailed`` as it was; each a ``CheckFailed``, the candidate unloaded all the same, and an unload
    that fails too leaves the first reason. Bugs caught: a Reef error said as an exception's repr, another exception
    let through (the step would crash rather than fail)."""
    from daemon.errors import EngineError
    from daemon.gating import heldout

    class Failing(_Engine):
        def __init__(self, error: BaseException | None, unload_fails: bool = False) -> None:
            super().__init__()
            self.error, self.unload_fails = error, unload_fails

        async def generate(self, exchange: Any, release: Any) -> Any:
            if self.error is None:
                await asyncio.sleep(10)
            else:
                raise self.error
            async for out in super().generate(exchange, release):
                yield out

        async def unload(self, release: Any) -> None:
            await super().unload(release)
            if self.unload_fails:
                raise RuntimeError("cannot unload")

    quick = CheckSettings(probes=tuple(PROBES), timeout_s=0.05)
    for error, said in ((EngineError("the model is gone"), "the model is gone"),
                        (RuntimeError("boom"), "RuntimeError: boom"),
                        (CheckFailed("as it was"), "as it was"),
                        (None, "it took longer than heldout_timeout_s 0.05")):
        for unload_fails in (False, True):
            engine = Failing(error, unload_fails)
            with pytest.raises(CheckFailed) as e:
                asyncio.run(heldout.run(engine, "tiny", "cand", "head", "base", [], quick))
            assert e.value.data["reason"] == said and engine.unloaded == "cand", (e.value.data, said)


def test_a_probe_set_is_refused_naming_the_setting_and_what_is_wrong() -> None:
    """``parse_probes``: too few, or an item with another key, no text prompt or no accepted answer, each refused
    with the setting's name (not its path) and the item's place. Bug caught: an extra key taken beside a prompt."""
    ok = [{"prompt": f"Say {w}.", "accept": [w]} for w in "abcdefgh"]
    with pytest.raises(BadRequest) as e:
        parse_probes(ok[:7])
    assert e.value.message.startswith("heldout_probes must be a list of at least 8 probes"), e.value.message
    for bad in ({"prompt": "Say x.", "accept": ["x"], "weight": 2}, {"prompt": 3, "accept": ["x"]},
                {"prompt": "Say x.", "accept": "x"}, ["Say x.", "x"]):
        with pytest.raises(BadRequest) as e:
            parse_probes([*ok, bad])
        assert e.value.message.startswith("heldout_probes[8] must be"), (bad, e.value.message)
    long = {"prompt": "x" * 300}
    with pytest.raises(BadRequest) as e:
        parse_probes([*ok, long])
    assert e.value.message.endswith(", not " + json.dumps(long)[:120]), e.value.message
    with pytest.raises(dataclasses.FrozenInstanceError):  # settings read once are not changed by a check
        CheckSettings().share = 0.5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):  # nor are their probes
        PROBES[0].prompt = "x"  # type: ignore[misc]


def test_the_degenerate_share_holds_only_past_its_bound_and_traffic_is_said_only_below_enough() -> None:
    """Degenerate answers (loops; then silence) rising by exactly ``heldout_max_degenerate`` pass, one more holds;
    the note on too little traffic is said below ``ENOUGH`` recorded prompts and not at or above it, and a fresh
    figure spent no time. Bugs caught: ``>=`` or ``==`` for ``>``, the note for any count but ``ENOUGH``."""
    from daemon.gating.heldout import ENOUGH

    loop = Answer("x y", (1,), (7, 8) * 6)
    head = [_a(f"It is {i + 1}.") for i in range(20)]
    lenient = CheckSettings(probes=tuple(PROBES), probe_z=10)
    five = figures([loop] * 5 + head[5:], head, PROBES, 0, None, lenient)
    assert five.degenerate == 0.25 and five.hold is None, five.hold
    six = figures([loop] * 6 + head[6:], head, PROBES, 0, None, lenient)
    assert six.hold is not None and "its answers degenerate: 30%" in six.hold
    quiet = figures([_a("", 1)] * 5 + head[5:], head, PROBES, 0, None, lenient)  # silence at the bound too
    assert quiet.silent == 0.25 and quiet.hold is None, quiet.hold
    assert "it stops answering: 30%" in str(figures([_a("", 1)] * 6 + head[6:], head, PROBES, 0, None, lenient).hold)
    assert (five.seconds, five.answer_seconds, five.kl_seconds, five.head_sampled, five.prefetch_seconds) == (
        0.0, 0.0, 0.0, 0, None)

    def note(recorded: int) -> bool:
        rec = [_a("An answer here.")] * recorded
        fig = figures(rec + head, rec + head, PROBES, recorded, 0.1, SETTINGS)
        return any("too little traffic" in n for n in fig.notes)

    assert note(ENOUGH - 1) and not note(ENOUGH) and not note(ENOUGH + 1)


def test_figures_of_one_recorded_prompt_or_no_probes_are_whole_shares() -> None:
    """``figures`` at its smallest: one recorded prompt that loops is 100% of the recorded share; no probes at
    all (recorded prompts alone) is an accuracy of 0 against the head and the base, not a division by zero; more
    recorded prompts than ``ENOUGH`` are judged on their own too. Bugs caught: a share over ``max(2, n)``, the
    guard against no probes dropped, the recorded share judged only at exactly ``ENOUGH``."""
    from daemon.gating.heldout import ENOUGH

    loop, fine = Answer("x y", (1,), (7, 8) * 6), _a("An answer here.")
    one = figures([loop], [loop], [], 1, None, SETTINGS, base=[])
    assert (one.recorded_degenerate, one.head_recorded_degenerate, one.degenerate) == (1.0, 1.0, 1.0)
    assert (one.probe_accuracy, one.head_probe_accuracy, one.base_probe_accuracy) == (0.0, 0.0, 0.0)
    assert one.hold is None  # the head loops as much
    many = ENOUGH + 1
    probes = [_a(f"It is {i + 1}.") for i in range(20)]  # the probes dilute the loops: 7 of 37 overall
    held = figures([loop] * 7 + [fine] * (many - 7) + probes, [fine] * many + probes, PROBES, many, None, SETTINGS)
    assert held.hold is not None and f"own prompts degenerate: 41% of {many}" in held.hold, held.hold


def test_the_answers_keep_each_completions_ids_and_ask_the_longer_prompts_longer() -> None:
    """``answers``: one ``Answer`` per prompt with the completion's text, prompt and answer token ids and logprobs
    (missing ones empty: the KL is measured on the prompt's ids); the prompts in ``longer`` asked for
    ``longer_tokens``, the others ``max_tokens``; no prompt, no request. Bugs caught: the prompt's ids or the
    logprobs dropped."""
    from daemon.exchange import Completion
    from daemon.gating.heldout import answers

    class Engine:
        def __init__(self) -> None:
            self.asked: list[tuple[str, int]] = []

        async def answer_many(self, exchanges: Any, release: Any) -> list[Completion]:
            assert release == "cand"
            self.asked += [(e.messages[-1].text, e.sampling.max_tokens) for e in exchanges]
            return [Completion(text="yes", prompt_token_ids=[1, 2], token_ids=[3, 4], logprobs=[-0.5, -0.25]),
                    Completion(text=None, prompt_token_ids=None, token_ids=None, logprobs=None)]

    engine = Engine()
    got = asyncio.run(answers(engine, "tiny", ["a probe", "a recorded one"], "cand", 16, {"a recorded one"}, 48))
    assert got == [Answer("yes", (1, 2), (3, 4), (-0.5, -0.25)), Answer("", (), (), ())]
    assert engine.asked == [("a probe", 16), ("a recorded one", 48)]
    assert asyncio.run(answers(engine, "tiny", [], "cand", 16)) == [] and len(engine.asked) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):  # an answer kept for later checks is not changed
        got[0].text = "no"  # type: ignore[misc]


# --- the steps, each alone --------------------------------------------------------------------------------------


class _Counter:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def labels(self, outcome: str) -> Any:
        return SimpleNamespace(inc=lambda: self.seen.append(outcome))


class _Host:
    """A stand-in for the learning loop: what the steps use of it, recorded."""

    def __init__(self, engine: Any = None) -> None:
        self.events: Any = SimpleNamespace(publish=lambda kind, **data: self.published.append((kind, data)))
        self.published: list[tuple[str, dict[str, Any]]] = []
        self.metrics: Any = SimpleNamespace(heldout_checks=_Counter())
        self._engine = engine
        self.chains: Any = SimpleNamespace(ref=self._ref, head_id=self._head_id, history=self._history)
        self.start_canary = None

    async def engine(self, model: str) -> Any:
        if self._engine is None:
            raise CheckFailed("model tiny is not loaded")
        return self._engine

    async def _head_id(self, name: str) -> str:
        return "rel_head"

    async def _history(self, name: str, n: int | None = None) -> list[Any]:
        return [SimpleNamespace(release_id="rel_head", content_id="c_head")]  # the head is the first release

    async def _ref(self, scenario: Any, head: Any) -> Any:
        return SimpleNamespace(base=None, release_id="rel_head", content_id="c_head")

    async def heldout_prompts(self, st: Any) -> list[str]:
        return []

    def heldout_head(self, st: Any, key: Any, answers: Any = None) -> Any:
        return None


def _run(tmp_path: Any, **settings: Any) -> GateRun:
    from recipes.base import Candidate, GateSettings

    recipe = SimpleNamespace(kind="weights", settings=GateSettings(**settings))
    return GateRun(SimpleNamespace(recipe=recipe), SimpleNamespace(name="s", model="tiny"),  # type: ignore[arg-type]
                   SimpleNamespace(release_id="rel_head", content_id="c_head"), Candidate(path=str(tmp_path)),
                   ["r1"], "job_1", {}, {})


def test_the_gate_is_named_steps_in_order() -> None:
    assert [s.__name__ for s in STEPS] == ["skipped", "canary_verdict", "gate_kind", "drift_bound", "heldout_check",
                                           "early_warning", "canary", "publish", "rejected"]


def test_the_check_turned_off_marks_the_candidate_unchecked(tmp_path: Any) -> None:
    host, run = _Host(), _run(tmp_path, heldout_check=False)
    assert asyncio.run(steps.heldout_check(host, run)) is None
    assert run.metrics == {"heldout": "unchecked"} and host.metrics.heldout_checks.seen == ["unchecked"]


def test_a_check_that_cannot_run_fails_never_passes(tmp_path: Any) -> None:
    host, run = _Host(engine=None), _run(tmp_path)
    with pytest.raises(CheckFailed, match="could not run: model tiny is not loaded"):
        asyncio.run(steps.heldout_check(host, run))
    assert "heldout" not in run.metrics and host.metrics.heldout_checks.seen == ["failed"]
    assert host.published[0][0] == "heldout" and host.published[0][1]["verdict"] == "failed"


def test_a_published_candidates_answers_are_kept_as_the_new_heads(tmp_path: Any) -> None:
    """The check samples a head only once: the answers of a candidate that is then published are the new head's."""
    host, run = _Host(engine=object()), _run(tmp_path)
    rel = SimpleNamespace(release_id="rel_2", content_id="c_2", step=2)

    async def publish_candidate(*args: Any, **kw: Any) -> Any:
        return rel

    kept: dict[Any, Any] = {}
    host.chains.publish_candidate = publish_candidate
    host.chains.manifest = lambda *args, **kw: None
    host.follow = lambda *args, **kw: None  # type: ignore[attr-defined]
    host.heldout_head = lambda st, key, answers=None: kept.setdefault(key, answers)  # type: ignore[method-assign]
    run.heldout_answers = ((16, 48), {"Say x.": Answer("x")})
    out = asyncio.run(steps.publish(host, run))  # type: ignore[arg-type]
    assert out is not None and out.verdict == "accepted" and kept == {("c_2", 16, 48): {"Say x.": Answer("x")}}


def test_the_heads_answers_asked_during_training_are_not_asked_again(tmp_path: Any) -> None:
    """The loop asks the head's answers while the trainer trains (``prefetch_head``): the check waits for them,
    then asks the candidate alone; a prefetch that fails leaves the check to ask the head itself."""

    async def both(fail: bool) -> tuple[_Engine, GateRun]:
        engine, kept = _Engine(), {}
        host, run = _Host(engine=engine), _run(tmp_path)
        host.heldout_head = lambda st, key, answers=None: (  # type: ignore[method-assign]
            kept.__setitem__(key, answers) if answers is not None else kept.get(key))
        ref = host.chains.ref
        if fail:
            async def broken(*args: Any) -> Any:
                raise CheckFailed("the head's files are gone")
            host.chains.ref = broken
        prefetch = asyncio.ensure_future(steps.prefetch_head(host, run.st, run.scenario, run.head))
        trained = asyncio.get_running_loop().create_future()  # the prefetch is the check's only once training ends

        async def after_training() -> float:
            await trained
            return await prefetch  # it never raises

        run.st.heldout_prefetch = asyncio.ensure_future(after_training())
        checking = asyncio.ensure_future(steps.heldout_check(host, run))
        for _ in range(50):
            await asyncio.sleep(0)
        assert prefetch.done() and not checking.done()  # the check waits for it
        assert all(r.release_id == "rel_head" for r, _ in engine.asked)
        host.chains.ref = ref
        trained.set_result(None)
        assert await checking is None
        return engine, run

    engine, run = asyncio.run(both(fail=False))
    head = [p for r, p in engine.asked if r.release_id == "rel_head"]
    assert sorted(head) == sorted(p.prompt for p in shipped_probes())  # every probe, asked during training
    assert run.metrics["heldout_head_sampled"] == 0 and "heldout_prefetch_seconds" in run.metrics
    engine, run = asyncio.run(both(fail=True))
    assert run.metrics["heldout_head_sampled"] == run.metrics["heldout_probes"] > 0  # the check asked the head


def _lineage_host(engine: Any) -> tuple[Any, dict[Any, Any]]:
    """A stand-in host whose chain is the head (``rel_head``) over its first release (``rel_0``), that holds
    candidates, and keeps answer sets in the dict it returns."""
    host, kept = _Host(engine=engine), {}
    rels = [SimpleNamespace(release_id="rel_head", content_id="c_head"),
            SimpleNamespace(release_id="rel_0", content_id="c_0")]

    async def history(name: str, n: int | None = None) -> list[Any]:
        return rels

    async def ref(scenario: Any, rel: Any) -> Any:
        return SimpleNamespace(base=None, release_id=rel.release_id, content_id=rel.content_id)

    async def hold(*args: Any, **kw: Any) -> Any:
        return SimpleNamespace(release_id="rel_held", step=1)

    host.chains.history, host.chains.ref, host.chains.hold = history, ref, hold
    host.chains.manifest = lambda *args, **kw: None
    host.follow = lambda *args, **kw: None  # type: ignore[attr-defined]
    host.heldout_head = lambda st, key, answers=None: (  # type: ignore[method-assign]
        kept.__setitem__(key, answers) if answers is not None else kept.get(key))
    return host, kept


def test_a_lineage_is_compared_with_the_chains_first_release_through_the_step(tmp_path: Any) -> None:
    """Through ``prefetch_head`` and ``heldout_check`` with the probes of ``PROBES``: the first release's answers are
    asked during training with the head's, kept, and not asked again by the check; a candidate within its head's
    noise that forgot what the first release knew is held. Bug caught: the step not handing the first release to
    the check (or not asking it during training: the check would then ask it, and cost its time)."""

    class Releases(_Lineage):
        async def generate(self, exchange: Any, release: Any) -> Any:
            who = {"rel_head": "head", "rel_0": "first"}.get(release.release_id, "cand")
            async for out in super().generate(exchange, who):
                yield out

    async def go() -> tuple[Releases, GateRun, Any]:
        engine = Releases({0, 2, 4}, {0, 2, 4, 6, 8, 10})
        host, kept = _lineage_host(engine)
        run = _run(tmp_path, heldout_probes=[{"prompt": p.prompt, "accept": list(p.accept)} for p in PROBES])
        run.st.recipe = run.recipe
        run.scenario.warning = {"state": "accepted"}  # the early warning, read after a hold, is not this test's
        await steps.prefetch_head(host, run.st, run.scenario, run.head)
        during = list(engine.asked)
        out = await steps.heldout_check(host, run)
        return engine, run, (during, out, kept)

    # without the prefetch (it failed, or the daemon restarted): the check asks the first release, and keeps it
    async def unprefetched() -> list[str]:
        engine = Releases({0, 2, 4}, {0, 2, 4, 6, 8, 10})
        (host, _), firsts_asked = _lineage_host(engine), []
        st = None
        for _ in range(2):
            run = _run(tmp_path, heldout_probes=[{"prompt": p.prompt, "accept": list(p.accept)} for p in PROBES])
            if st is not None:
                run.st = st
            st = run.st
            run.scenario.warning = {"state": "accepted"}
            before = len(engine.asked)
            await steps.heldout_check(host, run)
            firsts_asked.append(sum(1 for who, _ in engine.asked[before:] if who == "first"))
        return firsts_asked

    assert asyncio.run(unprefetched()) == [len(PROBES), 0]
    engine, run, (during, out, kept) = asyncio.run(go())
    assert sorted(p for who, p in during if who == "first") == sorted(p.prompt for p in PROBES)
    assert not [p for who, p in engine.asked[len(during):] if who in ("first", "head")]  # all kept from training
    assert ("c_0", 16, 48) in kept and len(kept[("c_0", 16, 48)]) == len(PROBES)
    assert out is not None and out.verdict == "pending", out
    assert "forgets what the base knew" in run.metrics["heldout_reason"]
    assert run.metrics["heldout_probes_lost_base"] == 6 and run.metrics["heldout_probes_lost"] == 3


# --- through a daemon -------------------------------------------------------------------------------------------


def test_a_candidate_that_answers_nothing_is_held_and_never_serves_even_after_a_restart(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    d = _crafted(daemon_factory, recipe_dir)
    with d.http() as c:
        # the tiny model's greedy answers open with some 20 newlines (empty within the default 16 tokens): at 32 its
        # head says something, so there is an answer for the silent candidate to stop giving
        made = c.post("/reef/scenarios", json={"name": "silent", "recipe": "crafted:Crafted",
                                               "settings": {"heldout_max_tokens": 32}})
        assert made.status_code == 201, made.text
        _report(c, "silent")
        held = wait_for(lambda: releases(c, "silent", True)["pending"], what="the silent candidate held")[0]
        m = held["metrics"]
        assert m["heldout"] == "held" and m["heldout_empty"] == 1.0 and m["heldout_head_empty"] < 0.5, m
        assert "stops answering" in m["heldout_reason"] and "too little traffic" in m["heldout_note"]
        assert m["heldout_probes"] == len(shipped_probes()) and m["heldout_kl"] > 0
        head = releases(c, "silent")["releases"][0]
        assert head["operation"] == "init"
        event = events_of(c, "silent", "heldout", 1)[0]
        assert event["verdict"] == "held" and event["release_id"] == held["release_id"]
        assert 'reef_heldout_checks_total{outcome="held"} 1.0' in c.get("/metrics").text
        assert _candidates_loaded(c) == []  # the check's load is dropped once it has decided (the daemon's memory)
    listed = d.cli("releases", "list", "-s", "silent", "--all").stdout
    assert held["release_id"][:12] in listed and "pending" in listed and "held-out" in listed
    shown = " ".join(d.cli("releases", "show", held["release_id"]).stdout.split())
    assert "held-out check: held" in shown and "stops answering" in shown
    d.stop()
    d.start().wait_loaded()
    with d.http() as c:
        after = releases(c, "silent", True)
        assert after["releases"][0]["release_id"] == head["release_id"]
        assert [p["release_id"] for p in after["pending"]] == [held["release_id"]]
        served = c.post("/s/silent/v1/chat/completions", json=ASK)
        assert served.headers["x-reef-release-id"] == head["release_id"]


def test_a_candidate_that_keeps_answering_is_served_and_the_check_off_says_unchecked(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    d = _crafted(daemon_factory, recipe_dir)
    with d.http() as c:
        for name, settings in (("talks", {"silent": False}), ("unguarded", {"heldout_check": False}),
                               ("turned-away", {"silent": False, "gate": "floor", "floor": 1.0, "score": 0.0})):
            made = c.post("/reef/scenarios", json={"name": name, "recipe": "crafted:Crafted", "settings": settings})
            assert made.status_code == 201, made.text
            _report(c, name)
        talks = wait_for(lambda: (r := releases(c, "talks"))["releases"][0]["operation"] == "train" and r,
                         what="the candidate that answers published")["releases"][0]["metrics"]
        assert talks["heldout"] == "passed" and talks["heldout_empty"] == talks["heldout_head_empty"], talks
        away = wait_for(lambda: releases(c, "turned-away", True)["rejected"], what="the rejected step")[0]
        assert away["verdict"] == "rejected" and "floor" in away["reason"], away
        # neither the passed candidate's check load nor the rejected one (the gate turns it away before any check)
        # stays in the daemon: what it serves is loaded under the release's own content id
        assert _candidates_loaded(c) == []
        assert talks["heldout_probe_accuracy"] >= talks["heldout_head_probe_accuracy"] - 0.1
        # turned off: even the silent candidate is published, and the release says it was never checked
        unguarded = wait_for(lambda: (r := releases(c, "unguarded"))["releases"][0]["operation"] == "train" and r,
                             what="the unchecked candidate published")["releases"][0]["metrics"]
        assert unguarded["heldout"] == "unchecked" and "heldout_empty" not in unguarded
        assert releases(c, "unguarded", True)["pending"] == []


def test_an_online_rl_step_that_learned_is_checked_and_served(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory(settings_toml())
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "learn", "recipe": "online-rl"}).status_code == 201
        serve_and_report(c, "learn", 4)
        head = wait_for(lambda: (r := releases(c, "learn"))["releases"][0]["operation"] == "train" and r,
                        what="a train release")["releases"][0]
        assert head["metrics"]["heldout"] == "passed" and head["metrics"]["heldout_kl"] >= 0, head["metrics"]
        # the head's answers were asked while the trainer trained: the check asked the candidate alone
        assert head["metrics"]["heldout_head_sampled"] == 0 and "heldout_prefetch_seconds" in head["metrics"]


def test_a_check_that_cannot_run_fails_the_step_with_the_reason(daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    d = _crafted(daemon_factory, recipe_dir)
    with d.http() as c:
        made = c.post("/reef/scenarios", json={"name": "slow", "recipe": "crafted:Crafted",
                                               "settings": {"silent": False, "heldout_timeout_s": 0.001}})
        assert made.status_code == 201, made.text
        _report(c, "slow")
        failed = wait_for(lambda: releases(c, "slow", True)["rejected"], what="the failed step")[0]
        assert failed["verdict"] == "failed" and "the held-out check could not run" in failed["reason"], failed
        assert "heldout_timeout_s" in failed["reason"]
        assert releases(c, "slow")["releases"][0]["operation"] == "init"


def test_malformed_held_out_settings_are_refused_naming_them(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory()
    with d.http() as c:
        for bad, param in (({"heldout_probes": [{"prompt": "x"}] * 8}, "settings.heldout_probes"),
                           ({"heldout_probes": [{"prompt": "x", "accept": ["y"]}]}, "settings.heldout_probes"),
                           ({"heldout_max_degenerate": 2}, "settings.heldout_max_degenerate"),
                           ({"heldout_share": -0.1}, "settings.heldout_share"),
                           ({"heldout_max_kl": 0}, "settings.heldout_max_kl"),
                           ({"heldout_recorded_tokens": 2}, "settings.heldout_recorded_tokens"),
                           ({"heldout_recorded_tokens": 1000}, "settings.heldout_recorded_tokens")):
            r = c.post("/reef/scenarios", json={"name": "bad", "recipe": "online-rl", "settings": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        ok = [{"prompt": f"Say {w}.", "accept": [w]} for w in "abcdefgh"]
        assert c.post("/reef/scenarios", json={"name": "own", "recipe": "online-rl",
                                                "settings": {"heldout_probes": ok}}).status_code == 201


def test_reserved_recorded_prompts_are_asked_by_the_check_and_never_trained_on(
        daemon_factory: Any, recipe_dir: Any) -> None:  # noqa: F811
    d = _crafted(daemon_factory, recipe_dir)
    with d.http() as c:
        made = c.post("/reef/scenarios", json={"name": "kept", "recipe": "crafted:Crafted",
                                               "settings": {"silent": False, "heldout_share": 0.5}})
        assert made.status_code == 201, made.text
        receipts = []
        for i in range(16):
            ask = {**ASK, "messages": [{"role": "user", "content": f"Tell me about item {i}."}]}
            rec = c.post("/s/kept/v1/chat/completions", json=ask).headers["x-reef-agent-record-id"]
            assert c.post("/reef/report", json={"references": [rec], "score": 1.0}).status_code == 201
            receipts.append(rec)
        def settled() -> tuple[int, int] | None:
            chain = releases(c, "kept", True)
            trained = {r for rel in chain["releases"] for r in rel.get("receipts", [])}
            trained |= {r for rej in chain["rejected"] for r in rej.get("receipts", [])}
            recorded = chain["releases"][0]["metrics"].get("heldout_recorded", 0)
            return (len(trained), recorded) if len(trained) + recorded >= 14 else None

        trained, recorded = wait_for(settled, what="the batches trained and the rest reserved")
        assert recorded >= 1 and trained + recorded <= 16, (trained, recorded)


def test_a_recipe_whose_settings_lack_the_gates_says_why_it_cannot_turn_the_check_off() -> None:
    """A user's weights recipe whose Settings do not extend GateSettings: its candidates meet the check at the
    defaults, and asking to turn it off is refused saying why and how (not "unknown setting", not taken)."""
    from dataclasses import dataclass

    from recipes.base import Recipe

    @dataclass
    class Own:
        steps: int = 1

    class Mine(Recipe):
        name, kind, Settings = "mine", "weights", Own

    with pytest.raises(BadRequest) as e:
        Mine.parse_settings({"heldout_check": False})
    assert e.value.data["param"] == "settings.heldout_check" and "extend GateSettings" in e.value.message
    with pytest.raises(BadRequest, match="unknown settings for recipe mine: nope"):
        Mine.parse_settings({"nope": 1})
    assert Mine.parse_settings({"steps": 2}).steps == 2
