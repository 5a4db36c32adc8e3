"""What a wrapper's runs keep (``reef_cli/runs.py``) and what ``reef-pi report`` sends (``reef_cli/wrapper_cmd.py``):
every receipt of a run, read page by page, and a report on every one of them.

Why a file of its own (issue 42): both bugs below survived two outside audits, the second time after a test was
said to catch them. It does: ``test_cli_exits.py``'s long run (60 requests through a spawned ``reef-pi``) fails on
both, checked again. But it sits in a file named for exit codes, and the wrappers' own tests (``test_agents.py``)
read one receipt of a reported run by its id (never its score, never the others) and never make a second page of
records: a run of the tests named for the wrappers passes with either bug in. These tests are named for them, run
in-process, and take well under a second each past the daemon's start.

- ``run_receipts``: 51 records served as a page of 50 and a page of 1 come back as all 51, in order, against a
  stand-in for the records route that pages exactly as ``daemon/app.py``'s ``_list_records`` does (``limit``
  at most 1000, ``next_after`` the last record's ``seq`` on any page that is not empty).
- ``reef-pi report``, run in-process against a real daemon: a run of three exchanges gets the report on all three
  (the receipts the run kept), and again when the run kept none and the receipts are asked of the daemon.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from adapters import ADAPTERS
from daemon.errors import NotFound
from reef_cli.runs import RECEIPTS_PAGE, failed_requests, run_receipts, save_run
from tests.conftest import Daemon

PI = ADAPTERS["pi"]


def served_like_the_daemon(records: list[dict[str, Any]], asked: list[str]) -> Any:
    """A ``get(path)`` answering ``/reef/records?...&limit=N&after=SEQ`` from ``records`` the way the daemon's
    route does; a client that keeps asking past a hundred pages is looping (a cursor that never moves)."""

    def get(path: str) -> dict[str, Any]:
        asked.append(path)
        assert len(asked) <= 100, f"asked {len(asked)} pages: the cursor does not move ({path})"
        q = {k: v[0] for k, v in parse_qs(urlsplit(path).query).items()}
        assert q["kind"] == "exchange" and q["run"] == "run_x", q
        limit = int(q.get("limit", 50))
        assert 1 <= limit <= 1000, limit  # the daemon answers 400 outside this
        after = int(q["after"]) if "after" in q else None
        page = [r for r in records if after is None or r["seq"] > after][:limit]
        return {"records": page, "next_after": page[-1]["seq"] if page else None}

    return get


@pytest.mark.parametrize("n", [51, 50, 101, 1, 0])
def test_run_receipts_reads_every_page_51_records_as_50_and_1(n: int) -> None:
    records = [{"id": f"rec_{i:03d}", "seq": 10 + 3 * i} for i in range(n)]  # seqs need not be dense
    asked: list[str] = []
    assert run_receipts(served_like_the_daemon(records, asked), "run_x") == [r["id"] for r in records]
    if n == 51:  # the case the audit names: the daemon's page of 50, then the one left
        assert RECEIPTS_PAGE == 50 and len(asked) == 2, asked


def test_a_run_with_failed_requests_says_the_last_reason() -> None:
    """The receipts of failed exchanges (status ``error``) across pages, in order; the wrapper's line gives the
    last one's recorded reason, or says its record could not be read. Bugs caught: only the first page's failures,
    the first failure's reason instead of the last's, a complete exchange counted as failed."""
    records = [{"id": f"rec_{i:03d}", "seq": i, "status": "error" if i in (3, 55) else "complete"} for i in range(60)]
    failed: list[str] = []
    assert len(run_receipts(served_like_the_daemon(records, []), "run_x", failed)) == 60
    assert failed == ["rec_003", "rec_055"]
    reasons = {"rec_003": "first", "rec_055": "The model `x` does not exist. (upstream 'u': HTTP 404)"}

    def get(path: str) -> dict[str, Any]:
        rid = path.rsplit("/", 1)[-1]
        if rid not in reasons:
            raise NotFound(f"no record {rid}")
        return {"id": rid, "status": "error", "response": {"error": {"message": reasons[rid]}}}

    assert failed_requests(get, failed, 60) == ("2 of the run's 60 model requests failed; the last: The model `x` "
                                                "does not exist. (upstream 'u': HTTP 404) (reef records show rec_055)")
    assert "its record could not be read (no record rec_009)" in failed_requests(get, ["rec_009"], 1)
    assert failed_requests(get, ["rec_003"], 1).startswith("1 of the run's 1 model request failed; the last: first")


def one_run(c: httpx.Client, scenario: str, exchanges: int) -> tuple[str, list[str]]:
    """A run as a wrapper starts it (``POST /reef/runs``) with ``exchanges`` model requests; its receipts."""
    run = c.post("/reef/runs", json={"adapter": "pi", "scenario": scenario}).json()["run"]
    receipts = []
    for i in range(exchanges):
        r = c.post(f"/s/{scenario}/r/{run}/v1/chat/completions",
                   json={"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": f"hi {i}"}]})
        assert r.status_code == 200, r.text
        receipts.append(r.headers["x-reef-agent-record-id"])
    return run, receipts


def reef_pi(*args: str) -> None:
    """``reef-pi ARGS`` in this process (what the wrapper's entry point runs for a subcommand)."""
    from reef_cli.wrapper_cmd import subcommands

    subcommands(PI)(args=list(args), prog_name="reef-pi", standalone_mode=False)


def test_reef_pi_report_goes_on_every_receipt_of_the_run(daemon: Daemon, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("REEF_HOME", str(daemon.home))
    monkeypatch.delenv("REEF_URL", raising=False)
    from daemon.config import load_config

    cfg = load_config()
    with daemon.unix() as c:
        run, receipts = one_run(c, "wrapper-runs", 3)
        other_run, other = one_run(c, "wrapper-runs", 1)  # another run of the scenario: never reported here
    record = {"run": run, "adapter": "pi", "scenario": "wrapper-runs", "release_id": None, "model": "tiny",
              "argv": [], "prompt": "", "cwd": "/", "started_at": 1.0, "ended_at": 2.0, "exit_code": 0,
              "receipts": receipts, "reports": []}
    save_run(cfg, record)

    def scores() -> dict[str, Any]:
        with daemon.unix() as c:
            got = c.get("/reef/records", params={"scenario": "wrapper-runs", "kind": "exchange"}).json()["records"]
        return {r["id"]: r.get("score") for r in got}

    reef_pi("report", "--score", "0.25", "--run", run)
    assert f"on 3 receipt(s) of run {run}" in capsys.readouterr().out
    assert scores() == {**dict.fromkeys(receipts, 0.25), other[0]: None}

    # the run kept no receipts (the daemon was away when it ended): they are asked of the daemon, all of them
    path = cfg.runs_dir / f"{run}.json"
    path.write_text(json.dumps({**record, "receipts": []}))
    reef_pi("report", "--score", "0.75", "--run", run)
    assert f"on 3 receipt(s) of run {run}" in capsys.readouterr().out
    assert scores() == {**dict.fromkeys(receipts, 0.75), other[0]: None}
    assert json.loads(path.read_text())["receipts"] == receipts  # and kept for the next report
    assert other_run != run
