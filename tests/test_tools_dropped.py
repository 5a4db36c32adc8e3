"""Tools an agent sends that the model never sees (issue 44: on SmolLM2 the agents could talk but never act, and
nothing said why). ``daemon/engines/chat_template.carries_tools`` asks the template once per load; a wrapped run on
such a model says so once on the wrapper's stderr with the way out (``--reef-provider NAME``), and each exchange
that sent tools records how many the model never saw (``usage.tools_dropped``, shown by ``reef records show``).

The model that drops tools is the tiny model with SmolLM2-135M-Instruct's own chat template (as its GGUF carries
it, below); the one that carries them is the tiny model as built (its template renders a ``tools`` list). The
wrapper is the real ``reef-pi`` against a real daemon; the agent is a script where the adapter looks for pi, making
one real request with two tools, as pi would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapters import ADAPTERS
from daemon.engines.chat_template import carries_tools
from tests.conftest import Daemon, make_home

BIN = Path(sys.executable).parent
# SmolLM2-135M-Instruct's chat template, verbatim from its GGUF (tokenizer.chat_template): no tools anywhere
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
REFUSES_TOOLS = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}{{ messages[0]['content'] }}"
ASKS = ('import json, os, urllib.request\n'
        'tool = lambda n: {{"type": "function", "function": {{"name": n, "description": n, "parameters": '
        '{{"type": "object", "properties": {{}}}}}}}}\n'
        'req = urllib.request.Request("{url}/s/tools/r/" + os.environ["REEF_RUN"] + "/v1/chat/completions", '
        'data=json.dumps({{"model": "m", "max_tokens": 2, "tools": [tool("read"), tool("bash")], '
        '"messages": [{{"role": "user", "content": "hi"}}]}}).encode(), '
        'headers={{"x-api-key": "{token}", "content-type": "application/json"}})\n'
        'urllib.request.urlopen(req, timeout=60).read()\n')


def smol_model(tiny_model: Path, dest: Path) -> Path:
    """The tiny model with SmolLM2's chat template."""
    shutil.copytree(tiny_model, dest)
    for jinja in dest.glob("chat_template.jinja"):
        jinja.unlink()
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg["chat_template"] = SMOLLM2_TEMPLATE
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


def test_carries_tools_tells_a_template_that_drops_or_refuses_them(tiny_model: Path) -> None:
    """Bugs caught: the answer taken from whether rendering succeeded (SmolLM2's template renders happily without
    them), a template that raises on tools taken as carrying them, a cached answer shared across tokenizers."""
    from transformers import AutoTokenizer

    carrying = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    dropping = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    dropping.chat_template = SMOLLM2_TEMPLATE
    refusing = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    refusing.chat_template = REFUSES_TOOLS
    assert carries_tools(carrying) is True
    assert carries_tools(dropping) is False
    assert carries_tools(refusing) is False
    assert carries_tools(carrying) is True  # cached per tokenizer (per load), never across


@pytest.fixture(scope="module")
def smol_daemon(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    model = smol_model(tiny_model, tmp_path_factory.mktemp("smol") / "smol")
    home, port, env = make_home(tiny_model)
    config = (home / "config.toml").read_text().replace('default_model = "tiny"', 'default_model = "smol"')
    (home / "config.toml").write_text(config + f'\n[models.smol]\nengine = "transformers"\npath = "{model}"\n')
    d = Daemon(home=home, port=port, env=env).start()
    yield d
    d.stop()
    shutil.rmtree(home, ignore_errors=True)


def run_pi(d: Daemon, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    agents = tmp_path / "agents"
    binary = ADAPTERS["pi"].binary_path(agents)
    binary.parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "asks.py").write_text(ASKS.format(url=d.url, token=d.token))
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "asks.py"}"\n')
    binary.chmod(0o755)
    env = {**d.env, "REEF_AGENTS_DIR": str(agents), "REEF_SCENARIO": "tools"}
    return subprocess.run([str(BIN / "reef-pi"), "-p", "list the files"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def last_receipt(d: Daemon) -> str:
    runs = d.home / "runs"
    run = json.loads((runs / f"{(runs / 'last-pi').read_text().strip()}.json").read_text())
    (receipt,) = run["receipts"]
    return str(receipt)


def test_a_wrapped_run_on_a_template_without_tools_says_so_once_and_records_it(smol_daemon: Daemon,
                                                                                 tmp_path: Path) -> None:
    d = smol_daemon
    out = run_pi(d, tmp_path)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if "drops tool definitions" in line]
    assert len(said) == 1, out.stderr
    assert "reef-pi --reef-provider NAME" in said[0] and "anthropic" in said[0]
    receipt = last_receipt(d)
    with d.http() as c:
        rec = c.get(f"/reef/records/{receipt}").json()
    assert rec["usage"]["tools_dropped"] == 2 and rec["status"] == "complete"
    shown = d.cli("records", "show", receipt)
    assert "tools dropped" in shown.stdout and "2 tool(s)" in shown.stdout
    with d.http() as c:  # a request without tools drops none
        r = c.post("/s/tools/v1/chat/completions", json={"model": "m", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})
        plain = c.get(f"/reef/records/{r.headers['x-reef-agent-record-id']}").json()
    assert "tools_dropped" not in plain["usage"]


def test_a_template_that_carries_tools_says_nothing(daemon: Daemon, tmp_path: Path) -> None:
    out = run_pi(daemon, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "drops tool definitions" not in out.stderr
    with daemon.http() as c:
        rec = c.get(f"/reef/records/{last_receipt(daemon)}").json()
    assert "tools_dropped" not in rec["usage"]
