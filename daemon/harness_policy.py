"""The harness policy: what no automatic path may add to a harness that coding agents load.

Reef rewrites agents' rules, skills and commands from what agents propose (``daemon/proposals.py``), from written
feedback (``recipes/lessons.py``), from a proposer model (``recipes/harness_search/``) and from a chain remote it
follows (``daemon/releases/remote.py``). An agent that could grant itself tools through any of these would escape
the sandbox its user set (the 2026 class of configuration-based escapes), so every such path passes this one policy,
and the harness a wrapper installs is checked again where it is rendered (``daemon/harness.py``): a chain written
around the daemon is refused there too. ``docs/security.md`` lists each agent's files and each rule.

Each file a candidate adds or changes is read for:

- **control characters**: C0/C1 controls but tab and newline (a NUL in a rule), bidirectional overrides and
  isolates, invisible Unicode tag characters and zero-width marks: text a person reviewing the change cannot see.
- **frontmatter**: a Markdown file's leading ``---`` YAML block is what the agents read as a skill's or command's
  settings. Only ``name``, ``description``, ``argument-hint`` and ``license`` may appear. ``allowed-tools`` (and
  ``tools``) grant tools: a person may admit that (**review**). Any other key (``hooks``, ``permissions``,
  ``mcpServers``, ``env``, ``model``, ``agent``...) is refused, as is frontmatter that does not parse as a YAML
  mapping (what it grants cannot be told) and TOML (``+++``) frontmatter.
- **agents' settings files**: ``settings.json`` (the neutral layout's own, which no adapter renders) and, as a
  skill's file, any name an agent reads as configuration (``settings.json``, ``settings.local.json``,
  ``opencode.json``, ``config.toml``, ``.mcp.json``, ``hooks.json``, ``models.json``, ``auth.json``...).
- **executable content**: a script by its name, a ``#!`` line (also after frontmatter: a skill's text wrapped in
  frontmatter is still a script), or Claude Code's ``!`command``` pre-execution in a skill or command. Refused,
  unless the scenario allows executables, and then only a person may admit it (**review**).
- **imports from outside the tree**: ``@~/...``, ``@/...``, ``@../...`` (CLAUDE.md pulls the named file into the
  agent's context).
- **instructions to widen its own rights**: to disable or leave a sandbox, skip permission prompts
  (``--dangerously-skip-permissions``, ``bypassPermissions``, ``danger-full-access``, ``--yolo``...), or edit the
  agent's own configuration (``.claude/``, ``.codex/``, ``.pi/agent``, ``opencode.json``, ``.mcp.json``...).

A finding is ``refused`` (no automatic path admits it; ``review``: a candidate holding it is held for a person,
``reef releases promote ID``, and never published by the ``always`` gate). Symlinks, devices and paths outside the
layout cannot be expressed in a harness tree (``daemon/layout.py``; ``releases.Repository.walk`` refuses them in a
fetched release; ``adapters/base.install_harness`` never follows one on disk).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ALLOWED_KEYS = ("name", "description", "argument-hint", "license")
REVIEW_KEYS = ("allowed-tools", "tools")  # tool grants: a person may admit them
# names an agent reads as its own configuration, wherever a harness could put them
SETTINGS_NAMES = frozenset({
    "settings.json", "settings.local.json", "managed-settings.json", ".claude.json", "opencode.json",
    "opencode.jsonc", "config.toml", "config.json", "config.yaml", "config.yml", ".mcp.json", "mcp.json",
    "hooks.json", "models.json", "auth.json", "keybindings.json", "package.json", ".npmrc", ".env",
})
EXECUTABLE_SUFFIXES = (".sh", ".bash", ".zsh", ".fish", ".py", ".js", ".mjs", ".cjs", ".ts", ".mts", ".rb", ".pl",
                       ".php", ".exe", ".bin", ".so", ".dylib", ".ps1", ".bat", ".cmd", ".jar", ".wasm")
RULES = ("control", "frontmatter", "settings", "executable", "import", "rights")

_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\u200e\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069"
                      "\ufeff\U000e0000-\U000e007f]")
_FRONT = re.compile(r"\A---[ \t]*\r?\n(.*?)^---[ \t]*$", re.S | re.M)
_PRE_EXEC = re.compile(r"!`[^`\n]+`")
_IMPORT = re.compile(r"(?:^|\s)@(?:~|/|\.\./|\$HOME|\$\{HOME\})")
_RIGHTS = [
    (re.compile(r"(?i)dangerously[-_ ]?skip[-_ ]?permissions|dangerously[-_ ]?bypass|bypass[-_ ]?permissions"
                r"|danger[-_ ]full[-_ ]access|--yolo\b|\byolo mode\b|--full-auto\b|permission[-_ ]mode"
                r"|approval[-_ ]policy|sandbox[-_ ]mode|\bdefaultMode\b|--no-sandbox\b"),
     "it names a switch that turns off the agent's permission prompts or sandbox"),
    (re.compile(r"(?i)\b(?:disable|turn off|switch off|bypass|escape|leave|exit|skip|remove|ignore|get around|work "
                r"around|circumvent)\b[^.\n]{0,40}\b(?:sandbox|sandboxing|permission (?:prompts?|checks?|system)|"
                r"approvals?|approval prompts?|allowlist|deny ?list)"),
     "it tells the agent to turn off its sandbox or permission checks"),
    (re.compile(r"(?i)(?:^|[\s`'\"(/~$])(?:\.claude/|\.codex/|\.pi/agent|\.config/opencode|opencode\.jsonc?\b|"
                r"\.mcp\.json\b|settings\.local\.json\b|claude_config_dir|codex_home|pi_coding_agent_dir|"
                r"mcpservers\b|mcp_servers\b)"),
     "it names the agent's own configuration (an agent that edits it widens its own rights)"),
]
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


@dataclass(frozen=True)
class Finding:
    """One thing in one file: ``rule`` (one of ``RULES``), ``reason`` in words, ``review``: a person may admit it (a
    candidate holding it is held for review), else it is refused outright."""

    path: str
    rule: str
    reason: str
    review: bool = False

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "rule": self.rule, "reason": self.reason, "review": self.review}


def _key(k: object) -> str:
    """A frontmatter key as agents compare it: ``allowedTools``, ``allowed_tools`` and ``Allowed-Tools`` are one."""
    return _CAMEL.sub("-", str(k)).replace("_", "-").strip().lower()


def split_frontmatter(text: str) -> tuple[str | None, str]:
    """A Markdown file's YAML frontmatter (None: it has none) and its body. Leading blank space and a BOM are
    skipped, as lenient readers do; an opening ``---`` without a closing one is all frontmatter."""
    start = text.lstrip("\ufeff \t\r\n")
    if not start.startswith("---"):
        return None, text
    m = _FRONT.match(start)
    if m is None:
        return start[3:], ""
    return m.group(1), start[m.end():]


def executable(path: str, data: str) -> bool:
    """Whether a harness file holds something an agent would run: a script by its name, a ``#!`` line (before or
    after frontmatter), or a ``!`command``` pre-execution."""
    if path.lower().endswith(EXECUTABLE_SUFFIXES) or data.lstrip("\ufeff \t\r\n").startswith("#!"):
        return True
    _, body = split_frontmatter(data)
    return body.lstrip("\ufeff \t\r\n").startswith("#!") or bool(_PRE_EXEC.search(data))


def _frontmatter(path: str, data: str) -> list[Finding]:
    if data.lstrip("\ufeff \t\r\n").startswith("+++"):
        return [Finding(path, "frontmatter", "it has TOML (+++) frontmatter; only YAML frontmatter with "
                        f"{', '.join(ALLOWED_KEYS)} is allowed")]
    raw, _ = split_frontmatter(data)
    if raw is None:
        return []
    import yaml  # type: ignore[import-untyped]  # PyYAML ships no types (types-PyYAML is not a dependency)

    try:
        meta = yaml.safe_load(raw) if raw.strip() else {}
    except (yaml.YAMLError, RecursionError, ValueError) as e:
        why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        return [Finding(path, "frontmatter", f"its frontmatter does not parse as YAML ({why}), so what it grants "
                        "cannot be told")]
    if meta is None:
        return []
    if not isinstance(meta, dict):
        return [Finding(path, "frontmatter", "its frontmatter is not a mapping of keys")]
    out = []
    _, body = split_frontmatter(data)
    if body.lstrip("\ufeff \t\r\n").startswith(("---", "+++")):  # a block right after: a lenient reader's frontmatter
        out += _frontmatter(path, body)
    for k in meta:
        key = _key(k)
        if key in ALLOWED_KEYS:
            continue
        if key in REVIEW_KEYS:
            out.append(Finding(path, "frontmatter", f"its frontmatter grants tools ({k}: ...): only a person may "
                               "admit that", review=True))
        else:
            out.append(Finding(path, "frontmatter", f"its frontmatter sets {str(k)[:60]!r}, which a harness may not "
                               f"set (hooks, permissions, MCP servers, environment, model...; allowed: "
                               f"{', '.join(ALLOWED_KEYS)}, and tool grants for review)"))
    return out


def file_findings(path: str, data: str | bytes, *, allow_executable: bool = False) -> list[Finding]:
    """Everything in one harness file (its path in the neutral layout) that the policy refuses or holds."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            return [Finding(path, "control", "it is not UTF-8 text")]
    out: list[Finding] = []
    name = path.rsplit("/", 1)[-1]
    if path == "settings.json" or (path.startswith("skills/") and name.lower() in SETTINGS_NAMES):
        out.append(Finding(path, "settings", f"{name} is a file agents read as their own settings; a harness change "
                           "may not write one"))
    c = _CONTROL.search(data)
    if c is not None:
        line = data.count("\n", 0, c.start()) + 1
        out.append(Finding(path, "control", f"it holds the control or invisible character U+{ord(c.group()):04X} "
                           f"(line {line})"))
    if path.lower().endswith(".md"):
        out += _frontmatter(path, data)
    if executable(path, data):
        what = ("a command Claude Code runs when the file loads (!`...`)" if _PRE_EXEC.search(data)
                and not path.lower().endswith(EXECUTABLE_SUFFIXES) else "executable content (a script)")
        out.append(Finding(path, "executable", f"it is {what}" + ("; only a person may admit it" if allow_executable
                           else "; this scenario does not allow it (setting allow_executable)"),
                           review=allow_executable))
    if _IMPORT.search(data):
        out.append(Finding(path, "import", "it imports a file from outside the harness (@~/, @/, @../) into the "
                           "agent's context"))
    for pattern, why in _RIGHTS:
        if pattern.search(data):
            out.append(Finding(path, "rights", why))
            break
    return out


def findings(tree: Mapping[str, bytes], parent: Mapping[str, bytes] | None = None, *,
             allow_executable: bool = False) -> list[Finding]:
    """What the policy finds in the files of ``tree`` that are new or changed against ``parent`` (None: every
    file), in path order."""
    out: list[Finding] = []
    for path in sorted(tree):
        if parent is not None and parent.get(path) == tree[path]:
            continue
        out += file_findings(path, tree[path], allow_executable=allow_executable)
    return out


def refused(found: list[Finding]) -> list[Finding]:
    return [f for f in found if not f.review]


def held(found: list[Finding]) -> list[Finding]:
    return [f for f in found if f.review]


def check_served(tree: Mapping[str, bytes], *, release: str | None = None) -> None:
    """Refuse to hand a harness to an agent when any of its files breaks the policy outright (a release written
    around the daemon, or published before this policy): ``HarnessRefused`` naming the file and the rule. What only
    a person may admit (a tool grant) serves: a release holding it was promoted by one."""
    from daemon.errors import HarnessRefused

    bad = refused(findings(tree, allow_executable=True))
    if bad:
        raise HarnessRefused(f"harness release {release or '?'} is refused by the harness policy: {bad[0]}"
                             + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
                             + "; roll the scenario back to a release without it (reef releases rollback)",
                             release=release, findings=[f.to_dict() for f in bad])
