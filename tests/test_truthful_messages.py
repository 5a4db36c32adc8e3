"""Messages that tell the truth (issue 44): the model that answered is the one an answer names; scores outside
their scenario's range and ``nan`` are refused saying so; ``reef releases list`` without ``-s`` finds the
scenario or lists them; a harness release's reports are not called receipts, and counted as they are; a forgotten
receipt says so; durations read as durations; a live stream is ``in progress``; tokens a provider did not count are
unknown, not 0."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ROOT, Daemon, assert_canonical_error, free_port, sse_events


def chat(c: httpx.Client, scenario: str, text: str = "hi", **extra: Any) -> httpx.Response:
    r = c.post(f"/s/{scenario}/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": text}], **extra})
    assert r.status_code == 200, r.text
    return r


# --- the model that answered --------------------------------------------------------------------------------


def test_a_request_naming_a_model_not_served_is_answered_with_the_model_that_answered(daemon: Daemon) -> None:
    """``"model": "gpt-9"`` is answered by the scenario's model (tiny): every format's answer and a stream's chunks
    name tiny, and ``x-reef-model`` says so; the record keeps the request as it came."""
    with daemon.http() as c:
        r = chat(c, "echo", model="gpt-9")
        assert r.json()["model"] == "tiny" and r.headers["x-reef-model"] == "tiny"
        got = c.get(f"/reef/records/{r.headers['x-reef-agent-record-id']}").json()
        assert got["request"]["model"] == "gpt-9" and got["model"] == "tiny"
        s = c.post("/s/echo/v1/chat/completions", json={"model": "gpt-9", "max_tokens": 2, "stream": True,
                                                         "messages": [{"role": "user", "content": "hi"}]})
        chunks = [d for _, d in sse_events(s.text) if isinstance(d, dict) and "model" in d]
        assert chunks and {d["model"] for d in chunks} == {"tiny"} and s.headers["x-reef-model"] == "tiny"
        a = c.post("/s/echo/v1/messages", json={"model": "claude-sonnet-9", "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "hi"}]})
        assert a.json()["model"] == "tiny" and a.headers["x-reef-model"] == "tiny"
        o = c.post("/s/echo/v1/responses", json={"model": "gpt-9", "max_output_tokens": 2, "input": "hi"})
        assert o.json()["model"] == "tiny" and o.headers["x-reef-model"] == "tiny"
        same = chat(c, "echo", model="tiny")  # the served name asked for: the same answer
        assert same.json()["model"] == "tiny"


# --- scores -------------------------------------------------------------------------------------------------


def test_scores_outside_the_scenario_range_are_refused_naming_it(daemon_factory: Any, tmp_path: Path) -> None:
    d: Daemon = daemon_factory('\n[score_ranges]\nwide = [0, 10]\n')
    with d.http() as c:
        rec = chat(c, "narrow").headers["x-reef-agent-record-id"]
        wide = chat(c, "wide").headers["x-reef-agent-record-id"]
        for bad in (7, -3, 1.0001):
            err = assert_canonical_error(c.post("/reef/report", json={"references": [rec], "score": bad}), 400)
            assert err["param"] == "score" and "[0, 1]" in err["message"] and "score_range" in err["message"], err
        for good in (0, 1, 0.5):
            assert c.post("/reef/report", json={"references": [rec], "score": good}).status_code == 201
        assert c.post("/reef/report", json={"references": [wide], "score": 7}).status_code == 201
        err = assert_canonical_error(c.post("/reef/report", json={"references": [wide], "score": 11}), 400)
        assert "[0, 10]" in err["message"] and "score_ranges.wide" in err["message"], err
        assert [r["report"]["score"] for r in c.get(f"/reef/records/{rec}").json()["reports"]] == [0, 1, 0.5]
        # an import is held to the same range, naming the item and field
        line = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}
        r = c.post("/reef/records/import", json={"items": [{**line, "score": 7}], "scenario": "narrow"})
        assert assert_canonical_error(r, 400)["param"] == "items[0].score"
        r = c.post("/reef/records/import", json={"items": [{**line, "reports": [{"score": 0.5}, {"score": 9}]}],
                                                 "scenario": "narrow"})
        assert assert_canonical_error(r, 400)["param"] == "items[0].reports[1].score"
        assert c.post("/reef/records/import", json={"items": [{**line, "score": 9}], "scenario": "wide"}
                      ).status_code == 201
        # NaN in a body: "not a number", not a complaint about JSON alone
        raw = json.dumps({"references": [rec], "score": 0.5}).replace("0.5", "NaN")
        err = assert_canonical_error(c.post("/reef/report", content=raw,
                                            headers={"Content-Type": "application/json"}), 400)
        assert "not a number" in err["message"], err
    cli = d.cli("report", rec, "--score", "7", check=False)
    assert cli.returncode == 2 and "outside scenario 'narrow''s range [0, 1]" in cli.stderr, cli.stderr
    cli = d.cli("report", rec, "--score", "nan", check=False)
    assert cli.returncode == 2 and "--score nan is not a number" in cli.stderr, cli.stderr


def test_a_score_range_is_two_finite_numbers_in_order(tmp_path: Path) -> None:
    from daemon.config import load_config
    from daemon.errors import BadRequest

    for bad in ("[1, 0]", "[0]", '"0-1"', "[0, nan]"):
        (tmp_path / "config.toml").write_text(f"score_range = {bad}\n")
        with pytest.raises(BadRequest) as e:
            load_config({"REEF_HOME": str(tmp_path)})
        assert "score_range" in e.value.message, bad
    (tmp_path / "config.toml").write_text("score_range = [-1, 1]\n")
    assert load_config({"REEF_HOME": str(tmp_path)}).score_range == (-1.0, 1.0)


# --- which scenario -----------------------------------------------------------------------------------------


def test_releases_list_without_a_scenario_picks_the_only_one_or_lists_them(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory()
    none = d.cli("releases", "list", check=False)
    assert none.returncode == 2 and "no scenarios yet" in none.stderr, none.stderr
    with d.http() as c:
        chat(c, "pi")
    one = d.cli("releases", "list")
    assert "scenario pi, the only one" in one.stderr and "scenario pi" in one.stdout, (one.stdout, one.stderr)
    with d.http() as c:
        chat(c, "claude")
    two = d.cli("releases", "list", check=False)
    assert two.returncode == 2 and "give -s NAME, one of claude, pi" in two.stderr, two.stderr
    assert "Traceback" not in two.stderr
    with d.http() as c:
        chat(c, "default")
    assert "scenario default" in d.cli("releases", "list").stdout


# --- what a harness release consumed ------------------------------------------------------------------------


def test_a_harness_release_lists_reports_as_reports_counted_right(daemon: Daemon) -> None:
    """A lessons release learns from one report on two receipts: ``reef releases show`` lists the report under
    ``reports`` (not ``receipts``), and its page says "1 report on 2 receipts" (it said "1 receipt(s)")."""
    with daemon.http() as c:
        assert c.post("/reef/scenarios", json={"name": "les", "recipe": "lessons"}).status_code == 201
        refs = [chat(c, "les", f"q{i}").headers["x-reef-agent-record-id"] for i in range(2)]
        rep = c.post("/reef/report", json={"references": refs, "score": 0,
                                           "feedback": "Always run the tests before you answer."})
        assert rep.status_code == 201, rep.text
        head = c.get("/reef/scenarios/les/releases").json()["head"]
        rel = c.get(f"/reef/releases/{head}").json()
        assert rel["receipts"] == [rep.json()["report_id"]], rel
        page = c.get(f"/reef/releases/{head}/page").text
    assert "It consumed 1 report on 2 receipts." in page and "receipt(s)" not in page, page[:2000]
    shown = daemon.cli("releases", "show", head).stdout
    assert f"reports 1: {rep.json()['report_id']}" in shown and "receipts 1" not in shown, shown


def test_consumed_counts_each_kind_without_an_s_in_brackets() -> None:
    from daemon.release_page import consumed, plural

    assert plural(1, "report") == "1 report" and plural(2, "receipt") == "2 receipts" and plural(0, "x") == "0 xs"
    assert consumed(["rec_a", "rec_b"], []) == "2 exchanges"
    assert consumed(["rep_a"], [{"kind": "report", "report": {"references": ["rec_1", "rec_2", "rec_1"]}}]) == \
        "1 report on 2 receipts"


# --- forgotten, timings, install text -----------------------------------------------------------------------


def test_records_show_of_a_forgotten_receipt_says_it_was_forgotten(daemon: Daemon) -> None:
    with daemon.http() as c:
        rec = chat(c, "forget-me").headers["x-reef-agent-record-id"]
        kept = chat(c, "forget-me").headers["x-reef-agent-record-id"]
    daemon.cli("records", "forget", rec, "--yes")
    shown = daemon.cli("records", "show", rec).stdout
    assert "forgotten" in shown and "were deleted" in shown and "content_hash" in shown, shown
    assert "forgotten" not in daemon.cli("records", "show", kept).stdout


def test_durations_read_as_durations_not_in_exponent_form() -> None:
    from reef_cli.tui.format import duration, number

    assert duration(18400) == "5 h 6 min" and duration(18.4) == "18.4 s" and duration(0.25) == "250 ms"
    assert duration(307) == "5 min 7 s" and duration(None) == "-"
    assert number(18400.0) == "18400" and number(0.123456) == "0.123" and "e+" not in number(1.84e4)


def test_the_tui_record_screen_shows_timings_as_durations() -> None:
    """The record screen's timings line, as the screen builds it (``RecordScreen``'s own code path)."""
    source = (ROOT / "reef_cli" / "tui" / "screens.py").read_text()
    line = next(x for x in source.splitlines() if 'head.add_row("timings"' in x)
    assert "duration(" in line and "number(" not in line, line


def test_install_says_the_model_conversion_takes_a_minute_or_two() -> None:
    text = (ROOT / "install.sh").read_text()
    said = [x for x in text.splitlines() if "making the default model" in x]
    assert said and all("a minute or two" in x and "20 s" not in x for x in said), said
    assert "about 20 s" not in text


# --- in progress and unknown usage --------------------------------------------------------------------------


def test_a_live_stream_reads_in_progress_and_one_cut_before_a_restart_incomplete(daemon_factory: Any) -> None:
    """A record opened by this daemon process and not completed is a stream still being answered
    (``in_progress``); one opened before the daemon started (a crash or stop cut it) stays ``incomplete``."""
    from daemon.config import load_config
    from daemon.records import ExchangeRecord, open_store

    d: Daemon = daemon_factory(start=False)

    async def opened(rid: str) -> None:
        store = open_store(load_config(d.env).records_location)
        try:
            await store.exchanges.open(ExchangeRecord(id=rid, scenario="live", request={}, format="openai-chat",
                                                     engine="transformers", model="tiny"))
        finally:
            store.close()

    asyncio.run(opened("rec_cut"))
    d.start()
    asyncio.run(opened("rec_live"))  # opened while this daemon runs: as its serve path opens a stream
    with d.http() as c:
        assert c.get("/reef/records/rec_cut").json()["status"] == "incomplete"
        assert c.get("/reef/records/rec_live").json()["status"] == "in_progress"
        listed = {r["id"]: r["status"] for r in c.get("/reef/records", params={"scenario": "live"}).json()["records"]}
        assert listed == {"rec_cut": "incomplete", "rec_live": "in_progress"}
        done = chat(c, "live").headers["x-reef-agent-record-id"]
        assert c.get(f"/reef/records/{done}").json()["status"] == "complete"
    out = d.cli("records", "list", "-s", "live").stdout
    assert "in progress" in out and "incomplete" in out, out


@pytest.fixture
def stub() -> Any:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "upstream_stub.py"), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=2) as http:
        while True:
            try:
                if http.get(url + "/_stub/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None, "stub exited"
                time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


def test_a_stream_from_a_provider_that_sent_no_usage_stores_unknown_tokens(daemon_factory: Any, stub: str) -> None:
    extra = (f'\n[models.stub]\nengine = "upstream"\nurl = "{stub}/v1"\nformat = "openai-chat"\n'
             'upstream_model = "m"\napi_key_env = "STUB_API_KEY"\n')
    d: Daemon = daemon_factory(extra, start=False)
    d.env["STUB_API_KEY"] = "k" * 24
    d.start()
    with d.http() as c:
        assert c.post("/reef/scenarios", json={"name": "prov", "model": "stub"}).status_code == 201
        ids = {}
        for name, text in (("bare", "hi [stub:no_usage]"), ("counted", "hi")):
            s = c.post("/s/prov/v1/chat/completions", json={"model": "x", "stream": True, "messages": [
                {"role": "user", "content": text}]})
            assert s.status_code == 200, s.text
            ids[name] = s.headers["x-reef-agent-record-id"]
        bare = c.get(f"/reef/records/{ids['bare']}").json()["usage"]
        assert bare["input_tokens"] is None and bare["output_tokens"] is None and bare["unknown"], bare
        counted = c.get(f"/reef/records/{ids['counted']}").json()["usage"]
        assert counted["output_tokens"] == 5 and "unknown" not in counted, counted
    listing = d.cli("records", "list", "-s", "prov").stdout
    assert "unknown" in listing, listing
    assert "usage unknown (the provider sent no usage)" in d.cli("records", "show", ids["bare"]).stdout
