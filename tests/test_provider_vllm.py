"""Each wrapper through a real OpenAI-compatible server: vLLM's own (issue 44, "agents through a provider fail where
SDK requests work"; tests/test_provider_agents.py has the llama-cpp-python stand-in).

vLLM's CPU build (``./install.sh --vllm``, ``.venv-vllm``) is started once for the module as a user would start it
for agents (``vllm.entrypoints.openai.api_server`` with ``--enable-auto-tool-choice --tool-call-parser hermes``:
without them vLLM refuses every request that carries tools), and ``reef serve --provider openai-compatible
--upstream-url ... --upstream-model ...`` is put in front of it (the daemon gets the flags' environment, as a wrapper's
daemon does). The model is built here: the tiny model's tokenizer and shape (2 heads: vLLM's CPU attention has no
kernel for head size 16) with weights set by hand so that it answers every prompt with "I read you" and then its end
token (``answering``): a random model would babble until a length cap, which is no ordinary run of an agent.

What is checked: each real agent (pi, Claude Code, opencode, Codex, the npm ones) through its wrapper ends with exit
0 and the answer, its exchanges complete with receipts and a report on them; what reached vLLM is what vLLM would
have made of the client's own text parts (the same prompt tokens); what vLLM refuses (a prompt past its context, a
model name it does not serve) reaches each client in its own error shape with vLLM's reason and status, and a wrapped
agent says it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
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

from tests.conftest import ROOT, Daemon, assert_canonical_error, free_port, make_home
from tests.test_agents import agents_dir  # noqa: F401 - a fixture: the agents installed once per machine

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BIN = Path(sys.executable).parent
SERVED = "answerer"  # vLLM's --served-model-name
ANSWER = "I read you"
CONTEXT = 32768  # vLLM's --max-model-len: Claude Code's first request is about 21k of the tiny tokenizer's tokens
PROVIDER = "openai-compatible"
PARTS = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in one line."}]
PROMPTS = {"pi": ["-p", "--no-session", "say hi"], "claude": ["-p", "say hi"], "opencode": ["run", "say", "hi"],
           "codex": ["-p", "say hi"]}
Started = tuple[str, "subprocess.Popen[bytes]", Path]  # vLLM's URL, its process, its log
# a hang guard for each test, its share of the module's vLLM start included (minutes on a loaded 2-core machine)
pytestmark = pytest.mark.timeout(1200)


def answering(tokenizer: Any, model: Any) -> None:
    """Weights that answer ``ANSWER`` and end, whatever the prompt and the sampling: the layers add nothing (their
    output projections are zero), so the last position's state is its token's embedding; one embedding dimension
    per state (any other token, then each token of the answer) says where the answer is, and an untied output head
    maps each state to the next token (the end token after the last) with a margin of about 80 logits."""
    import torch

    chain = tokenizer.encode(ANSWER)
    assert len(set(chain)) == len(chain), chain  # one state per token
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb[:, : len(chain) + 1] = 0.0
        emb[:, 0] = 1.0
        head = torch.zeros_like(emb)
        for state, token in enumerate(chain, start=1):
            emb[token, 0], emb[token, state] = 0.0, 1.0
        for state, token in enumerate([*chain, end]):
            head[token, state] = 10.0
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(head)


@pytest.fixture(scope="module")
def answerer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from daemon.models import TinyConfig, init_tiny

    return init_tiny(tmp_path_factory.mktemp("models") / "answerer", seed=0,
                     config=TinyConfig(num_attention_heads=2), transform=answering)


@pytest.fixture(scope="module")
def started(answerer: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    """vLLM's OpenAI-compatible server on a free loopback port, started (its URL, process and log): the daemon and
    the agents get ready while it starts (``front`` waits for it)."""
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON}: run ./install.sh --vllm (the README's test command does)"
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(answerer),
            "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", str(CONTEXT), "--enforce-eager", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes", "--disable-log-stats", "--uvicorn-log-level", "warning"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}", proc, log_path
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 900  # a hang guard: the loop waits on the server answering or exiting
    with httpx.Client(timeout=5) as c:
        while True:
            assert proc.poll() is None, f"vLLM exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"vLLM not healthy:\n{log_path.read_text()[-3000:]}"
            try:
                if c.get(url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)


@pytest.fixture(scope="module")
def front(started: Started, tiny_model: Path, agents_dir: Path) -> Iterator[Daemon]:  # noqa: F811
    """``reef serve --provider openai-compatible`` in front of vLLM (once vLLM is healthy), and a second entry
    ``direct`` with no model name of its own (the client's goes to vLLM, as with the preset and no
    ``--upstream-model``)."""
    url = started[0]
    extra = f'\n[models.direct]\nengine = "upstream"\nurl = "{url}/v1"\n'
    home, port, env = make_home(tiny_model, extra)
    (home / "config.toml").write_text(f'agents_dir = "{agents_dir}"\n' + (home / "config.toml").read_text())
    env.update(REEF_PROVIDER=PROVIDER, REEF_UPSTREAM_URL=f"{url}/v1", REEF_UPSTREAM_MODEL=SERVED)
    d = Daemon(home=home, port=port, env=env, extra_config=extra).start()
    try:
        wait_healthy(*started)
        yield d
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def vllm(front: Daemon, started: Started) -> str:
    """vLLM's URL, healthy (``front`` waited for it)."""
    return started[0]


def record(d: Daemon, receipt: str) -> dict[str, Any]:
    with d.http() as c:
        r = c.get(f"/reef/records/{receipt}")
    assert r.status_code == 200, r.text
    rec: dict[str, Any] = r.json()
    return rec


def prompt_ids(url: str, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt vLLM makes of ``messages`` sent to it directly (its ``return_token_ids`` extension)."""
    with httpx.Client(timeout=120) as c:
        r = c.post(f"{url}/v1/chat/completions", json={"model": SERVED, "messages": messages, "max_tokens": 4,
                                                       "return_token_ids": True})
    assert r.status_code == 200, r.text
    ids: list[int] = r.json()["prompt_token_ids"]
    return ids


def test_text_parts_reach_vllm_as_the_prompt_it_would_make_of_them(front: Daemon, vllm: str) -> None:
    """The agents' text parts go joined (``join_text_parts``) and vLLM renders the very prompt it renders from the
    parts sent to it directly; the comparison can tell (a join with a space is another prompt). A part that is not
    plain text (``cache_control``) goes as sent, and vLLM takes it too. Bugs caught: parts joined with another
    separator or in another order (another prompt), a part dropped."""
    messages: Any = [{"role": "system", "content": PARTS},
                     {"role": "user", "content": [{"type": "text", "text": "say hi"}, {"type": "text", "text": "now"}]}]
    direct = prompt_ids(vllm, messages)
    spaced = [{"role": m["role"], "content": " ".join(p["text"] for p in m["content"])} for m in messages]
    assert prompt_ids(vllm, spaced) != direct  # the prompt ids tell joins apart
    cached = [{"role": "system", "content": [{**PARTS[0], "cache_control": {"type": "ephemeral"}}, PARTS[1]]},
              messages[1]]
    with openai.OpenAI(base_url=f"{front.url}/s/parts/v1", api_key=front.token, max_retries=0) as c:
        for sent in (messages, cached):
            raw = c.chat.completions.with_raw_response.create(model="any", messages=sent,
                                                              extra_body={"return_token_ids": True})
            answer = raw.parse()
            assert answer.choices[0].message.content == ANSWER
            assert answer.model_extra is not None and answer.model_extra["prompt_token_ids"] == direct
            assert record(front, raw.headers["x-reef-agent-record-id"])["status"] == "complete"
        with c.chat.completions.with_streaming_response.create(model="any", messages=messages, stream=True) as s:
            receipt = s.headers["x-reef-agent-record-id"]
            text = "".join(ch.choices[0].delta.content or "" for ch in s.parse() if ch.choices)
    assert text == ANSWER
    rec = record(front, receipt)
    assert rec["status"] == "complete" and rec["usage"]["input_tokens"] == len(direct), rec["usage"]
    with anthropic.Anthropic(base_url=f"{front.url}/s/parts", api_key=front.token, max_retries=0) as a:
        reply = a.messages.create(model="any", max_tokens=20, system=[{"type": "text", "text": "Be terse."}],
                                  messages=[{"role": "user", "content": [{"type": "text", "text": "one"},
                                                                         {"type": "text", "text": "two"}]}])
    assert reply.content[0].type == "text" and reply.content[0].text == ANSWER
    assert reply.stop_reason == "end_turn"


# vLLM's own words (its refusals' messages begin with them; Reef adds where they came from)
TOO_LONG = f"This model's maximum context length is {CONTEXT} tokens. However, your prompt contains"
UNKNOWN = f"The model `gpt-9` does not exist. Valid aliases: {SERVED}."


def test_what_vllm_refuses_reaches_each_client_in_its_own_shape(front: Daemon) -> None:
    """A prompt past vLLM's context and a model name vLLM does not serve: each client (chat, Messages, Responses;
    streamed or not) gets vLLM's status and reason in its own error shape, never a bare 502, and the exchange is
    recorded as an error with the upstream's status. Compared with the same requests that fit: answered.
    Bugs caught: a 4xx turned into a 502, vLLM's message replaced or buried in its JSON, an Anthropic client answered
    in OpenAI's shape or with another error type."""
    long = [{"role": "user", "content": [{"type": "text", "text": "word " * (CONTEXT + 100)}]}]
    with front.http() as c:
        c.timeout = httpx.Timeout(300)  # a hang guard
        for stream in (False, True):
            for path, shape, body in (("chat/completions", "openai", {"messages": long}),
                                      ("messages", "anthropic", {"messages": long, "max_tokens": 5}),
                                      ("responses", "openai", {"input": long[0]["content"][0]["text"]})):
                r = c.post(f"/s/long/v1/{path}", json={"model": "m", "stream": stream, **body})
                err = assert_canonical_error(r, 400, shape)
                assert err["message"].startswith(TOO_LONG) and err["type"] == "invalid_request_error", err
                rec = record(front, r.headers["x-reef-agent-record-id"])
                assert rec["status"] == "error" and rec["response"]["error"]["upstream_status"] == 400
        fits = c.post("/s/long/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "user", "content": "word " * 1000}]})
        assert fits.status_code == 200 and fits.json()["choices"][0]["message"]["content"] == ANSWER

        made = c.post("/reef/scenarios", json={"name": "direct", "model": "direct"})
        assert made.status_code in (200, 201), made.text
        for path, shape, stream in (("chat/completions", "openai", False), ("messages", "anthropic", True)):
            r = c.post(f"/s/direct/v1/{path}", json={"model": "gpt-9", "max_tokens": 5, "stream": stream,
                                                      "messages": [{"role": "user", "content": "hi"}]})
            err = assert_canonical_error(r, 404, shape)
            assert err["message"].startswith(UNKNOWN) and err["type"] == "not_found_error", err
            rec = record(front, r.headers["x-reef-agent-record-id"])
            assert rec["status"] == "error" and rec["response"]["error"]["upstream_status"] == 404
        named = c.post("/s/direct/v1/chat/completions", json={"model": SERVED, "messages": [
            {"role": "user", "content": "hi"}]})
        assert named.status_code == 200 and named.json()["choices"][0]["message"]["content"] == ANSWER


def wrapped(front: Daemon, agents_dir: Path, agent: str, args: list[str], cwd: Path,  # noqa: F811
            provider: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
    """``reef-<agent> ARGS`` in ``cwd`` (its HOME too); ``provider=False``: without the provider's settings."""
    base = {k: v for k, v in front.env.items() if provider or not k.startswith(("REEF_PROVIDER", "REEF_UPSTREAM"))}
    run_env = {**base, "REEF_AGENTS_DIR": str(agents_dir), "HOME": str(cwd), **env}
    return subprocess.run([str(BIN / f"reef-{agent}"), *args], env=run_env, cwd=cwd, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


def last_run(front: Daemon, agent: str) -> dict[str, Any]:
    runs = front.home / "runs"
    run: dict[str, Any] = json.loads((runs / f"{(runs / f'last-{agent}').read_text().strip()}.json").read_text())
    return run


@pytest.mark.agents
@pytest.mark.parametrize("agent", ["pi", "claude", "opencode", "codex"])
def test_a_wrapped_agent_through_vllm_ends_with_an_answer(front: Daemon, vllm: str, agents_dir: Path,  # noqa: F811
                                                          tmp_path: Path, agent: str) -> None:
    """``reef-<agent> --reef-provider openai-compatible`` on a short prompt: exit 0 with vLLM's answer, every exchange
    complete with a receipt (what reached vLLM was taken: pi's and opencode's chat requests are the prompt vLLM makes of
    their own text parts), and a report on the run reaches each record."""
    out = wrapped(front, agents_dir, agent, ["--reef-provider", PROVIDER, *PROMPTS[agent]], tmp_path,
                  REEF_SCENARIO=f"vllm-{agent}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert ANSWER in out.stdout and "failed; the last" not in out.stderr, out.stdout + out.stderr
    run = last_run(front, agent)
    assert run["exit_code"] == 0 and run["receipts"], run
    recs = [record(front, r) for r in run["receipts"]]
    assert all(r["status"] == "complete" and r["model"] == PROVIDER for r in recs), [r["status"] for r in recs]
    assert all((r.get("usage") or {}).get("output_tokens") for r in recs), [r.get("usage") for r in recs]
    for rec in recs:
        if rec["format"] == "openai-chat":  # the client's own body: what vLLM makes of it, parts and all
            body = rec["request"]
            with httpx.Client(timeout=120) as c:
                counted = c.post(f"{vllm}/tokenize", json={"model": SERVED, "messages": body["messages"],
                                                           "tools": body.get("tools"), "add_generation_prompt": True})
            assert counted.status_code == 200, counted.text
            assert rec["usage"]["input_tokens"] == counted.json()["count"], (rec["usage"], counted.json()["count"])
    report = wrapped(front, agents_dir, agent, ["report", "--score", "1"], tmp_path, REEF_SCENARIO=f"vllm-{agent}")
    assert report.returncode == 0, report.stdout + report.stderr
    assert f"on {len(run['receipts'])} receipt(s) of run {run['run']}" in report.stdout, report.stdout
    with front.http() as c:  # the report is on every receipt of the run
        scored = c.get("/reef/records", params={"run": run["run"], "kind": "exchange", "limit": 1000}).json()
    assert {r["id"]: r.get("score") for r in scored["records"]} == dict.fromkeys(run["receipts"], 1.0)


# what each agent prints of the refusal itself (Claude Code answers a 404 with its own words), and how many requests
# it makes of one (Claude Code's first is a second request; Codex reconnects 5 times)
OWN_WORDS = {"pi": "404 The model `direct` does not exist", "claude": "issue with the selected model (direct)",
             "codex": "404 Not Found: The model `direct` does"}
REQUESTS = {"pi": 1, "claude": 2, "codex": 6}


@pytest.mark.agents
@pytest.mark.parametrize("agent", ["pi", "claude", "codex"])  # one per wire format (opencode's is pi's: chat)
def test_a_wrapped_agent_says_what_vllm_refused(front: Daemon, agents_dir: Path, tmp_path: Path,  # noqa: F811
                                                agent: str) -> None:
    """An agent through the entry without a model name of its own: vLLM does not serve the name the agent sends
    (``direct``). The run fails at once: the agent got vLLM's 404 and reason in its own format (pi, opencode and Codex
    print it; Claude Code its own words), the wrapper's last line says vLLM's reason whatever the agent printed, and
    each exchange is an error with the upstream's status (no 502s retried a dozen times).
    Bugs caught: the wrapper's line missing or without the reason (what a Claude Code user would never see)."""
    with front.http() as c:
        made = c.post("/reef/scenarios", json={"name": f"refused-{agent}", "model": "direct"})
        assert made.status_code in (200, 201), made.text
    out = wrapped(front, agents_dir, agent, PROMPTS[agent], tmp_path, provider=False, REEF_SCENARIO=f"refused-{agent}")
    said = out.stdout + out.stderr
    assert out.returncode != 0, said
    own = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(ln for ln in said.splitlines() if not ln.startswith("reef: ")))
    assert OWN_WORDS[agent] in own, said
    run = last_run(front, agent)
    n = len(run["receipts"])
    assert 1 <= n <= REQUESTS[agent], said
    assert (f"reef: {n} of the run's {n} model request{'s' if n > 1 else ''} failed; the last: The model `direct` "
            f"does not exist. Valid aliases: {SERVED}.") in out.stderr, out.stderr
    recs = [record(front, r) for r in run["receipts"]]
    assert all(r["status"] == "error" and r["response"]["error"]["upstream_status"] == 404 for r in recs)
