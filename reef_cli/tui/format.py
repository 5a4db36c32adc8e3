"""Pure text helpers of the TUI: short ids, ages, metrics, gate verdicts, and an exchange as a conversation.

Nothing here touches Textual or the network, so the screens stay thin and these stay easy to test.
"""

from __future__ import annotations

import json
from typing import Any


def short(release_id: str | None, n: int = 10) -> str:
    return release_id[:n] if release_id else "-"


def age(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    d = max(0.0, now - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= size:
            return f"{int(d // size)}{unit}"
    return f"{int(d)}s"


def number(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if abs(v) >= 1000:  # 18400.0, not 1.84e+04
        return f"{v:.0f}"
    return f"{v:.3g}"


def duration(seconds: Any) -> str:
    """A time span as a person reads it: ``250 ms``, ``18.4 s``, ``5 min 7 s``, ``2 h 3 min`` (never ``1.84e+04``)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "-"
    s = float(seconds)
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 60:
        return f"{s:.3g} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"


# the metrics a person looks at first, when a release has them
KEY_METRICS = ("eval_reward", "batch_reward", "value_loss", "batch_best", "judge_bad", "judge_good", "reward", "loss",
               "eval_base", "margin")


def key_metrics(metrics: dict[str, Any] | None, n: int = 3) -> str:
    if not metrics:
        return ""
    keys = [k for k in KEY_METRICS if k in metrics] + [k for k in metrics if k not in KEY_METRICS]
    return "  ".join(f"{k} {number(metrics[k])}" for k in keys[:n])


def recipe_summary(steps: list[dict[str, Any]], window: int = 16) -> str:
    """What recipes' own metrics say across ``train.step`` events: sao's critic (its value loss, averaged over the
    last ``window`` steps: one rollout's is noisy) and ttt-discover's best attempt so far, with the release that
    served it. Empty when no step carries them."""
    parts = []
    losses = [m["value_loss"] for m in (e.get("metrics") or {} for e in steps)
              if isinstance(m.get("value_loss"), (int, float))][-window:]
    if losses:
        parts.append(f"value loss {number(sum(losses) / len(losses))}")
    best: tuple[float, Any] | None = None
    for m in (e.get("metrics") or {} for e in steps):
        b = m.get("batch_best")
        if isinstance(b, (int, float)) and (best is None or b > best[0]):
            best = (float(b), m.get("batch_best_release"))
    if best is not None:
        parts.append(f"best attempt {number(best[0])} (release {short(best[1])})")
    return "   ".join(parts)


def verdict(release: dict[str, Any]) -> str:
    """The gate's verdict as the chain shows it: train releases passed their gate; others had none."""
    op = release.get("operation")
    if op == "rejected":
        return "rejected"
    if op == "pending":
        return "pending"
    if op in ("train", "promote"):
        return str((release.get("metrics") or {}).get("verdict") or "accepted")
    return "-"


def score(v: Any) -> str:
    return "-" if v is None else number(v)


def spent(v: dict[str, Any] | None) -> str:
    """A scenario's learning spend in a table cell (``GET /reef/status``'s ``spend``): trainer seconds today and the
    cost per +0.01 of released reward, or a harness scenario's proposer tokens today; "capped" while a cap holds."""
    if not v:
        return "-"
    if v.get("kind") == "harness":
        cell = f"{v.get('proposer_tokens_today') or 0:,} tok" if v.get("proposer_tokens_total") else "-"
    else:
        cost = v.get("seconds_per_point")
        cell = f"{v.get('trainer_seconds_today') or 0:.0f} s" + (f", {cost:.0f} s/+0.01" if cost is not None else "")
    return f"{cell} capped" if v.get("capped") else cell


def one_line(text: Any, limit: int = 60) -> str:
    if text is None:
        return ""
    s = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
    s = " ".join(s.split())
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict):
                if isinstance(p.get("text"), str):
                    parts.append(p["text"])
                elif p.get("type") in ("tool_use", "function_call"):
                    parts.append(f"[tool call {p.get('name')}: {json.dumps(p.get('input', p.get('arguments')))}]")
                elif p.get("type") == "tool_result":
                    parts.append(f"[tool result: {_content_text(p.get('content'))}]")
                else:
                    parts.append(f"[{p.get('type', 'part')}]")
            elif isinstance(p, str):
                parts.append(p)
        return "\n".join(parts)
    return "" if content is None else json.dumps(content, ensure_ascii=False)


def conversation(request: Any, response: Any) -> list[tuple[str, str]]:
    """(role, text) turns of one exchange, best effort across chat completions, Responses and Messages."""
    turns: list[tuple[str, str]] = []
    req = request if isinstance(request, dict) else {}
    if isinstance(req.get("system"), (str, list)):
        turns.append(("system", _content_text(req["system"])))
    if isinstance(req.get("instructions"), str):
        turns.append(("system", req["instructions"]))
    items = req.get("messages") if isinstance(req.get("messages"), list) else None
    if items is None:
        inp = req.get("input")
        items = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp if isinstance(inp, list) else []
    for m in items:
        if isinstance(m, dict):
            role = str(m.get("role") or m.get("type") or "?")
            text = _content_text(m.get("content"))
            if m.get("tool_calls"):
                text += "".join(f"\n[tool call {c.get('function', {}).get('name')}]" for c in m["tool_calls"])
            turns.append((role, text))
    resp = response if isinstance(response, dict) else {}
    if isinstance(resp.get("choices"), list):
        for ch in resp["choices"]:
            msg = (ch or {}).get("message") or {}
            text = _content_text(msg.get("content"))
            for c in msg.get("tool_calls") or []:
                fn = c.get("function") or {}
                text += f"\n[tool call {fn.get('name')}: {fn.get('arguments')}]"
            turns.append((str(msg.get("role") or "assistant"), text))
    elif isinstance(resp.get("content"), list):
        turns.append(("assistant", _content_text(resp["content"])))
    elif isinstance(resp.get("output"), list):
        for item in resp["output"]:
            if isinstance(item, dict):
                if item.get("type") == "function_call":
                    turns.append(("assistant", f"[tool call {item.get('name')}: {item.get('arguments')}]"))
                else:
                    turns.append((str(item.get("role") or "assistant"), _content_text(item.get("content"))))
    elif response is not None:
        turns.append(("response", _content_text(response)))
    return turns


SPARK = "▁▂▃▄▅▆▇█"


def spark(values: list[float | None], width: int = 24) -> str:
    """The last ``width`` values in [0, 1] as a sparkline (a gap where a value is unknown)."""
    out = []
    for v in values[-width:]:
        out.append(" " if v is None else SPARK[min(len(SPARK) - 1, max(0, int(v * len(SPARK))))])
    return "".join(out)


def canary_line(canary: dict[str, Any], history: list[tuple[float | None, float | None]]) -> str:
    """A running canary: its share, both arms' means, intervals and reports, and their means over time."""
    f = canary.get("figures") or {}

    def arm(name: str) -> str:
        mean, iv, n = f.get(f"{name}_mean"), f.get(f"{name}_interval"), f.get(f"{name}_reports", 0)
        shown = "-" if mean is None else f"{mean:.3f}"
        return f"{name} {shown}" + (f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv else "") + f" n={n}"

    lines = [f"canary {short(canary.get('release_id'), 8)} serves {canary.get('share', 0):.0%} of new runs beside "
             f"{short(canary.get('base_id'), 8)}: {arm('canary')} | {arm('head')} (alpha {f.get('alpha')})",
             *(canary.get("lines") or [])[1:]]  # each arm's guard figures, what it can still decide (the daemon's)
    if history:
        lines.append(f"  canary {spark([c for c, _ in history])}  head {spark([h for _, h in history])}"
                     "   p promotes it, e ends it")
    return "\n".join(lines)

