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

Import takes the same objects (``prompt`` and ``completion`` required; ``id``, ``scenario``, ``run``, ``model``,
``created_at``, ``score``, ``feedback`` optional): an exchange per line, idempotent by id (a line without one gets
an id from its scenario and content), a report when it carries a score or feedback. Each line meets the checks data
meets on every other way in (``from_line``), and a line that fails one refuses its whole batch, naming the line,
the item and the field: nothing the API refuses elsewhere is stored by an import.
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


def _messages(value: Any, key: str) -> list[dict[str, Any]]:
    from daemon.protocols.openai_chat import ROLES

    if not isinstance(value, list) or not value:
        raise BadRequest(f"{key} must be a non-empty list of messages", param=key)
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRequest(f"each {key} message needs a role and a string content", param=f"{key}[{i}]")
        if m["role"] not in ROLES:  # the roles a served chat request may have
            raise BadRequest(f"{key}[{i}].role: must be one of {', '.join(ROLES)}; got {m['role'][:40]!r}",
                             param=f"{key}[{i}].role")
    return value


MODEL_MAX = 200  # characters of an imported exchange's model name


def _created_at(value: Any) -> float | None:
    """An imported line's ``created_at`` (seconds since the epoch): None where it has none (the import's time); a
    date beyond this clock (plus ``CLOCK_SKEW_S``) is refused, since retention could not judge its age by it: most
    often a time in milliseconds."""
    import math
    import time

    from daemon.records.store import CLOCK_SKEW_S

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"created_at must be seconds since the epoch (a number), not {type(value).__name__}",
                         param="created_at")
    try:
        created = float(value)
    except OverflowError:
        created = math.inf
    if not math.isfinite(created) or created < 0:
        raise BadRequest(f"created_at must be seconds since the epoch, got {str(value)[:40]}", param="created_at")
    if created > time.time() + CLOCK_SKEW_S:
        raise BadRequest(f"created_at {created:.0f} is in the future"
                         + (" (milliseconds? Reef takes seconds since the epoch)" if created > 1e11 else ""),
                         param="created_at")
    return created


def from_line(item: Any, where: str, default_scenario: str, index: int | None = None) -> dict[str, Any]:
    """One imported object checked and made into an exchange record and its report (``report``: None when the
    line carries neither a score nor feedback). Raises ``BadRequest`` whose message starts with ``where`` and whose
    ``param`` names the field (``items[<index>].<field>`` when ``index`` is given: the import route's items).

    The checks are the ones data meets on every other way in: names as the serve path checks them
    (``daemon/names.py``), message roles as a served chat request's, ``score`` and ``feedback``
    as ``/reef/report`` checks them (``daemon/reports.py``), and the id a receipt that can be named again."""
    try:
        return _from_line(item, default_scenario)
    except BadRequest as e:
        param = e.param if index is None else f"items[{index}]" + (f".{e.param}" if e.param else "")
        raise BadRequest(f"{where}: {e.message}", param=param) from None


def _from_line(item: Any, default_scenario: str) -> dict[str, Any]:
    from daemon.names import check_receipt, check_run, check_scenario
    from daemon.reports import IMPORT_KEY, check_feedback, check_score

    if not isinstance(item, dict):
        raise BadRequest("not a JSON object")
    prompt = _messages(item.get("prompt"), "prompt")
    completion = _messages(item.get("completion"), "completion")
    scenario = item.get("scenario") or default_scenario
    check_scenario(scenario)
    run = item.get("run")
    if run is not None:
        check_run(run)
    score = item.get("score")
    if score is not None:
        score = check_score(score)
    feedback = item.get("feedback")
    if feedback is not None:
        check_feedback(feedback)
    model = item.get("model")
    if model is None:
        model = "imported"
    elif not (isinstance(model, str) and 0 < len(model) <= MODEL_MAX and model.isprintable()):
        raise BadRequest(f"model must be a name of 1 to {MODEL_MAX} printable characters", param="model")
    created = _created_at(item.get("created_at"))
    rid = item.get("id")
    if rid is None:
        digest = hashlib.sha256(json.dumps([scenario, prompt, completion], sort_keys=True).encode()).hexdigest()
        rid = f"rec_imp_{digest[:32]}"
    check_receipt(rid)
    record = ExchangeRecord(
        id=rid, scenario=scenario, run=run,
        status="complete", format="openai-chat", engine="import", model=model,
        request={"model": model, "messages": prompt},
        response={"object": "chat.completion", "model": model, "choices": [
            {"index": 0, "finish_reason": "stop", "message": completion[-1]}]},
        capture=True,
        **({"created_at": created} if created is not None else {}),
    )
    report = None
    if score is not None or feedback is not None:
        report = {"score": score, "feedback": feedback, "report_id": f"{IMPORT_KEY}{rid}"}
    return {"record": record, "report": report}
