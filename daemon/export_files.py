"""The files ``reef records export`` writes from the export's lines (``daemon/export.py``): the two shapes TRL
documents for conversations, in JSON Lines or Parquet.

- ``prompt-completion`` (the default): ``prompt`` and ``completion`` as lists of messages, the line as the daemon
  wrote it. TRL's SFT, KTO (with ``label``) and GRPO-style trainers read it as it is.
- ``messages``: one ``messages`` list, the prompt then the completion (TRL's conversational language-modeling
  shape); ``prompt``, ``completion`` and ``label`` are left out (TRL takes a label only beside a prompt and a
  completion), ``score`` stays. ``reef records import`` reads it back, the completion being
  the messages after the last user or system message.

Parquet holds the same rows with typed columns: messages as a list of structs (``role``, ``content``,
``tool_calls``, ``tool_call_id``: a key a message lacks is null), ``score`` a float, ``label`` a bool (null where
unscored), ``reports`` a list of structs (a structured feedback as JSON text), ``tools`` JSON text as in JSON Lines
(each tool's schema has its own shape, which one column cannot hold; TRL's trainers decode it), token ids and
log-probs as lists. ``datasets.load_dataset("parquet", ...)`` and ``("json", ...)`` read both files.
"""

from __future__ import annotations

import json
from typing import Any

SHAPES = ("prompt-completion", "messages")


def as_shape(line: dict[str, Any], shape: str) -> dict[str, Any]:
    """One export line in ``shape`` (``SHAPES``)."""
    if shape == "prompt-completion":
        return line
    out: dict[str, Any] = {}
    for k, v in line.items():
        if k == "prompt":
            out["messages"] = (line["prompt"] or []) + (line["completion"] or [])
        elif k not in ("completion", "label"):  # a label goes with a prompt and completion (KTO), not with messages
            out[k] = v
    return out


def split_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A ``messages`` line's prompt and completion: the completion is what follows the last user or system
    message (the assistant's turn, its tool calls and their results)."""
    cut = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") in ("user", "system")),
              default=-1) + 1
    return messages[:cut], messages[cut:]


def parquet_schema(pa: Any, shape: str) -> Any:
    call = pa.struct([("id", pa.string()), ("type", pa.string()),
                      ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
    message = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()),
                                  ("tool_calls", pa.list_(call)), ("tool_call_id", pa.string())]))
    pc = shape == "prompt-completion"
    talk = [("prompt", message), ("completion", message)] if pc else [("messages", message)]
    return pa.schema([
        ("id", pa.string()), ("scenario", pa.string()), ("run", pa.string()), ("created_at", pa.float64()),
        ("model", pa.string()), ("release_id", pa.string()), ("format", pa.string()), ("status", pa.string()),
        *talk, ("tools", pa.string()), ("score", pa.float64()), *([("label", pa.bool_())] if pc else []),
        ("reports", pa.list_(pa.struct([("score", pa.float64()), ("feedback", pa.string()),
                                        ("source", pa.string())]))),
        ("prompt_token_ids", pa.list_(pa.int32())), ("token_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
    ])


def parquet_row(line: dict[str, Any]) -> dict[str, Any]:
    """A line (already in its shape) as a Parquet row: a structured feedback as JSON text."""
    reports = [{**r, "feedback": r["feedback"] if r.get("feedback") is None or isinstance(r["feedback"], str)
                else json.dumps(r["feedback"], ensure_ascii=False)} for r in line.get("reports") or []]
    return {**line, "reports": reports}
