"""pi (``@mariozechner/pi-coding-agent``): OpenAI chat completions against ``<base>/v1``.

Config home: ``$PI_CODING_AGENT_DIR`` (``<home>/.pi/agent``) holds ``models.json`` (the ``reef`` provider) and
``settings.json`` (default provider and model), so ``pi -p "..."`` needs no extra flags. ``HOME`` is the
isolated home too (pi reads ``~/.agents/skills``). Header and key values in ``models.json`` name environment
variables, so the file carries no token: ``REEF_TOKEN`` and ``REEF_RELEASE_ID`` are set for the run.
"""

from __future__ import annotations

import json
from pathlib import Path

from adapters.base import Adapter, Target, write_json


class Pi(Adapter):
    name = "pi"
    package = "@mariozechner/pi-coding-agent"
    version = "0.73.1"
    first_request_tokens = 1546  # bench/serve_smollm2.py
    binary = "pi"
    wire = "openai-chat"
    layout = {"AGENTS.md": ".pi/agent/AGENTS.md", "skills/": ".pi/agent/skills/", "commands/": ".pi/agent/prompts/"}

    def agent_dir(self, home: Path) -> Path:
        return home / ".pi" / "agent"

    def env(self, home: Path, target: Target, token: str) -> dict[str, str]:
        return {**super().env(home, target, token), "PI_CODING_AGENT_DIR": str(self.agent_dir(home)),
                "PI_OFFLINE": "1"}

    def prepare(self, home: Path, target: Target) -> None:
        agent = self.agent_dir(home)
        agent.mkdir(parents=True, exist_ok=True)
        models = {"providers": {"reef": {
            "baseUrl": f"{target.base}/v1",
            "api": "openai-completions",
            "apiKey": "REEF_TOKEN",
            **({"headers": {"x-reef-release-id": "REEF_RELEASE_ID"}} if target.release_id else {}),
            "models": [{"id": target.model, "name": f"{target.model} (Reef)",
                        "contextWindow": target.context_window, "maxTokens": 4096}],
        }}}
        write_json(agent / "models.json", models)
        settings_path = agent / "settings.json"
        try:
            settings = json.loads(settings_path.read_text())
        except (OSError, ValueError):
            settings = {}
        settings.update(defaultProvider="reef", defaultModel=target.model, quietStartup=True)
        write_json(settings_path, settings)

