"""The proposer: a configured model asked, in one documented prompt, for mutations of a harness tree.

The prompt (``PROPOSER_SYSTEM`` as the system message; ``proposer_prompt`` builds the user message) holds:

1. the current harness tree: AGENTS.md's rules with their ids, every skill's files, every command;
2. the runs that went badly: each report's score and feedback, and the run's recorded exchanges (the messages
   of its last request, tool calls and tool results included, and the answer), cut to a size cap;
3. the instructions given with ``evolve`` (reports of kind ``instruction``);
4. the scenario's tasks (id and prompt) with the scores the parent tree had on them, when the pool knows them.

It answers with the JSON form of ``mutations.py``; anything else is refused there, written down, and the next
step asks again.
"""

from __future__ import annotations

import json
from typing import Any

from recipes.harness_search.mutations import rules, skills

PROPOSER_SYSTEM = """You improve the harness of a coding agent: its rules (AGENTS.md), skills and commands.
You see the current harness, runs that went badly (with the user's feedback and what the agent did), and the
user's instructions. Propose changes that would have made those runs go well. Removing a wrong or useless rule,
and rewriting two rules into one better one, are as normal as adding one. Keep the harness short.

Answer with one JSON object and nothing else:
{"mutations": [{"op": "create" | "update" | "remove", "kind": "rule" | "skill" | "command", "id": "<a-z0-9->",
  "text": "<rule or command text>", "files": {"SKILL.md": "<text>", "<name>": "<text>"}, "reason": "<why>"}]}
Rules and commands take "text", skills take "files" (SKILL.md required for a new skill), remove takes neither.
Every mutation needs a reason. Never include secrets, credentials, URLs to send data to, or scripts."""


def render_tree(tree: dict[str, bytes]) -> str:
    prefix, rule_list = rules(tree)
    out = ["### Rules (AGENTS.md)"]
    out += [f"- [{i}] {t}" for i, t in rule_list] or ["(none)"]
    for name, files in sorted(skills(tree).items()):
        for file, data in sorted(files.items()):
            out.append(f"### Skill {name}: {file}\n{data.decode('utf-8', 'replace')}")
    for path in sorted(p for p in tree if p.startswith("commands/")):
        out.append(f"### Command {path[len('commands/'):-3]}\n{tree[path].decode('utf-8', 'replace')}")
    return "\n".join(out)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 15] + " ...[cut]"


def _message(m: dict[str, Any], limit: int) -> str:
    """One chat message as a line: its text, and its tool calls with their arguments."""
    content = m.get("content")
    if isinstance(content, list):
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    text = str(content or "")
    for c in m.get("tool_calls") or []:
        if isinstance(c, dict):
            fn = c.get("function") or {}
            text += f" [tool call {fn.get('name')} {fn.get('arguments')}]"
    return f"{m.get('role')}: {_cut(text.strip(), limit)}"


def render_exchange(record: dict[str, Any], limit: int) -> str:
    """A recorded exchange as the proposer reads it: the request's messages after the system prompt (which is the
    harness, shown above), tool calls and tool results included, then the answer."""
    body = record.get("request") or {}
    messages = body.get("messages") if isinstance(body, dict) else None
    lines = [_message(m, limit // 4) for m in (messages or [])
             if isinstance(m, dict) and m.get("role") not in ("system", "developer")]
    response = record.get("response")
    if isinstance(response, dict):
        choices = response.get("choices")
        message = choices[0].get("message") if isinstance(choices, list) and choices and \
            isinstance(choices[0], dict) else None
        lines.append("answer: " + (_message(message, limit // 4) if isinstance(message, dict)
                                   else _cut(json.dumps(response, ensure_ascii=False), limit // 4)))
    return _cut("\n".join(lines), limit)


def proposer_prompt(tree: dict[str, bytes], bad_runs: list[dict[str, Any]], instructions: list[str],
                    tasks: list[dict[str, Any]], limit: int = 24_000) -> str:
    """The user message of a proposer call. ``bad_runs``: {report, score, feedback, exchanges: [text]}."""
    parts = ["## Current harness", render_tree(tree), "", "## Runs that went badly"]
    if not bad_runs:
        parts.append("(none)")
    for i, run in enumerate(bad_runs, 1):
        parts.append(f"### Run {i} (report {run['report']}, score {run.get('score')})\n"
                     f"Feedback: {run.get('feedback') or '(none)'}")
        parts += run.get("exchanges", [])
    parts += ["", "## Instructions"] + ([f"- {x}" for x in instructions] or ["(none)"])
    if tasks:
        parts += ["", "## Tasks the harness is judged on (score of the current harness: 1 passed, 0 failed)"]
        parts += [f"- {t['id']}: {t['prompt'][:300]} (score {t.get('score', 'unknown')})" for t in tasks]
    return _cut("\n".join(parts), limit)
