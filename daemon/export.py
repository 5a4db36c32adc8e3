"""Records out and in: the shape training tools read (``reef records export``, ``reef records import``).

One JSON object per exchange, TRL's conversational prompt-completion form with the feedback beside it::

    {"id": "rec_...", "scenario": "pi", "run": "run_...", "created_at": 1764700000.0, "model": "smollm2",
     "release_id": "...", "format": "openai-chat",
     "prompt": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "completion": [{"role": "assistant", "content": "...", "tool_calls": [...]}],
     "score": 1.0, "label": true,
     "reports": [{"score": 1.0, "feedback": "...", "created_at": ..., "source": null}],
     "prompt_token_ids": [...], "token_ids": [...], "logprobs": [...]}

``score`` is the latest report's score (None: unscored), ``label`` whether it is at least 0.5 (KTO's form; None when
unscored); token ids and log-probs are there when the engine recorded them (None otherwise). Hugging Face
``datasets`` reads the JSON Lines file (``load_dataset("json", data_files=...)``) or the Parquet file as they are.

Import takes the same objects (``prompt`` and ``completion`` required; ``id``, ``scenario``, ``model``,
``score``, ``feedback`` optional): an exchange per line, idempotent by id (a line without one gets an id from its
content), a report when it carries a score or feedback.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from daemon.errors import BadRequest
from daemon.jsontext import take_apart
from daemon.records import ExchangeRecord

if TYPE_CHECKING:
    from daemon.protocols.base import WireFormat

def _protocol(fmt: str | None) -> WireFormat | None:
    from daemon.protocols.formats import FORMATS

    return FORMATS.get(fmt or "")


def _message(role: str, text: str, tool_calls: list[Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"role": role, "content": text}
    if tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                          "arguments": c.arguments}}
                             for c in tool_calls]
    return out


def render_lines(records: list[dict[str, Any]]) -> bytes:
    """Records (``RecordStore.export_page``) as JSON Lines in the export shape, taking them out of ``records`` one
    by one (each freed here, not where the list is dropped). Run in a worker thread: a record of 200,000 messages
    is rendered in short pieces (``daemon/jsontext.py``), with the collector off (a full collection over what it
    became held the GIL 0.5 s)."""
    from daemon.jsontext import QUIET, dumpb

    out = []
    with QUIET.building():
        records.reverse()
        while records:
            trash = [records.pop()]
            line = to_line(trash[0])
            out.append(dumpb(line) + b"\n")
            trash.append(line)
            del line
            take_apart(trash)  # what a record of 200,000 messages became: freed a slice at a time
    return b"".join(out)


def to_line(rec: dict[str, Any]) -> dict[str, Any]:
    """One exchange record (``RecordStore.get_record`` shape, reports included) in the export shape."""
    proto = _protocol(rec.get("format"))
    prompt: list[dict[str, Any]] | None = None
    completion: list[dict[str, Any]] | None = None
    if proto is not None and isinstance(rec.get("request"), dict):
        try:
            parsed = [proto.parse_request(rec["request"])]
            prompt = [_message(m.role, m.text) for m in parsed[0].messages]  # system messages are messages here
            take_apart(parsed)  # 200,000 parsed messages freed at once held the GIL 0.1 s
        except Exception:  # a request recorded as it came, then refused: no prompt to give
            prompt = None
    response = rec.get("response")
    if proto is not None and isinstance(response, dict) and "error" not in response:
        try:
            c = proto.parse_response({k: v for k, v in response.items() if k != "reef"})
            completion = [_message("assistant", c.text or "", list(c.tool_calls))]
        except Exception:  # an answer in a shape the protocol does not parse back: no completion to give
            completion = None
    reports = [r["report"] for r in rec.get("reports") or [] if isinstance(r.get("report"), dict)]
    scored = [r for r in reports if isinstance(r.get("score"), (int, float))]
    score = float(scored[-1]["score"]) if scored else None
    return {
        "id": rec["id"], "scenario": rec["scenario"], "run": rec.get("run"), "created_at": rec.get("created_at"),
        "model": rec.get("model"), "release_id": rec.get("release_id"), "format": rec.get("format"),
        "status": rec.get("status"), "prompt": prompt, "completion": completion, "score": score,
        "label": None if score is None else score >= 0.5,
        "reports": [{"score": r.get("score"), "feedback": r.get("feedback"),
                     "source": (r.get("metadata") or {}).get("source") if isinstance(r.get("metadata"), dict)
                     else None} for r in reports],
        "prompt_token_ids": rec.get("prompt_token_ids"), "token_ids": rec.get("token_ids"),
        "logprobs": rec.get("logprobs"),
    }


def _messages(value: Any, key: str, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{where}: {key} must be a non-empty list of messages", param=key)
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRequest(f"{where}: each {key} message needs a role and a string content", param=key)
    return value


def from_line(item: Any, where: str, default_scenario: str) -> dict[str, Any]:
    """One imported object checked and made into an exchange record and its report (``report``: None when the
    line carries neither a score nor feedback). Raises ``BadRequest`` naming ``where``."""
    from daemon.names import check_scenario

    if not isinstance(item, dict):
        raise BadRequest(f"{where}: not a JSON object")
    prompt = _messages(item.get("prompt"), "prompt", where)
    completion = _messages(item.get("completion"), "completion", where)
    scenario = item.get("scenario") or default_scenario
    if not isinstance(scenario, str):
        raise BadRequest(f"{where}: scenario must be a string", param="scenario")
    check_scenario(scenario)
    score = item.get("score")
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
        raise BadRequest(f"{where}: score must be a number", param="score")
    feedback = item.get("feedback")
    if feedback is not None and not isinstance(feedback, str):
        raise BadRequest(f"{where}: feedback must be a string", param="feedback")
    rid = item.get("id")
    if rid is None:
        digest = hashlib.sha256(json.dumps([scenario, prompt, completion], sort_keys=True).encode()).hexdigest()
        rid = f"rec_imp_{digest[:32]}"
    if not (isinstance(rid, str) and rid.startswith("rec_") and 4 < len(rid) <= 100):
        raise BadRequest(f"{where}: id must be a receipt (rec_..., at most 100 characters)", param="id")
    model = item.get("model") if isinstance(item.get("model"), str) else "imported"
    created = item.get("created_at")
    record = ExchangeRecord(
        id=rid, scenario=scenario, run=item.get("run") if isinstance(item.get("run"), str) else None,
        status="complete", format="openai-chat", engine="import", model=model,
        request={"model": model, "messages": prompt},
        response={"object": "chat.completion", "model": model, "choices": [
            {"index": 0, "finish_reason": "stop", "message": completion[-1]}]},
        capture=True,
        **({"created_at": float(created)} if isinstance(created, (int, float)) and not isinstance(created, bool)
           else {}),
    )
    report = None
    if score is not None or feedback is not None:
        report = {"score": score, "feedback": feedback, "report_id": f"import:{rid}"}
    return {"record": record, "report": report}
