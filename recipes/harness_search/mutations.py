"""Tree mutations: the strict JSON form a proposer answers in, its parser, the screens, and applying them.

The form (one JSON object, optionally inside one ```json fence, nothing else)::

    {"mutations": [
      {"op": "create", "kind": "rule", "id": "run-tests-first", "text": "Run the tests before editing.",
       "reason": "runs 2 and 3 edited code and never ran the tests"},
      {"op": "update", "kind": "rule", "id": "r-3f2a9c1d", "text": "...", "reason": "..."},
      {"op": "remove", "kind": "rule", "id": "answer-in-french", "reason": "every run that followed it failed"},
      {"op": "create", "kind": "skill", "id": "pytest-debugging",
       "files": {"SKILL.md": "---\\nname: pytest-debugging\\n...", "notes.md": "..."}, "reason": "..."},
      {"op": "update", "kind": "command", "id": "fix-tests", "text": "...", "reason": "..."}
    ]}

- ``op``: create | update | remove; ``kind``: rule | skill | command; ``id``: a-z, 0-9 and - (at most 63), the
  entry's id; ``reason``: why (required, at most 500 characters). No other keys.
- rules: one ``- [id] text`` entry each under AGENTS.md's ``## Lessons`` heading (an entry written without an id,
  e.g. by ``lessons``, has the id ``r-`` + 8 hex digits of its text's SHA-1); ``text`` is one line (whitespace is
  collapsed). skills: ``skills/<id>/<file>``; ``files`` maps file names (no ``/``) to text, ``SKILL.md`` required
  on create; update replaces the whole folder. commands: ``commands/<id>.md`` with ``text``.
- create of an id that exists, update or remove of one that does not, and two mutations of one id are refused.

Screens (every text and file): what ``lessons`` refuses (secrets, sending files or credentials anywhere), paths
outside the tree (the layout's ``check_tree_path``), the harness policy (``daemon/harness_policy.py``: frontmatter
that grants tools or sets hooks, permissions, MCP servers or environment, agents' settings files, control
characters, imports from outside the tree, instructions to turn off a sandbox; a tool grant only a person may
admit, so the candidate is held for review), executable content (scripts by name, a ``#!`` line, before or after
frontmatter) unless the scenario allows it, and then the candidate is only held for review, and size caps per
file and per tree. One refused mutation refuses the whole proposal: a proposal is applied whole or not at all, and a refused
one is written down with its reason.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from daemon import harness_policy
from daemon.layout import RULES_FILE, SKILL_NAME, check_tree, check_tree_path, rules_of
from recipes.lessons import parse_rules, render_rules, screen, similarity

OPS = ("create", "update", "remove")
KINDS = ("rule", "skill", "command")
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_ENTRY = re.compile(r"\[([a-z0-9][a-z0-9-]{0,62})\] (.+)")
_FENCE = re.compile(r"\A```(?:json)?\s*\n(.*)\n```\Z", re.S)
EXECUTABLE_SUFFIXES = harness_policy.EXECUTABLE_SUFFIXES


SCREENS = ("paths", "secrets", "size", "rights", "executable")  # what ``screened`` checks, by name


class Refused(Exception):
    """A proposal that is malformed or does not pass a screen; ``reason`` says which and where, ``screen`` names the
    screen it failed (one of ``SCREENS``; None: malformed, or an entry that is or is not there)."""

    def __init__(self, reason: str, screen: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.screen = screen


@dataclass(frozen=True)
class Mutation:
    op: str
    kind: str
    id: str
    reason: str
    text: str | None = None
    files: dict[str, str] | None = None

    def view(self) -> dict[str, Any]:
        """A short account for verdicts and events."""
        return {"op": self.op, "kind": self.kind, "id": self.id, "reason": self.reason[:200]}


@dataclass(frozen=True)
class Limits:
    max_mutations: int = 8
    max_file_bytes: int = 16 * 1024
    max_tree_bytes: int = 128 * 1024
    max_rule_chars: int = 600
    allow_executable: bool = False
    similarity: float = 0.6  # a created rule or skill this similar to an existing one replaces / merges into it


@dataclass
class Applied:
    tree: dict[str, bytes]
    mutations: list[dict[str, Any]] = field(default_factory=list)
    executable: list[str] = field(default_factory=list)  # paths holding executable content (allowed: review)
    review: list[str] = field(default_factory=list)  # what only a person may admit (the policy's review findings)


# --- parsing -----------------------------------------------------------------------------------------------------


def parse(answer: str, limits: Limits = Limits()) -> list[Mutation]:
    """The mutations in a proposer's answer; ``Refused`` with the reason when it is not the documented form."""
    text = answer.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise Refused(f"the answer is not one JSON object: {str(e)[:120]}") from None
    if not isinstance(body, dict) or set(body) != {"mutations"}:
        raise Refused('the answer must be {"mutations": [...]} and nothing else')
    items = body["mutations"]
    if not isinstance(items, list) or not items:
        raise Refused("mutations must be a non-empty list")
    if len(items) > limits.max_mutations:
        raise Refused(f"{len(items)} mutations; at most {limits.max_mutations} per proposal")
    out = [_mutation(i, item, limits) for i, item in enumerate(items)]
    seen: set[tuple[str, str]] = set()
    for m in out:
        if (m.kind, m.id) in seen:
            raise Refused(f"two mutations of {m.kind} {m.id!r}")
        seen.add((m.kind, m.id))
    return out


def _mutation(i: int, item: Any, limits: Limits) -> Mutation:
    where = f"mutation {i}"
    if not isinstance(item, dict):
        raise Refused(f"{where} is not an object")
    op, kind, id_, reason = item.get("op"), item.get("kind"), item.get("id"), item.get("reason")
    if op not in OPS:
        raise Refused(f"{where}: op must be one of {', '.join(OPS)}, not {op!r}")
    if kind not in KINDS:
        raise Refused(f"{where}: kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if not isinstance(id_, str) or not SKILL_NAME.fullmatch(id_):
        raise Refused(f"{where}: id {id_!r} is not a-z, 0-9 and - (at most 63 characters)")
    if not isinstance(reason, str) or not reason.strip() or len(reason) > 500:
        raise Refused(f"{where}: reason is required (text, at most 500 characters)")
    allowed = {"op", "kind", "id", "reason"} | ({"files"} if kind == "skill" else {"text"}) if op != "remove" \
        else {"op", "kind", "id", "reason"}
    extra = sorted(set(item) - allowed)
    if extra:
        raise Refused(f"{where}: unknown or misplaced keys {', '.join(extra)} for {op} {kind}")
    text, files = item.get("text"), item.get("files")
    if op != "remove" and kind != "skill":
        if not isinstance(text, str) or not text.strip():
            raise Refused(f"{where}: {op} {kind} needs text")
        if kind == "rule":
            text = " ".join(text.split())
            if len(text) > limits.max_rule_chars:
                raise Refused(f"{where}: rule is {len(text)} characters; the limit is {limits.max_rule_chars}")
    if op != "remove" and kind == "skill":
        if not isinstance(files, dict) or not files:
            raise Refused(f"{where}: {op} skill needs files (an object of file name -> text)")
        for name, data in files.items():
            if not FILE_NAME.fullmatch(name) or name in (".", ".."):
                raise Refused(f"{where}: skill file name {name!r} is not allowed (a plain name, no /)")
            if not isinstance(data, str):
                raise Refused(f"{where}: skill file {name} must be text")
        if op == "create" and "SKILL.md" not in files:
            raise Refused(f"{where}: a new skill needs SKILL.md")
    return Mutation(op, kind, id_, reason.strip(), text=text, files=dict(files) if files else None)


# --- screening -----------------------------------------------------------------------------------------------


executable = harness_policy.executable


def screened(m: Mutation, limits: Limits) -> tuple[tuple[str, str] | None, list[str], list[str]]:
    """The screen ``m`` fails (its name in ``SCREENS``) and why, or None when it may enter a harness; the
    executable paths it writes; and what in it only a person may admit (the harness policy's review findings)."""
    texts: list[tuple[str, str]] = []
    if m.text is not None:
        texts.append((_path(m.kind, m.id), m.text))
    for name, data in (m.files or {}).items():
        texts.append((f"skills/{m.id}/{name}", data))
    if m.kind == "rule" and m.text is not None and len(m.text) > limits.max_rule_chars:
        return ("size", f"rule {m.id}: {len(m.text)} characters; the limit is {limits.max_rule_chars}"), [], []
    executables: list[str] = []
    review: list[str] = []
    for path, data in texts:
        try:
            check_tree_path(path)
        except Exception:
            return ("paths", f"{m.kind} {m.id}: path {path!r} is outside the harness layout"), [], []
        reason = screen(data) or screen(path)
        if reason is not None:
            return ("secrets", f"{m.kind} {m.id}: {reason}"), [], []
        if len(data.encode()) > limits.max_file_bytes:
            return ("size", f"{m.kind} {m.id}: {path} is {len(data.encode())} bytes; the limit is "
                    f"{limits.max_file_bytes}"), [], []
        found = harness_policy.file_findings(path, data, allow_executable=limits.allow_executable)
        for f in harness_policy.refused(found):
            return ("executable" if f.rule == "executable" else "rights", f"{m.kind} {m.id}: {f}"), [], []
        review += [str(f) for f in found]
        if any(f.rule == "executable" for f in found):
            executables.append(path)
    reason = screen(m.reason)
    if reason is not None:
        return ("secrets", f"{m.kind} {m.id}: its reason: {reason}"), [], []
    hidden = [f for f in harness_policy.file_findings("reason", m.reason) if f.rule == "control"]
    if hidden:  # the reason never enters the harness, but a person reviewing the change reads it
        return ("rights", f"{m.kind} {m.id}: its reason: {hidden[0].reason}"), [], []
    return None, executables, review


def screen_mutation(m: Mutation, limits: Limits) -> tuple[str | None, list[str]]:
    """Why ``m`` must not enter a harness (None: it may), and the executable paths it writes."""
    failed, executables, _ = screened(m, limits)
    return (failed[1] if failed else None), executables


def _path(kind: str, id_: str) -> str:
    return {"rule": RULES_FILE, "command": f"commands/{id_}.md", "skill": f"skills/{id_}/SKILL.md"}[kind]


# --- the tree's entries ----------------------------------------------------------------------------------------


def rule_id(text: str) -> str:
    return "r-" + hashlib.sha1(text.encode()).hexdigest()[:8]


def rules(tree: dict[str, bytes]) -> tuple[str, list[tuple[str, str]]]:
    """AGENTS.md's text before the rules, and its rules as (id, text)."""
    prefix, entries = parse_rules(rules_of(tree))
    out = []
    for e in entries:
        m = _ENTRY.fullmatch(e)
        out.append((m.group(1), m.group(2)) if m else (rule_id(e), e))
    return prefix, out


def skills(tree: dict[str, bytes]) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    for path, data in tree.items():
        if path.startswith("skills/"):
            _, name, file = path.split("/", 2)
            out.setdefault(name, {})[file] = data
    return out


def entries(tree: dict[str, bytes]) -> dict[str, set[str]]:
    """The ids of each kind of entry in a tree."""
    return {"rule": {i for i, _ in rules(tree)[1]}, "skill": set(skills(tree)),
            "command": {p[len("commands/"):-3] for p in tree if p.startswith("commands/")}}


def tree_bytes(tree: dict[str, bytes]) -> int:
    return sum(len(p) + len(d) for p, d in tree.items())


def apply(tree: dict[str, bytes], mutations: list[Mutation], limits: Limits = Limits()) -> Applied:
    """The tree after every mutation, or ``Refused`` (nothing applied) when one does not pass."""
    out = Applied(tree=dict(tree))
    prefix, rule_list = rules(out.tree)
    rules_changed = False
    for m in mutations:
        failed, execs, review = screened(m, limits)
        if failed is not None:
            raise Refused(failed[1], screen=failed[0])
        out.executable += execs
        out.review += review
        have = {i for i, _ in rule_list} if m.kind == "rule" else entries(out.tree)[m.kind]
        view = m.view()
        if m.op == "create" and m.id in have:
            raise Refused(f"{m.kind} {m.id!r} exists already; update it instead")
        if m.op != "create" and m.id not in have:
            raise Refused(f"there is no {m.kind} {m.id!r} to {m.op} (have: {', '.join(sorted(have)) or 'none'})")
        if m.kind == "rule":
            rules_changed = True
            if m.op == "remove":
                rule_list = [(i, t) for i, t in rule_list if i != m.id]
            elif m.op == "update":
                text = m.text
                assert text is not None  # an update of a rule carries its text (parse refuses one without)
                rule_list = [(i, text if i == m.id else t) for i, t in rule_list]
            else:
                assert m.text is not None
                near = max(rule_list, key=lambda e: similarity(m.text or "", e[1]), default=None)
                if near is not None and similarity(m.text, near[1]) >= limits.similarity:
                    rule_list = [e for e in rule_list if e[0] != near[0]]  # a near-duplicate: the new one replaces it
                    view["merged"] = near[0]
                rule_list.append((m.id, m.text))
        elif m.kind == "command":
            path = f"commands/{m.id}.md"
            if m.op == "remove":
                del out.tree[path]
            else:
                out.tree[path] = (m.text or "").encode()
        else:
            target = m.id
            current = skills(out.tree)
            if m.op == "create":
                new = (m.files or {}).get("SKILL.md", "")
                nearest = max(current, key=lambda s: similarity(new, current[s].get("SKILL.md", b"").decode()),
                              default=None)
                if nearest is not None and similarity(new, current[nearest].get("SKILL.md", b"").decode()) >= \
                        limits.similarity:
                    target = nearest  # merged with its near-duplicate: the new files over the old folder
                    view["merged"] = nearest
            for path in [p for p in out.tree if p.startswith(f"skills/{target}/")]:
                if m.op != "create" or target == m.id:
                    del out.tree[path]
            for name, data in (m.files or {}).items():
                out.tree[f"skills/{target}/{name}"] = data.encode()
        out.mutations.append(view)
    if rules_changed:
        text = render_rules(prefix, [f"[{i}] {t}" for i, t in rule_list]) if rule_list or prefix.strip() else ""
        if text:
            out.tree[RULES_FILE] = text.encode()
        else:
            out.tree.pop(RULES_FILE, None)
    size = tree_bytes(out.tree)
    if size > limits.max_tree_bytes:
        raise Refused(f"the tree would be {size} bytes; the limit is {limits.max_tree_bytes}", screen="size")
    try:
        check_tree(out.tree)
    except Exception as e:  # the layout's own caps (file size, UTF-8)
        raise Refused(str(getattr(e, "message", e)), screen="size") from None
    return out
