"""opencode (``opencode-ai``): OpenAI chat completions through the AI SDK's openai-compatible provider.

Config home: the XDG directories and ``HOME`` all point into ``<home>``; the global config
``<home>/.config/opencode/opencode.json`` defines the ``reef`` provider (``{env:...}`` references, so no token is
written) and makes it the default and small model. opencode starts a background ``npm install
@opencode-ai/plugin`` in each config directory on every run; a ``node_modules/`` and a ``package-lock.json``
that already list the plugin stop it, so nothing leaves the machine.

One prompt: ``reef-opencode -p "fix the bug"`` runs ``opencode run fix the bug`` (opencode has no ``-p`` of its own
at the top; its one-shot form is ``run MESSAGE..``). The prompt goes as words: opencode puts quotes around a
message argument that holds a space, and the model would see them.
"""

from __future__ import annotations

import json
from pathlib import Path

from adapters.base import Adapter, Target, write_json
from daemon.errors import BadRequest


class Opencode(Adapter):
    name = "opencode"
    package = "opencode-ai"
    version = "1.18.33"
    binary = "opencode"
    wire = "openai-chat"
    layout = {"AGENTS.md": ".config/opencode/AGENTS.md", "skills/": ".config/opencode/skills/",
              "commands/": ".config/opencode/commands/"}

    def config_dir(self, home: Path) -> Path:
        return home / ".config" / "opencode"

    def env(self, home: Path, target: Target, token: str) -> dict[str, str]:
        return {
            **super().env(home, target, token),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local" / "share"),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_STATE_HOME": str(home / ".local" / "state"),
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1",
            "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
            "OPENCODE_DISABLE_SHARE": "1",
        }

    def unset_env(self) -> tuple[str, ...]:
        return ("OPENCODE_CONFIG", "OPENCODE_CONFIG_CONTENT", "OPENCODE_CONFIG_DIR")

    def prepare(self, home: Path, target: Target) -> None:
        cfg = self.config_dir(home)
        cfg.mkdir(parents=True, exist_ok=True)
        model = f"reef/{target.model}"
        write_json(cfg / "opencode.json", {
            "$schema": "https://opencode.ai/config.json",
            "provider": {"reef": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Reef",
                "options": {"baseURL": f"{target.base}/v1", "apiKey": "{env:REEF_TOKEN}",
                            **({"headers": {"x-reef-release-id": "{env:REEF_RELEASE_ID}"}}
                               if target.release_id else {})},
                "models": {target.model: {"name": f"{target.model} (Reef)",
                                          "limit": {"context": target.context_window, "output": 4096}}},
            }},
            "model": model,
            "small_model": model,
            "autoupdate": False,
            "share": "disabled",
        })
        self._pin_plugin(cfg)

    def argv(self, binary: Path, args: list[str], target: Target) -> list[str]:
        if args[:1] in (["-p"], ["--print"]):
            if len(args) < 2 or not args[1].split():
                raise BadRequest(f'{args[0]} needs a prompt: `reef-opencode -p "fix the bug"` (it runs `opencode run '
                                 'fix the bug`)', param="-p")
            args = ["run", *args[1].split(), *args[2:]]
        return [str(binary), *args]

    def _pin_plugin(self, cfg: Path) -> None:
        (cfg / "node_modules" / "@opencode-ai" / "plugin").mkdir(parents=True, exist_ok=True)
        pkg = {"dependencies": {"@opencode-ai/plugin": self.version}}
        lock = {"name": "opencode", "lockfileVersion": 3, "requires": True, "packages": {
            "": {"dependencies": {"@opencode-ai/plugin": self.version}},
            "node_modules/@opencode-ai/plugin": {"version": self.version},
        }}
        plugin_pkg = cfg / "node_modules" / "@opencode-ai" / "plugin" / "package.json"
        if not plugin_pkg.exists():
            plugin_pkg.write_text(json.dumps({"name": "@opencode-ai/plugin", "version": self.version}) + "\n")
        write_json(cfg / "package.json", pkg)
        write_json(cfg / "package-lock.json", lock)
