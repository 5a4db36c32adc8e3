"""The page per release, loaded in a real headless Chromium from the file ``reef releases open`` writes: releases made
for real (the lessons recipe learning from written feedback; online-rl training LoRA adapters through a floor gate),
and what a person sees: the feedback as text (a ``<script>`` in it shown, never run), the harness diff, the tensors
an adapter changed, the gate's verdict and figures, the chain (rolled back or not) and one plot point per scored
release. Unknown ids are a 404 in the canonical shape; ``reef releases open`` hands the file to the browser."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon, assert_canonical_error
from tests.test_learning import published_step, releases, serve_and_report, settings_toml, wait_for

TITLE_SET = "pwned-by-feedback"
PAYLOAD = (f"<script>document.title='{TITLE_SET}'</script><img src=x onerror=\"document.title='{TITLE_SET}'\">"
           " always run the tests & say so")


class Dom(HTMLParser):
    """What a person sees of a dumped DOM: its visible text, its title, and the elements it holds."""

    def __init__(self, markup: str) -> None:
        super().__init__(convert_charrefs=True)
        self.text: list[str] = []
        self.title = ""
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self._open: list[str] = []
        self.feed(markup)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag not in ("img", "meta", "br", "line", "polyline", "circle"):
            self._open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self._open:
            while self._open and self._open.pop() != tag:
                pass

    def handle_data(self, data: str) -> None:
        if "title" in self._open and "svg" not in self._open:
            self.title += data
        elif not {"style", "script"} & set(self._open):
            self.text.append(data)

    @property
    def visible(self) -> str:
        return " ".join(" ".join(self.text).split())

    def count(self, tag: str, cls: str | None = None) -> int:
        return sum(t == tag and (cls is None or cls in (a.get("class") or "").split()) for t, a in self.tags)


def chromium(url_or_path: str | Path) -> Dom:
    """The DOM headless Chromium holds once ``url_or_path`` has loaded (scripts, had any run, included)."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail("chromium is not installed: ./install.sh --dev installs it (apt-get install chromium)")
    target = Path(url_or_path).as_uri() if isinstance(url_or_path, Path) else url_or_path
    with tempfile.TemporaryDirectory(prefix="reef-chromium-") as profile:
        proc = subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                               "--disable-extensions", "--disable-background-networking", f"--user-data-dir={profile}",
                               "--dump-dom", target], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "HOME": profile})
    assert proc.returncode == 0 and "<html" in proc.stdout, proc.stderr[-2000:]
    return Dom(proc.stdout)


def open_page(d: Daemon, release_id: str, *args: str) -> Path:
    out = d.cli("releases", "open", release_id, "--no-browser", *args)
    path = Path(out.stdout.strip())
    assert path.is_file() and path.stat().st_mode & 0o077 == 0, out.stdout  # the user's data: not for others
    return path


def report(c: httpx.Client, scenario: str, feedback: str) -> dict[str, Any]:
    served = c.post(f"/s/{scenario}/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                                "messages": [{"role": "user", "content": "x"}]})
    rep = c.post("/reef/report", json={"references": [served.headers["x-reef-agent-record-id"]], "score": 0,
                                       "feedback": feedback})
    assert rep.status_code == 201, rep.text
    assert rep.json()["learning"]["verdict"] == "accepted", rep.json()
    return rep.json()


def test_a_harness_release_page_shows_the_feedback_as_text_the_diff_and_the_rollback(daemon: Daemon) -> None:
    with daemon.unix() as c:
        assert c.post("/reef/scenarios", json={"name": "paged", "recipe": "lessons"}).status_code == 201
        report(c, "paged", "keep diffs small")
        hostile = report(c, "paged", PAYLOAD)
        chain = releases(c, "paged")["releases"]
        step2, step1 = chain[0], chain[1]
        assert step2["receipts"] == [hostile["report_id"]]
        rolled = c.post("/reef/scenarios/paged/rollback", json={"release_id": step1["release_id"],
                                                                "expected_head": step2["release_id"]})
        assert rolled.status_code == 201, rolled.text
        served = c.get(f"/reef/releases/{step2['release_id'][:10]}/page")
    assert served.status_code == 200 and served.headers["content-type"].startswith("text/html")
    assert "script-src" not in served.headers["content-security-policy"]  # default-src 'none': no script at all
    assert "<script>" not in served.text and "<img" not in served.text  # escaped by the daemon, not by chance

    dom = chromium(open_page(daemon, step2["release_id"][:10]))
    assert dom.title.startswith(f"Release {step2['release_id'][:12]} of paged (step 2)")  # no script changed it
    assert TITLE_SET not in dom.title
    assert dom.count("script") == 0 and dom.count("img") == 0
    seen = dom.visible
    assert PAYLOAD in seen  # the feedback, shown as the text it is
    assert hostile["report_id"] in seen and "score 0" in seen
    # the diff: the rule the feedback became, added to AGENTS.md (escaped there too)
    assert "AGENTS.md" in seen and dom.count("span", "add") >= 1
    assert f"+- Avoid a past mistake: {PAYLOAD}" in seen and " - keep diffs small" in seen  # an instruction as written
    # the gate and the chain
    assert "Published: the candidate passed the gate 'always'." in seen
    assert f"rolled back by step 3 ({rolled.json()['release_id'][:12]}), which restored {step1['release_id'][:12]}" \
        in seen
    assert "not the head" in seen and f"parent: step 1 train ({step1['release_id'][:12]})" in seen
    assert dom.count("circle", "point") == 0 and "nothing to plot" in seen  # gate 'always' scores nothing

    first = chromium(open_page(daemon, step1["release_id"], "--scenario", "paged"))
    assert "restored by the rollback at step 3" in first.visible and "not rolled back" in first.visible


def test_an_adapter_release_page_names_the_tensors_the_verdict_and_plots_every_release(daemon_factory: Any) -> None:
    # (the held-out check off: a random tiny model's 4-answer steps are not what it is for, and this page's claims
    # need two published steps; once in a full run step 2 did not come within 90 s, not reproduced alone)
    d: Daemon = daemon_factory(settings_toml(gate="floor", floor=0.0, eval_family="say", eval_n=4,
                                             heldout_check=False))
    with d.http() as c:
        created = c.post("/reef/scenarios", json={"name": "plotted", "recipe": "online-rl",
                                                  "settings": {"lora": True, "lora_rank": 4}})
        assert created.status_code == 201, created.text
        serve_and_report(c, "plotted", 4)
        published_step(c, "plotted", 1)
        receipts = serve_and_report(c, "plotted", 4)
        chain = published_step(c, "plotted", 2)["releases"]
        step2, step1, init = chain
        rolled = c.post("/reef/scenarios/plotted/rollback", json={"release_id": step1["release_id"],
                                                                  "expected_head": step2["release_id"]})
        assert rolled.status_code == 201, rolled.text
    m = step2["metrics"]
    assert m["eval_reward"] is not None and step1["metrics"]["base_reward"] is not None

    dom = chromium(open_page(d, step2["release_id"]))
    seen = dom.visible
    # why: the four exchanges it trained on, each with its score
    assert all(r in seen for r in receipts) and dom.count("li", "input") == 4
    # what changed: the adapter's tensors, with the size of the change
    assert "adapter_model.safetensors" in seen and "LoRA adapter on" in seen
    rows = dom.count("tr", "tensor")
    assert rows > 0 and "lora_A" in seen and "lora_B" in seen
    # the gate: its verdict and figures
    assert "Published: the candidate passed the gate 'floor'." in seen
    assert f"candidate mean {m['eval_reward']:.4g}, serving head's mean {m['base_reward']:.4g}" in seen
    # the chain: one point per release (init scored as step 1's base; the rollback as what it restores)
    assert dom.count("circle", "point") == 4 == len(chain) + 1
    assert dom.count("circle", "this") == 1 and dom.count("circle", "rollback") == 1
    assert "rolled back by step 3" in seen and "not the head" in seen
    scores = [a.get("data-score") for t, a in dom.tags if t == "circle"]
    assert scores == [f"{x:.6g}" for x in (step1["metrics"]["base_reward"], step1["metrics"]["eval_reward"],
                                           m["eval_reward"], step1["metrics"]["eval_reward"])]
    head = chromium(open_page(d, rolled.json()["release_id"]))
    assert "the head: it serves the scenario now" in head.visible and head.count("circle", "this") == 1
    # learning spend (issue 49): the step's own trainer time and the scenario's, as `reef status` has them
    assert "Learning spend" in seen and f"{m['trainer_seconds']:.4g} s of trainer time" in seen
    assert "(no cap: max_trainer_hours)" in seen and "cost per point of reward" in seen
    assert "no trainer time (a rollback)" in head.visible  # it restores a step: its time was spent once


def test_unknown_releases_are_404s_and_open_hands_the_file_to_the_browser(daemon: Daemon, tmp_path: Path) -> None:
    with daemon.http() as c:
        assert_canonical_error(c.get("/reef/releases/0123456789abcdef/page"), 404)
        assert_canonical_error(c.get("/reef/scenarios/nope/releases/0123456789abcdef/page"), 404)
        c.post("/s/other/v1/chat/completions", json={"model": "tiny", "max_tokens": 1,
                                                     "messages": [{"role": "user", "content": "x"}]})
        init = releases(c, "other")["releases"][0]["release_id"]
        assert c.get(f"/reef/releases/{init}/page").status_code == 200
        wrong = assert_canonical_error(c.get(f"/reef/scenarios/elsewhere/releases/{init}/page"), 404)
        assert "not a release of scenario 'elsewhere'" in wrong["message"]
        assert_canonical_error(httpx.get(f"{daemon.url}/reef/releases/{init}/page"), 401)  # the token, as ever
        scoped = c.post("/reef/tokens", json={"scenario": "other", "ttl_s": 60}).json()["token"]
        for path in (f"/reef/releases/{init}/page", f"/reef/scenarios/other/releases/{init}/page"):
            # a sandbox's token samples its scenario's model, and never reads the feedback a page shows
            assert_canonical_error(httpx.get(daemon.url + path, headers={"Authorization": f"Bearer {scoped}"}), 403)
    missing = daemon.cli("releases", "open", "0123456789abcdef", "--no-browser", check=False)
    assert missing.returncode != 0 and missing.stderr.startswith("reef: ") and "0123456789abcdef" in missing.stderr
    # without --no-browser: the file's URL goes to the browser ($BROWSER, as Python's webbrowser reads it)
    seen = tmp_path / "browser-saw"
    browser = tmp_path / "browser"
    browser.write_text(f"#!/bin/sh\nprintf '%s' \"$1\" > {seen}\n")
    browser.chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "reef_cli.main", "releases", "open", init[:8], "-o",
                          str(tmp_path / "page.html")], env={**daemon.env, "BROWSER": str(browser)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "page.html")
    assert (tmp_path / "page.html").stat().st_mode & 0o077 == 0  # feedback and diffs: the user's alone
    wait_for(seen.exists, what="the browser to be started")
    assert seen.read_text() == (tmp_path / "page.html").as_uri()
    assert chromium(tmp_path / "page.html").title.startswith(f"Release {init[:12]} of other (step 0)")
    unwritable = daemon.cli("releases", "open", init, "--no-browser", "-o", str(tmp_path / "page.html" / "x"),
                            check=False)
    assert unwritable.returncode == 1 and "cannot write the page to" in unwritable.stderr
