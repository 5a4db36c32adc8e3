"""Claude Code (``@anthropic-ai/claude-code``): Anthropic Messages against the base URL (it appends
``/v1/messages?beta=true``).

Config home: ``$CLAUDE_CONFIG_DIR`` (``<home>/.claude``) holds all of Claude Code's state, so ``HOME`` stays the
user's. The endpoint is set by environment only: ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_AUTH_TOKEN`` (sent as a
bearer token), ``ANTHROPIC_MODEL``, ``ANTHROPIC_CUSTOM_HEADERS`` (the pinned harness release).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from adapters.base import Adapter, Target


class Claude(Adapter):
    name = "claude"
    package = "@anthropic-ai/claude-code"
    version = "2.1.197"
    # its first request ("say hi", a fresh config home) in SmolLM2 tokens as JSON: 21,319 measured with 2.1.197 ...
    first_request_tokens = 21300
    first_request_tool_tokens = 17750  # ... 17,753 of them its 24 tool schemas (SmolLM2's template renders 3,041)
    binary = "claude"
    wire = "anthropic"
    layout = {"AGENTS.md": ".claude/CLAUDE.md", "skills/": ".claude/skills/", "commands/": ".claude/commands/"}
    override_home = False

    def env(self, home: Path, target: Target, token: str) -> dict[str, str]:
        headers = f"x-reef-release-id: {target.release_id}" if target.release_id else ""
        return {
            **super().env(home, target, token),
            "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "ANTHROPIC_BASE_URL": target.base,
            "ANTHROPIC_AUTH_TOKEN": token,
            "ANTHROPIC_MODEL": target.model,
            "ANTHROPIC_SMALL_FAST_MODEL": target.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": target.model,
            "ANTHROPIC_CUSTOM_HEADERS": headers,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
        }

    def unset_env(self) -> tuple[str, ...]:
        return ("ANTHROPIC_API_KEY",)  # would be sent as x-api-key beside Reef's token

    def prepare(self, home: Path, target: Target) -> None:
        config_dir = home / ".claude"
        config_dir.mkdir(parents=True, exist_ok=True)
        state = config_dir / ".claude.json"
        try:
            current = json.loads(state.read_text())
        except (OSError, ValueError):
            current = {}
        if not current.get("hasCompletedOnboarding"):
            # the first-run theme picker is for a new user, not for a new config home: skip it, with the
            # user's own theme when they have one (read, never written); the folder-trust question stays
            current.update(hasCompletedOnboarding=True, theme=_user_theme() or current.get("theme") or "dark")
            tmp = state.with_name(".claude.json.tmp")
            tmp.write_text(json.dumps(current, indent=2) + "\n")
            os.replace(tmp, state)


def _user_theme() -> str | None:
    for path in (Path.home() / ".claude.json", Path.home() / ".claude" / ".claude.json"):
        try:
            theme = json.loads(path.read_text()).get("theme")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(theme, str):
            return theme
    return None
