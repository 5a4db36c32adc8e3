"""Agents through a provider (issue 44: with ``reef serve --provider llamacpp`` in front of llama-cpp-python's
server, pi and Claude Code ended in 502s after a dozen retries, every exchange an error, while SDK requests with
string content worked). The agents send message content as lists of text parts, which SmolLM2's chat template
cannot take; the upstream engine joins such content into one string (``join_text_parts``, on for every preset but
``openai``), and what the upstream still refuses reaches the client in its own format with the upstream's reason.

The server behind the provider is ``tests/fake_servers/llamacpp_python.py``, a real HTTP server on 127.0.0.1 that
STANDS IN for llama-cpp-python's (not installed here): it validates and renders SmolLM2's own template the way that
server does, and refuses the same way (422 from validation, 500 from the template). The daemon is started with the
provider flags' environment (``REEF_PROVIDER=llamacpp``, ``REEF_UPSTREAM_URL``), as ``reef serve --provider`` is. The
agents are the real npm ones (pinned versions, ``tests/test_agents.py``), wrapped with ``--reef-provider llamacpp``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from daemon.engines.upstream import join_text_parts
from tests.conftest import Daemon, assert_canonical_error, free_port, make_home
from tests.test_agents import agents_dir  # noqa: F401 - a fixture: the agents installed once per machine

FAKE = Path(__file__).parent / "fake_servers" / "llamacpp_python.py"
BIN = Path(sys.executable).parent
PARTS = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in one line."}]


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    port = free_port()
    where = tmp_path_factory.mktemp("llamacpp")
    log = where / "requests.jsonl"
    out = open(where / "server.log", "wb")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen([sys.executable, str(FAKE), str(port), str(log)], stdout=out, stderr=out)
    out.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60  # a hang guard: the loop waits on the server answering
    with httpx.Client(timeout=2) as c:
        while True:
            try:
                if c.get(url + "/v1/models").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, (where / "server.log").read_text()
            time.sleep(0.05)
    yield url, log
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def front(tiny_model: Path, fake: tuple[str, Path]) -> Iterator[Daemon]:
    home, port, env = make_home(tiny_model)
    env.update(REEF_PROVIDER="llamacpp", REEF_UPSTREAM_URL=f"{fake[0]}/v1")
    d = Daemon(home=home, port=port, env=env).start()
    yield d
    d.stop()
    shutil.rmtree(home, ignore_errors=True)


def sent(log: Path) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(log.read_text().splitlines()[-1])
    return body


def test_join_text_parts_joins_only_what_loses_nothing() -> None:
    """Bugs caught: an image part dropped by the join, a part with more than type and text (``cache_control``)
    joined away, the body changed when nothing needed it."""
    image = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]
    cached = [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}]
    body = {"model": "m", "messages": [{"role": "system", "content": PARTS}, {"role": "user", "content": image},
                                       {"role": "user", "content": cached}, {"role": "user", "content": "hi"}]}
    out = join_text_parts(body)
    assert [m["content"] for m in out["messages"]] == ["You are terse.\nAnswer in one line.", image, cached, "hi"]
    assert body["messages"][0]["content"] == PARTS  # the client's body is not changed in place
    plain = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert join_text_parts(plain) is plain


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_requests_with_text_parts_are_answered(front: Daemon, fake: tuple[str, Path], stream: bool) -> None:
    """Bug caught: list content sent as is (the stand-in's 422 and 500, as the issue's 502s)."""
    with openai.OpenAI(base_url=f"{front.url}/s/parts/v1", api_key=front.token, max_retries=0) as c:
        messages: Any = [{"role": "system", "content": PARTS},
                         {"role": "user", "content": [{"type": "text", "text": "say hi"}]}]
        if stream:
            text = "".join(ch.choices[0].delta.content or "" for ch in
                           c.chat.completions.create(model="m", messages=messages, stream=True) if ch.choices)
        else:
            text = c.chat.completions.create(model="m", messages=messages).choices[0].message.content or ""
    assert text.startswith("I read"), text
    assert [m["content"] for m in sent(fake[1])["messages"]] == ["You are terse.\nAnswer in one line.", "say hi"]
    with anthropic.Anthropic(base_url=f"{front.url}/s/parts", api_key=front.token, max_retries=0) as a:
        answer = a.messages.create(model="m", max_tokens=20, system=[{"type": "text", "text": "Be terse."}],
                                   messages=[{"role": "user", "content": [{"type": "text", "text": "one"},
                                                                          {"type": "text", "text": "two"}]}])
    assert answer.content[0].type == "text" and answer.content[0].text.startswith("I read")
    assert all(isinstance(m["content"], str) for m in sent(fake[1])["messages"])


def test_what_the_upstream_still_refuses_reaches_the_client_with_its_reason(front: Daemon) -> None:
    """An image part cannot be joined: the stand-in's template fails (500) and its validation refuses a system image
    (422). Each client gets the upstream's own message in its own error shape, the 4xx with the upstream's status.
    Bugs caught: FastAPI's validation list shown as raw JSON, an Anthropic client answered in OpenAI's shape."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with httpx.Client(base_url=front.url, headers={"authorization": f"Bearer {front.token}"}, timeout=60) as c:
        r = c.post("/s/refused/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this"}, image]}]})
        err = assert_canonical_error(r, 502, "openai")
        assert 'can only concatenate str (not "list") to str' in err["message"] and "HTTP 500" in err["message"]
        r = c.post("/s/refused/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "system", "content": [image]}, {"role": "user", "content": "hi"}]})
        err = assert_canonical_error(r, 422, "openai")
        assert "body.messages.0.content: Input should be a valid string" in err["message"], err
        r = c.post("/s/refused/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]})
        err = assert_canonical_error(r, 502, "anthropic")
        assert 'can only concatenate str (not "list") to str' in err["message"]
        rec = c.get(f"/reef/records/{r.headers['x-reef-agent-record-id']}").json()
    assert rec["status"] == "error" and rec["response"]["error"]["upstream_status"] == 500


@pytest.mark.agents
@pytest.mark.parametrize("agent,args", [("pi", ["-p", "--no-session", "say hi"]), ("claude", ["-p", "say hi"]),
                                        ("opencode", ["-p", "say hi"]), ("codex", ["-p", "say hi"])])
def test_a_wrapped_agent_through_the_provider_ends_with_an_answer(front: Daemon, fake: tuple[str, Path],
                                                                   agents_dir: Path, tmp_path: Path,  # noqa: F811
                                                                   agent: str, args: list[str]) -> None:
    env = {**front.env, "REEF_AGENTS_DIR": str(agents_dir), "HOME": str(tmp_path), "REEF_SCENARIO": f"prov-{agent}"}
    out = subprocess.run([str(BIN / f"reef-{agent}"), "--reef-provider", "llamacpp", *args], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "I read" in out.stdout, out.stdout + out.stderr
    runs = front.home / "runs"
    run = json.loads((runs / f"{(runs / f'last-{agent}').read_text().strip()}.json").read_text())
    assert run["receipts"], run
    with front.http() as c:
        recs = [c.get(f"/reef/records/{r}").json() for r in run["receipts"]]
    assert all(r["status"] == "complete" and r["model"] == "llamacpp" for r in recs), [r["status"] for r in recs]
    assert all(isinstance(m["content"], str) or m["content"] is None for m in sent(fake[1])["messages"]
               if m["role"] != "tool")
