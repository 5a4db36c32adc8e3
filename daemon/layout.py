"""The neutral harness layout: which files a harness release may hold, whatever recipe made it.

    AGENTS.md                 rules
    skills/<name>/<file>      skills (SKILL.md and the files it uses)
    commands/<name>.md        commands / prompt templates
    settings.json             agent-neutral settings

Every harness tree is checked against it where it is made (the learning loop, for any harness recipe) and where it
is read (the daemon's harness routes, the wrappers), so a tampered chain or a careless recipe cannot write outside
an agent's config home. Names are matched whole (``fullmatch``): ``"AGENTS.md\\n"`` is not ``AGENTS.md``.
"""

from __future__ import annotations

import re

from daemon.errors import BadRequest

RULES_FILE = "AGENTS.md"  # the rules: what every agent loads into its system prompt
SKILL_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # always fullmatch
_TOP_LEVEL = re.compile(r"(AGENTS\.md|settings\.json|skills/[a-z0-9][a-z0-9-]{0,62}/[A-Za-z0-9._-]{1,100}"
                        r"|commands/[A-Za-z0-9][A-Za-z0-9._-]{0,100}\.md)")
MAX_FILE_BYTES = 256 * 1024


def rules_of(tree: dict[str, bytes] | None) -> str:
    """A harness tree's rules file as text: what an agent reads into its system prompt."""
    return (tree or {}).get(RULES_FILE, b"").decode("utf-8", "replace")


def check_tree_path(path: str) -> str:
    """A path allowed in a harness tree: relative, inside the tree, one of the known kinds of file."""
    if (
        not isinstance(path, str)
        or not path
        or "\x00" in path
        or "\\" in path
        or path.startswith("/")
        or any(part in ("", ".", "..") for part in path.split("/"))
        or not _TOP_LEVEL.fullmatch(path)
    ):
        raise BadRequest(
            f"harness path {path!r} is not allowed: paths are relative, stay inside the tree, and are one of "
            "AGENTS.md, settings.json, skills/<name>/<file>, commands/<name>.md",
            param="path",
        )
    return path


def check_tree(tree: dict[str, bytes]) -> None:
    for path, data in tree.items():
        check_tree_path(path)
        if len(data) > MAX_FILE_BYTES:
            raise BadRequest(f"harness file {path} is {len(data)} bytes; the limit is {MAX_FILE_BYTES}", param="path")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(f"harness file {path} is not UTF-8 text", param="path") from None
