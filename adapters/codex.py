"""Codex CLI (``@openai/codex``): OpenAI Responses against ``<base>/v1`` (it appends ``/responses``).

Config home: ``$CODEX_HOME`` (``<home>/.codex``) holds ``config.toml``, which defines the ``reef`` model provider
(``env_key = "REEF_TOKEN"``: the token is read from the environment, never written) and makes it the default.
``HOME`` is the isolated home too: Codex reads skills from ``~/.agents/skills`` as well as from its own home.

The same file turns off what would leave the machine (each key is in Codex's config schema,
``codex-rs/core/config.schema.json``; measured with strace on 0.171.0, see docs/agents.md): the curated-plugin sync
(``features.plugins``: without it every run looks up api.github.com, chatgpt.com and ab.chatgpt.com), apps and
connectors, the startup update check, analytics, feedback upload, OpenTelemetry export, the hosted web search
tool (which a local model cannot run) and the bundled skills. Credentials stay in files under ``$CODEX_HOME``
(never the OS keyring). Two things of the interactive TUI have no setting: an announcement fetched from GitHub
on every start (a proxy that refuses keeps it on loopback, ``proxy_guard``) and a self-updating app-server daemon
(any ``-c`` override keeps it in-process, ``argv``).

``reef-codex -p PROMPT`` is the one-prompt form the other wrappers have: it runs ``codex exec
--skip-git-repo-check PROMPT`` (Codex's own ``-p`` picks a profile, which an isolated home does not have).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from adapters.base import Adapter, Target, write_file

# [section] -> key -> value, in the order written; None for the top level
OFFLINE: dict[str | None, dict[str, object]] = {
    None: {"check_for_update_on_startup": False, "web_search": "disabled",
           "cli_auth_credentials_store": "file", "mcp_oauth_credentials_store": "file"},
    "analytics": {"enabled": False},
    "feedback": {"enabled": False},
    "otel": {"exporter": "none", "trace_exporter": "none", "metrics_exporter": "none", "log_user_prompt": False},
    # plugins: the curated-plugin sync (api.github.com, chatgpt.com, ab.chatgpt.com on every run); apps: ChatGPT's
    # connectors; remote_*: fetched from OpenAI's servers; request compression: Reef reads plain JSON bodies
    "features": {"plugins": False, "remote_plugin": False, "apps": False, "remote_models": False,
                 "image_generation": False, "enable_request_compression": False},
    # subagents: their tools come as one "namespace" tool, which Reef's neutral tool list does not carry
    "agents": {"enabled": False},
    # the skills Codex ships (image generation through OpenAI's API, a skill installer that fetches from GitHub,
    # ...): about 500 tokens of every first request, and not this harness; the scenario's skills still load
    "skills.bundled": {"enabled": False},
}


# One request has no switch: the interactive TUI fetches raw.githubusercontent.com/openai/codex/main/
# announcement_tip.toml on every start ([tui] show_tooltips = false does not stop it). Codex's HTTP client honours the
# proxy variables, so unless the user has a proxy of their own, Codex gets a proxy that refuses (nothing listens on
# the discard port) for everything but the daemon: that fetch fails on loopback, no name is even looked up. The
# commands Codex runs do not inherit it ([shell_environment_policy] exclude).
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
NOWHERE = "http://127.0.0.1:9"
GUARD_VARS = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")


def proxy_guard(environ: Mapping[str, str], target: Target) -> dict[str, str]:
    """The proxy variables that keep Codex's own requests on loopback, or {} when the user has a proxy."""
    if any(environ.get(v) for v in PROXY_VARS):
        return {}
    keep = [h.strip() for h in (environ.get("NO_PROXY") or environ.get("no_proxy") or "").split(",") if h.strip()]
    keep += ["127.0.0.1", "localhost", "::1", urlsplit(target.url).hostname or ""]
    no_proxy = ",".join(dict.fromkeys(h for h in keep if h))
    return {**dict.fromkeys(GUARD_VARS, NOWHERE), "NO_PROXY": no_proxy, "no_proxy": no_proxy}


def toml_value(value: object) -> str:
    """A TOML value (a JSON string literal is a TOML basic string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def config_toml(target: Target, *, guarded: bool = False) -> str:
    provider: dict[str, object] = {
        "name": "Reef",
        "base_url": f"{target.base}/v1",
        "env_key": "REEF_TOKEN",
        "wire_api": "responses",
        "supports_websockets": False,
    }
    if target.release_id:
        provider["env_http_headers"] = {"x-reef-release-id": "REEF_RELEASE_ID"}
    top = {"model": target.model, "model_provider": "reef", "model_context_window": target.context_window,
           **OFFLINE[None]}
    lines = ["# written by reef-codex on every run: edits here are replaced", ""]
    lines += [f"{k} = {toml_value(v)}" for k, v in top.items()]
    sections: dict[str, dict[str, object]] = {"model_providers.reef": provider}
    sections.update({k: v for k, v in OFFLINE.items() if k is not None})
    if guarded:
        sections["shell_environment_policy"] = {"exclude": list(GUARD_VARS)}
    for name, table in sections.items():
        lines += ["", f"[{name}]", *(f"{k} = {toml_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


class Codex(Adapter):
    name = "codex"
    package = "@openai/codex"
    version = "0.171.0"
    binary = "codex"
    wire = "openai-responses"
    # its instructions and 7 function tools, in SmolLM2 tokens (message texts plus the tool schemas as JSON), as
    # 0.171.0 sends them with this config: it fits SmolLM2's 8,192, leaving about 2,000 for the conversation
    first_request_tokens = 5900
    # Codex reads $CODEX_HOME/AGENTS.md (global rules) and skills under $CODEX_HOME/skills; it has no prompt
    # templates any more (custom prompts were removed), so commands/ has no place in its layout
    layout = {"AGENTS.md": ".codex/AGENTS.md", "skills/": ".codex/skills/"}

    def codex_home(self, home: Path) -> Path:
        return home / ".codex"

    def env(self, home: Path, target: Target, token: str) -> dict[str, str]:
        return {**super().env(home, target, token), "CODEX_HOME": str(self.codex_home(home)),
                **proxy_guard(os.environ, target)}

    def unset_env(self) -> tuple[str, ...]:
        # the API keys and endpoint of the built-in OpenAI provider, and a separate state-database home
        return ("OPENAI_API_KEY", "OPENAI_BASE_URL", "CODEX_API_KEY", "CODEX_SQLITE_HOME")

    def prepare(self, home: Path, target: Target) -> None:
        cfg = self.codex_home(home)
        cfg.mkdir(parents=True, exist_ok=True)
        data = config_toml(target, guarded=bool(proxy_guard(os.environ, target))).encode()
        path = cfg / "config.toml"
        try:
            same = path.read_bytes() == data and not path.is_symlink()
        except OSError:
            same = False
        if not same:
            write_file(path, data)

    def argv(self, binary: Path, args: list[str], target: Target) -> list[str]:
        if args[:1] == ["-p"]:
            args = ["exec", "--skip-git-repo-check", *args[1:]]
        # any command-line override (this one repeats config.toml) keeps the TUI's app server in-process: without
        # one, the TUI copies its release (420 MB) into the home and leaves a self-updating daemon running
        return [str(binary), "-c", "analytics.enabled=false", *args]
