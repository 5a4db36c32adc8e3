"""A prompt longer than the model's context: a 400 in the client's own format naming both numbers (the prompt's
tokens and the context), on every provider route, streaming or not, before any event; never a silent cut or a
crash, and the model goes on serving prompts that fit.

The model is the tiny one with its context set to 256 tokens in its ``config.json`` (SmolLM2's is 8,192; the
slow test in ``test_model_dirs.py`` checks that one over HTTP too)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import assert_canonical_error

CONTEXT = 256
TOLD = re.compile(r"(\d+) tokens > (\d+) maximum context length")


@pytest.fixture(scope="module")
def short_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 256-token context."""
    dest = tmp_path_factory.mktemp("models") / "short"
    shutil.copytree(tiny_model, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    return dest


def told(message: str) -> tuple[int, int]:
    m = TOLD.search(message)
    assert m, message
    return int(m[1]), int(m[2])


def test_a_prompt_beyond_the_context_is_a_400_in_the_clients_format_naming_both_numbers(
        short_model: Path, daemon_factory: Any) -> None:
    d = daemon_factory(f'\n[models.short]\nengine = "transformers"\npath = "{short_model}"\n')
    long = "word " * (2 * CONTEXT)
    headers = {"Authorization": f"Bearer {d.token}", "x-reef-scenario": "short"}
    with httpx.Client(base_url=d.url, headers=headers, timeout=60) as c:
        assert c.post("/reef/scenarios", json={"name": "short", "model": "short"}).status_code in (200, 201)
        counted = c.post("/v1/messages/count_tokens",
                         json={"model": "short", "messages": [{"role": "user", "content": long}]})
        assert counted.status_code == 200, counted.text
        n = counted.json()["input_tokens"]
        assert n > CONTEXT
        messages = [{"role": "user", "content": long}]
        for stream in (False, True):
            for path, shape, body in [
                ("/v1/chat/completions", "openai", {"messages": messages, "max_tokens": 4}),
                ("/v1/responses", "openai", {"input": long, "max_output_tokens": 4}),
                ("/v1/messages", "anthropic", {"messages": messages, "max_tokens": 4}),
            ]:
                r = c.post(path, json={"model": "short", "stream": stream, **body})
                err = assert_canonical_error(r, 400, shape)
                assert told(err["message"]) == (n, CONTEXT), (path, stream, err)
                if shape == "openai":  # OpenAI's own code, which clients act on (Codex: "out of room")
                    assert err["code"] == "context_length_exceeded", err
                assert "text/event-stream" not in r.headers.get("content-type", ""), (path, stream)
        # the negative path: a prompt that fits is served by the same model
        ok = c.post("/v1/chat/completions", json={"model": "short", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "word " * 20}]})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] < CONTEXT


def test_a_prompt_far_beyond_the_context_is_refused_without_tokenising_it(short_model: Path,
                                                                          daemon_factory: Any) -> None:
    """A prompt longer than the context times the longest token (in characters) cannot fit: it is refused with a
    lower bound of its size, untokenised (a 10 MB prompt took 9 s of tokenising and stalled the daemon;
    bench/big_body.py), and the bound is true: at most the real count."""
    d = daemon_factory(f'\n[models.short]\nengine = "transformers"\npath = "{short_model}"\n')
    huge = "hello world " * 200_000  # 2.4 MB
    headers = {"Authorization": f"Bearer {d.token}", "x-reef-scenario": "short"}
    with httpx.Client(base_url=d.url, headers=headers, timeout=120) as c:
        assert c.post("/reef/scenarios", json={"name": "short", "model": "short"}).status_code in (200, 201)
        messages = [{"role": "user", "content": huge}]
        err = assert_canonical_error(c.post("/v1/chat/completions", json={"model": "short", "messages": messages,
                                                                          "max_tokens": 4}), 400, "openai")
        assert "at least" in err["message"], err
        bound, context = told(err["message"])
        real = c.post("/v1/messages/count_tokens", json={"model": "short", "messages": messages}).json()
        assert context == CONTEXT and CONTEXT < bound <= real["input_tokens"], (bound, real)
        # just over the context: tokenised and told exactly, as before
        err = assert_canonical_error(c.post("/v1/chat/completions", json={
            "model": "short", "max_tokens": 4, "messages": [{"role": "user", "content": "word " * (2 * CONTEXT)}]}),
            400, "openai")
        assert "at least" not in err["message"]
    with httpx.Client(base_url=d.url, headers=headers, timeout=30) as c:
        assert c.get("/healthz").status_code == 200
