"""Sessions: which earlier turn a new exchange continues, and what came next after that turn.

Recipes that learn from ordinary use (``openclaw-rl``) judge each assistant turn by its *next state*: the user's
next message, or the tool results that follow it. This module finds, for a newly served exchange, the turn it
continues, in memory and in O(turns in the request):

- Continuation: a request continues an earlier turn when its messages start with that turn's request messages
  followed by its answer (the assistant message the client echoes back). Each served turn is indexed under a
  digest of ``messages + answer``; a new request looks up the digest of its prefix ending at each assistant
  message, longest first. What follows the matched prefix is the next state.
- Scope: turns are looked up within their scenario and session: the ``x-reef-session`` header, or an agent's own
  session header (Claude Code's ``x-claude-code-session-id``, opencode's ``x-session-id``, pi's ``session_id``,
  Codex's ``session-id``), or the run id; none of those: the scenario as a whole (continuation alone decides).
- Retry: a request in the same session that does not continue the session's last turn but asks its last user
  message again is a retry of that turn (a bad sign for it).
- Digests cover role, text, tool calls (name and arguments, keys sorted) and tool results, not ids or thinking
  (clients rewrite ids across formats and drop thinking). The index is bounded (least recently used turns go) and
  in memory: after a restart, turns served before it are not continued (their reports still count).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from daemon.exchange import Message, ToolCall

SESSION_HEADERS = ("x-reef-session", "x-claude-code-session-id", "x-session-id", "session_id", "session-id")


@dataclass(frozen=True)
class Turn:
    """One served assistant turn: the request's messages and the answer."""

    receipt: str
    session: str | None
    messages: tuple[Message, ...]
    text: str
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def last_user(self) -> str:
        return next((m.text for m in reversed(self.messages) if m.role == "user"), "")

    def answer_text(self) -> str:
        calls = "".join(f"\n[tool call {c.name} {c.arguments}]" for c in self.tool_calls)
        return (self.text + calls).strip()


@dataclass(frozen=True)
class NextState:
    """What came after a turn: the messages that followed its answer, or a retry of its request."""

    messages: tuple[Message, ...] = ()
    retry: bool = False

    @property
    def user_text(self) -> str:
        return "\n".join(m.text for m in self.messages if m.role == "user" and m.text.strip())

    @property
    def tool_results(self) -> list[tuple[str, bool]]:
        """(text, is_error) of each tool result that followed."""
        return [(p.text, p.is_error) for m in self.messages for p in m.parts if p.type == "tool_result"]

    def describe(self) -> str:
        if self.retry:
            return "The user sent the same request again."
        out = []
        for m in self.messages:
            for p in m.parts:
                if p.type == "tool_result":
                    out.append(f"[tool result{' (error)' if p.is_error else ''}] {p.text}")
                elif p.type == "text" and p.text.strip():
                    out.append(f"[{m.role}] {p.text}")
        return "\n".join(out)


def session_key(headers: Mapping[str, str], run: str | None) -> str | None:
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return f"{name}={value}"
    return f"run={run}" if run else None


def _canon_message(m: Message) -> list[Any]:
    parts: list[Any] = []
    for p in m.parts:
        if p.type == "text" and p.text.strip():
            parts.append(["text", p.text.strip()])
        elif p.type == "tool_call":
            parts.append(["call", p.name, _canon_args(p.arguments)])
        elif p.type == "tool_result":
            parts.append(["result", p.text.strip(), bool(p.is_error)])
    return [m.role, parts]


def _canon_args(arguments: str | None) -> Any:
    try:
        return json.loads(arguments or "{}")
    except ValueError:
        return arguments


def _answer_message(text: str, calls: Sequence[ToolCall]) -> list[Any]:
    parts: list[Any] = [["text", text.strip()]] if text.strip() else []
    parts += [["call", c.name, _canon_args(c.arguments)] for c in calls]
    return ["assistant", parts]


def _digest(items: list[list[Any]]) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


@dataclass
class SessionIndex:
    """Served turns by the digest of ``messages + answer``, and each session's last turn; bounded LRU."""

    capacity: int = 4096
    _turns: OrderedDict[tuple[str, str], Turn] = field(default_factory=OrderedDict)
    _last: OrderedDict[tuple[str, str | None], Turn] = field(default_factory=OrderedDict)

    def follow(self, scenario: str, turn: Turn) -> tuple[Turn, NextState] | None:
        """Index ``turn`` and return the earlier turn it continues (or retries) with its next state."""
        canon = [_canon_message(m) for m in turn.messages]
        found = None
        for i in range(len(canon) - 1, -1, -1):  # the longest prefix that ends with an answer we served
            if canon[i][0] != "assistant":
                continue
            prev = self._turns.get((scenario, _digest(canon[: i + 1])))
            if prev is not None and (prev.session is None or turn.session is None or prev.session == turn.session):
                found = (prev, NextState(messages=tuple(turn.messages[i + 1:])))
                break
        if found is None and turn.session is not None:
            last = self._last.get((scenario, turn.session))
            if last is not None and last.last_user and last.last_user == turn.last_user:
                found = (last, NextState(retry=True))
        key = (scenario, _digest([*canon, _answer_message(turn.text, turn.tool_calls)]))
        self._turns[key] = turn
        self._turns.move_to_end(key)
        self._last[(scenario, turn.session)] = turn
        self._last.move_to_end((scenario, turn.session))
        for d in (self._turns, self._last):
            while len(d) > self.capacity:
                d.popitem(last=False)
        return found
