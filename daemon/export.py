"""Records out and in: the shape training tools read (``reef records export``, ``reef records import``).

One JSON object per exchange, TRL's conversational prompt-completion form with the feedback beside it::

    {"id": "rec_...", "scenario": "pi", "run": "run_...", "created_at": 1764700000.0, "model": "smollm2",
     "release_id": "...", "format": "openai-chat", "status": "complete",
     "prompt": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                     "function": {"name": "ls", "arguments": "{}"}}]},
                {"role": "tool", "content": "a.py", "tool_call_id": "c1"}],
     "completion": [{"role": "assistant", "content": "..."}],
     "tools": "[{\"type\":\"function\",\"function\":{...}}]",
     "score": 1.0, "label": true,
     "reports": [{"score": 1.0, "feedback": "...", "source": null}],
     "prompt_token_ids": [...], "token_ids": [...], "logprobs": [...]}

``score`` is the latest report's score (None: unscored), ``label`` whether it is at least 0.5 (KTO's form; None when
unscored); ``completion`` is None where the exchange has no answer (an error, a stream cut before its end), ``prompt``
None where its request could not be read; ``tools`` is the request's tools as JSON text (None without), the form TRL's
trainers decode; token ids and log-probs are there when the engine recorded them (None otherwise). Hugging Face
``datasets`` reads the JSON Lines file (``load_dataset("json", data_files=...)``) or the Parquet file as they are
(``daemon/export_files.py``: the ``messages`` shape, Parquet's columns).

Import takes the same objects (``prompt`` and ``completion``, or one ``messages`` list; ``id``, ``scenario``,
``run``, ``model``, ``created_at``, ``score``, ``feedback``, ``reports``, ``status``, ``format``, ``release_id``,
``tools`` and token ids optional): an exchange per line, idempotent by id (a line without one gets an id from its
scenario and content), a report per entry of ``reports`` (or one of ``score`` and ``feedback``). Each line meets the
checks data meets on every other way in (``from_line``), and a line that fails one refuses its whole batch, naming
the line, the item and the field: nothing the API refuses elsewhere is stored by an import. An export imported and
exported again gives the same bytes: the stored exchange is a chat exchange (what every reader of records parses)
and carries the line's format and whole completion beside its answer (``IMPORT_NOTE``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any, TypedDict

from daemon.errors import BadRequest, ReefError
from daemon.jsontext import take_apart
from daemon.records import ExchangeRecord

if TYPE_CHECKING:
    from daemon.protocols.base import WireFormat

def _protocol(fmt: str | None) -> WireFormat | None:
    from daemon.protocols.formats import FORMATS

    return FORMATS.get(fmt or "")


def _messages_out(messages: list[Any]) -> list[dict[str, Any]]:
    """Neutral messages in the shape TRL and chat templates read: OpenAI chat messages with string content, an
    assistant's calls as ``tool_calls`` (arguments as JSON text) and each tool result a ``tool`` message with its
    ``tool_call_id``. Images and thinking are left out. Stable: what it writes, parsed again as a chat request and
    written by it, is the same (the round trip ``export -> import -> export`` rests on that)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        text = "".join(p.text for p in m.parts if p.type == "text")
        calls = [{"id": p.id, "type": "function", "function": {"name": p.name, "arguments": p.arguments or "{}"}}
                 for p in m.parts if p.type == "tool_call"]
        results = [p for p in m.parts if p.type == "tool_result"]
        out += [{"role": "tool", "content": p.text, "tool_call_id": p.tool_call_id} for p in results]
        if text or calls or not results:
            out.append({"role": m.role, "content": text, **({"tool_calls": calls} if calls else {})})
    return out


def _completion_out(c: Any) -> list[dict[str, Any]]:
    calls = [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments or "{}"}}
             for t in c.tool_calls]
    return [{"role": "assistant", "content": c.text or "", **({"tool_calls": calls} if calls else {})}]


def _tools_out(tools: list[Any]) -> str | None:
    """A request's tools as TRL's ``tools`` column reads them: JSON text of the list of function schemas (text,
    since each tool's schema has its own shape, which one Arrow column cannot hold); None without tools."""
    if not tools:
        return None
    return json.dumps([{"type": "function", "function": {"name": t.name, "description": t.description,
                                                         "parameters": t.parameters}} for t in tools],
                      ensure_ascii=False, separators=(",", ":"))


IMPORT_NOTE = "reef_import"  # an imported exchange's answer: the line's format and its whole completion


def _answer(proto: WireFormat, response: Any) -> list[dict[str, Any]] | None:
    """The answer a stored response holds (an error record's partial answer included): None where there is none.
    A Responses body always has an ``error`` key (null when it went well): only a set one marks a failure."""
    if not isinstance(response, dict):
        return None
    if response.get("error") and set(response) <= {"error", "partial"}:  # how serving stores a failure
        response = response.get("partial")
        if not isinstance(response, dict):
            return None
    try:
        return _completion_out(proto.parse_response({k: v for k, v in response.items() if k != "reef"}))
    except Exception:  # an answer in a shape the protocol does not parse back: no completion to give
        return None


def render_lines(records: list[dict[str, Any]]) -> bytes:
    """Records (``store.user_data.export_page``) as JSON Lines in the export shape, taking them out of ``records``
    one by one (each freed here, not where the list is dropped). Run in a worker thread: a record of 200,000 messages
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
    """One exchange record (``RecordStore.exchanges.get`` shape, reports included) in the export shape."""
    response = rec.get("response")
    note = response.get(IMPORT_NOTE) if rec.get("engine") == "import" and isinstance(response, dict) else None
    fmt = note.get("format") if isinstance(note, dict) else rec.get("format")
    proto = _protocol(rec.get("format"))
    prompt: list[dict[str, Any]] | None = None
    completion: list[dict[str, Any]] | None = None
    tools: str | None = None
    if proto is not None and isinstance(rec.get("request"), dict):
        try:
            parsed = [proto.parse_request(rec["request"])]
            prompt = _messages_out(parsed[0].messages)  # system messages are messages here
            tools = _tools_out(parsed[0].tools)
            take_apart(parsed)  # 200,000 parsed messages freed at once held the GIL 0.1 s
        except Exception:  # a request recorded as it came, then refused: no prompt to give
            prompt = None
    if isinstance(note, dict):
        completion = _chat_messages(note.get("completion"))
    elif proto is not None:
        completion = _answer(proto, response)
    reports = [r["report"] for r in rec.get("reports") or [] if isinstance(r.get("report"), dict)]
    scored = [r for r in reports if isinstance(r.get("score"), (int, float))]
    score = float(scored[-1]["score"]) if scored else None
    return {
        "id": rec["id"], "scenario": rec["scenario"], "run": rec.get("run"), "created_at": rec.get("created_at"),
        "model": rec.get("model"), "release_id": rec.get("release_id"), "format": fmt,
        "status": rec.get("status"), "prompt": prompt, "completion": completion, "tools": tools, "score": score,
        "label": None if score is None else score >= 0.5,
        "reports": [{"score": r.get("score"), "feedback": r.get("feedback"),
                     "source": (r.get("metadata") or {}).get("source") if isinstance(r.get("metadata"), dict)
                     else None} for r in reports],
        "prompt_token_ids": rec.get("prompt_token_ids"), "token_ids": rec.get("token_ids"),
        "logprobs": rec.get("logprobs"),
    }


def _chat_messages(value: Any) -> list[dict[str, Any]] | None:
    """Messages as a chat request holds them, in the export shape (None: not a list of such messages)."""
    from daemon.protocols import openai_chat

    if not isinstance(value, list) or not value:
        return None
    try:
        return _messages_out(openai_chat.parse_request({"model": "m", "messages": value}).messages)
    except Exception:
        return None


def _messages(value: Any, key: str, *, required: bool) -> list[dict[str, Any]] | None:
    """An imported line's ``prompt`` or ``completion``: chat messages as a served chat request's are checked
    (roles, string or text-part content, a ``tool`` message's ``tool_call_id``, well-formed ``tool_calls``), the
    error naming ``key[i].field``; None where it may be absent (an exchange that failed before its answer)."""
    from daemon.protocols import openai_chat

    if value is None and not required:
        return None
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{key} must be a non-empty list of messages", param=key)
    try:
        openai_chat.parse_request({"model": "m", "messages": value})
    except ReefError as e:
        param = str(e.data.get("param") or "")
        message = e.message
        if param.startswith("messages"):
            param = key + param[len("messages"):]
            message = message.replace("messages[", f"{key}[", 1)
        raise BadRequest(message, param=param or key) from None
    return value


def _tools_in(value: Any) -> list[dict[str, Any]] | None:
    """An imported line's ``tools``: the export's JSON text, or the list itself; checked as a chat request's."""
    from daemon.protocols import openai_chat

    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadRequest("tools must be a JSON list of function schemas", param="tools") from None
    if not isinstance(value, list):
        raise BadRequest("tools must be a list of function schemas", param="tools")
    try:
        openai_chat.parse_request({"model": "m", "messages": [{"role": "user", "content": ""}], "tools": value})
    except ReefError as e:
        raise BadRequest(e.message, param=str(e.data.get("param") or "tools")) from None
    return value or None


MODEL_MAX = 200  # characters of an imported exchange's model name


def _created_at(value: Any) -> float | None:
    """An imported line's ``created_at`` (seconds since the epoch): None where it has none (the import's time); a
    date beyond this clock (plus ``CLOCK_SKEW_S``) is refused, since retention could not judge its age by it: most
    often a time in milliseconds."""
    import math
    import time

    from daemon.records.user_data import CLOCK_SKEW_S

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


STATUSES = ("complete", "incomplete", "error", "cancelled")  # what an imported exchange's status may be
RELEASE_MAX = 200  # characters of an imported exchange's release id


class _Tokens(TypedDict):
    """An imported line's tokens, as ``ExchangeRecord`` takes them."""

    prompt_token_ids: list[int] | None
    token_ids: list[int] | None
    logprobs: list[float] | None


def _token_ids(item: dict[str, Any], key: str) -> list[int] | None:
    value = item.get(key)
    if value is None:
        return None
    if not (isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in value)):
        raise BadRequest(f"{key} must be a list of token ids (integers from 0 to 2^31-1)", param=key)
    return value


def _tokens(item: dict[str, Any]) -> _Tokens:
    """An imported line's token ids and log-probs (as an export wrote them), checked for what the store packs:
    ids in 0..2^31-1, finite log-probs, one per sampled token."""
    import math

    out = _Tokens(prompt_token_ids=_token_ids(item, "prompt_token_ids"), token_ids=_token_ids(item, "token_ids"),
                  logprobs=None)
    lp = item.get("logprobs")
    if lp is not None:
        if not (isinstance(lp, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                             and math.isfinite(x) for x in lp)):
            raise BadRequest("logprobs must be a list of finite numbers", param="logprobs")
        if out["token_ids"] is None or len(lp) != len(out["token_ids"]):
            raise BadRequest("logprobs must have one number per token id", param="logprobs")
        out["logprobs"] = lp
    return out


def _reports(item: dict[str, Any]) -> list[dict[str, Any]]:
    """What an imported line says about its exchange: each of its ``reports`` (an export's), or else one report of
    its ``score`` and ``feedback``. A ``score`` beside ``reports`` must be theirs (the last scored one's): a line
    edited in one place and not the other is refused rather than read one way silently."""
    from daemon.reports import check_feedback, check_score

    score, feedback = item.get("score"), item.get("feedback")
    if score is not None:
        score = check_score(score)
    if feedback is not None:
        check_feedback(feedback)
    given = item.get("reports")
    if not given:
        if score is None and feedback is None:
            return []
        return [{"score": score, "feedback": feedback, "source": "import"}]
    if not isinstance(given, list):
        raise BadRequest("reports must be a list of {score, feedback, source}", param="reports")
    out = []
    for i, r in enumerate(given):
        if not isinstance(r, dict):
            raise BadRequest("each report must be an object {score, feedback, source}", param=f"reports[{i}]")
        try:
            s = None if r.get("score") is None else check_score(r["score"])
            if r.get("feedback") is not None:
                check_feedback(r["feedback"])
        except BadRequest as e:
            raise BadRequest(e.message, param=f"reports[{i}].{e.param}") from None
        source = r.get("source")
        if source is not None and not (isinstance(source, str) and 0 < len(source) <= 40 and source.isprintable()):
            raise BadRequest("a report's source must be a name of 1 to 40 printable characters",
                             param=f"reports[{i}].source")
        out.append({"score": s, "feedback": r.get("feedback"), "source": source})
    last = [r["score"] for r in out if r["score"] is not None]
    if score is not None and (not last or last[-1] != score):
        raise BadRequest(f"score {score:g} is not the last scored report's ({'none' if not last else f'{last[-1]:g}'}):"
                         " change both, or drop reports to import the score alone", param="score")
    return out


def _from_line(item: Any, default_scenario: str) -> dict[str, Any]:
    from daemon.names import check_receipt, check_run, check_scenario
    from daemon.reports import IMPORT_KEY

    if not isinstance(item, dict):
        raise BadRequest("not a JSON object")
    status = item.get("status")
    if status is None:
        status = "complete"
    elif status not in STATUSES:
        raise BadRequest(f"status must be one of {', '.join(STATUSES)}", param="status")
    answered = status == "complete"  # a finished exchange has a prompt and an answer; a failed one may lack them
    if "messages" in item and "prompt" not in item and "completion" not in item:  # the ``messages`` shape
        from daemon.export_files import split_messages

        if not isinstance(item["messages"], list) or not item["messages"]:
            raise BadRequest("messages must be a non-empty list of messages", param="messages")
        _messages(item["messages"], "messages", required=True)
        head, tail = split_messages(item["messages"])
        item = {**item, "prompt": head or None, "completion": tail or None}
    prompt = _messages(item.get("prompt"), "prompt", required=answered)
    completion = _messages(item.get("completion"), "completion", required=answered)
    tools = _tools_in(item.get("tools"))
    scenario = item.get("scenario") or default_scenario
    check_scenario(scenario)
    run = item.get("run")
    if run is not None:
        check_run(run)
    reports = _reports(item)
    model = item.get("model")
    if model is None:
        model = "imported"
    elif not (isinstance(model, str) and 0 < len(model) <= MODEL_MAX and model.isprintable()):
        raise BadRequest(f"model must be a name of 1 to {MODEL_MAX} printable characters", param="model")
    release = item.get("release_id")
    if release is not None and not (isinstance(release, str) and 0 < len(release) <= RELEASE_MAX
                                    and release.isprintable()):
        raise BadRequest(f"release_id must be an id of 1 to {RELEASE_MAX} printable characters", param="release_id")
    fmt = item.get("format")
    if fmt is None:
        fmt = "openai-chat"
    elif _protocol(fmt) is None:
        from daemon.protocols.formats import FORMATS

        raise BadRequest(f"format must be one of {', '.join(FORMATS)}", param="format")
    created = _created_at(item.get("created_at"))
    tokens = _tokens(item)
    rid = item.get("id")
    if rid is None:
        digest = hashlib.sha256(json.dumps([scenario, prompt, completion], sort_keys=True).encode()).hexdigest()
        rid = f"rec_imp_{digest[:32]}"
    check_receipt(rid)
    # stored as a chat exchange (what every reader of records parses), its answer the completion's last assistant
    # message; the line's own format and whole completion ride along for the export (IMPORT_NOTE)
    request: dict[str, Any] | None = None
    if prompt is not None:
        request = {"model": model, "messages": prompt, **({"tools": tools} if tools else {})}
    note = {"format": fmt, "completion": completion}
    if completion is None:
        response: dict[str, Any] = {IMPORT_NOTE: note}
    else:
        last = next((m for m in reversed(completion) if m["role"] == "assistant"),
                    {"role": "assistant", "content": ""})
        response = {"object": "chat.completion", "model": model,
                    "choices": [{"index": 0, "finish_reason": "stop", "message": last}], IMPORT_NOTE: note}
    record = ExchangeRecord(
        id=rid, scenario=scenario, run=run, status=status, format="openai-chat", engine="import", model=model,
        release_id=release, request=request, response=response, capture=True, **tokens,
    )
    if created is not None:
        record = dataclasses.replace(record, created_at=created)
    keyed = [{**r, "report_id": f"{IMPORT_KEY}{rid}" + (f":{i}" if i else "")} for i, r in enumerate(reports)]
    return {"record": record, "reports": keyed}
