"""``lessons`` on the real model (issue 48): with SmolLM2 served and no stand-in anywhere, one written feedback
becomes a rule that moves the model's answers on prompts it was not given, in the asked direction, and the rule's
release passes the held-out check of its rules (``daemon/gating/steps.py``). The figures over seeds and feedback kinds
are ``bench/harness_real.py``'s (docs/learning.md); this is the check that the loop does it at all."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.conftest import Daemon

PROMPTS = ("Tell me about volcanoes.", "How do bees make honey?", "Describe the Roman Empire.",
           "What are bridges used for?")


def answers(c: Any, rules: str, max_tokens: int = 60) -> list[str]:
    def one(prompt: str) -> str:
        r = c.post("/v1/chat/completions", headers={"x-reef-scenario": "brief"}, json={
            "model": "smollm2", "max_tokens": max_tokens, "temperature": 0,
            "messages": [*([{"role": "system", "content": rules}] if rules else []),  # as an agent sends it
                         {"role": "user", "content": prompt}]})
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, PROMPTS))


def words(texts: list[str]) -> float:
    return sum(len(re.findall(r"\w+", t)) for t in texts) / len(texts)


def test_a_lesson_on_the_real_model_shortens_its_answers_and_passes_its_held_out_check(
        daemon_factory: Any, smollm2_model: Path) -> None:
    d: Daemon = daemon_factory(f'\n[models.smollm2]\nengine = "transformers"\npath = "{smollm2_model}"\n')
    d.wait_loaded("tiny")
    with d.http() as c:
        made = c.post("/reef/scenarios", json={"name": "brief", "recipe": "lessons", "model": "smollm2"})
        assert made.status_code == 201, made.text
        rules_before = c.get("/reef/scenarios/brief/harness").json()["files"].get("AGENTS.md", "")
        before = answers(c, rules_before)
        out = c.post("/reef/scenarios/brief/evolve", json={"instruction": "Answer in one sentence."}).json()
        assert out["verdict"] == "accepted", out
        m = out["metrics"]
        assert m["heldout"] == "passed" and m["heldout_probes"] >= 18 and "a harness candidate" in m["heldout_note"]
        assert m["heldout_probe_accuracy"] >= m["heldout_head_probe_accuracy"] - 0.2  # what it knew, within noise
        rules_after = c.get("/reef/scenarios/brief/harness").json()["files"]["AGENTS.md"]
        assert "Answer in one sentence." in rules_after and rules_after != rules_before
        after = answers(c, rules_after)
    # the asked direction: measured 54-63 words -> 22-29 (bench/harness_real.py, 16 prompts x 3 seeds); here
    # the four answers' mean must fall by a quarter at least, and none may be empty
    assert words(after) < 0.75 * words(before), (before, after)
    assert all(re.search(r"\w", a) for a in after), after
