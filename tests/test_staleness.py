"""``max_staleness`` through a real daemon: a scored record served by a release more than ``max_staleness`` steps
behind the head is never trained on; one exactly ``max_staleness`` behind, or served by the head, is."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import Daemon
from tests.test_learning import releases, settings_toml, wait_for


def serve(c: httpx.Client, scenario: str, release: str, n: int) -> list[str]:
    """``n`` answers pinned to ``release``; their receipts."""
    out = []
    for i in range(n):
        r = c.post(f"/s/{scenario}/v1/chat/completions", headers={"x-reef-release-id": release}, json={
            "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": f'Say "w{i}".'}]})
        assert r.status_code == 200 and r.headers["x-reef-release-id"] == release, r.text
        out.append(r.headers["x-reef-agent-record-id"])
    return out


def test_records_served_too_far_behind_the_head_are_not_trained_on(daemon_factory: Any) -> None:
    # one batch is 2 x 2 = 4 scored records; records served up to 1 release behind the head are eligible
    d: Daemon = daemon_factory(settings_toml(max_staleness=1))
    with d.http() as c:
        created = c.post("/reef/scenarios", json={"name": "stale", "recipe": "online-rl"})
        assert created.status_code == 201, created.text
        chain = [created.json()["head"]]  # step 0
        for _ in range(2):  # steps 1 and 2: the head moves on (a rollback publishes a new release)
            moved = c.post("/reef/scenarios/stale/rollback", json={"release_id": chain[0], "expected_head": chain[-1]})
            assert moved.status_code == 201, moved.text
            chain.append(moved.json()["release_id"])
        assert [r["step"] for r in releases(c, "stale")["releases"]] == [2, 1, 0]
        too_stale = serve(c, "stale", chain[0], 2)  # 2 behind the head: out
        at_bound = serve(c, "stale", chain[1], 2)  # exactly 1 behind: in
        at_head = serve(c, "stale", chain[2], 2)  # in
        later = serve(c, "stale", chain[2], 2)  # in, but reported last
        # reported oldest first: a loop that ignored the bound would take the too-stale ones first, one that
        # excluded the bound itself would skip to the later ones
        # (scores alternate between the sets, so any two of them make groups of the same prompt that carry signal)
        for score, receipts in ((0.0, too_stale), (1.0, at_bound), (0.0, at_head), (1.0, later)):
            for receipt in receipts:
                assert c.post("/reef/report", json={"score": score, "references": [receipt]}).status_code == 201
        wait_for(lambda: releases(c, "stale")["releases"][0]["operation"] == "train", what="a train release")
        trained = next(r for r in releases(c, "stale")["releases"] if r["step"] == 3)  # the first training step
        assert sorted(trained["receipts"]) == sorted(at_bound + at_head), {
            "too_stale": too_stale, "at_bound": at_bound, "at_head": at_head, "later": later,
            "trained": trained["receipts"]}
        assert trained["operation"] == "train" and trained["parent"] == chain[2]
