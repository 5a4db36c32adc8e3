"""What ``reef status`` prints, in one place for both paths that print it: the fast one (``reef_cli/fast.py``,
the daemon asked over its socket with the standard library alone) and the typer command (``reef_cli/main.py``).
Standard library only: the fast path imports it."""

from __future__ import annotations

from typing import Any


def status_lines(info: dict[str, Any]) -> list[str]:
    """What ``reef status`` prints for a ``GET /reef/status`` answer."""
    models = ", ".join(f"{n} ({m['engine']}{', test model' if m.get('test_model') else ''}"
                       f"{', loaded' if m['loaded'] else ''})" for n, m in info["models"].items())
    return [f"daemon   pid {info['pid']}, up {info['uptime_s']:.0f}s, home {info['home']}",
            f"listen   {info['listen']['tcp']} and {info['listen']['unix']}",
            f"models   {models}; default {info['default_model']}",
            *_provider_line(info),
            f"records  {info['records']} exchanges, {info['reports']} reports, {info['scenarios']} scenarios",
            *(f"warning  {name}: {why}" for name, why in sorted((info.get("warnings") or {}).items())),
            *_inflight_lines(info.get("inflight") or []),
            *_canary_lines(info),
            *_spend_lines(info.get("spend") or {}),
            *_storage_lines(info)]


def _inflight_lines(inflight: list[dict[str, Any]]) -> list[str]:
    """One line per request being served: where it runs, how long, and the tokens the engine has made so far."""
    out = [f"serving  {len(inflight)} request{'s' if len(inflight) != 1 else ''} now"] if inflight else []
    for x in inflight:
        n, cap = x.get("output_tokens"), x.get("output_cap")
        tokens = ("tokens not counted (upstream)" if n is None else
                  f"reading its prompt ({x.get('prompt_tokens') or 0:,} tokens)" if n == 0 else
                  f"{n:,} tokens" + (f" of at most {cap:,}" if cap else ""))
        out.append(f"  {x['receipt']}  {x['scenario']}{'/' + x['run'] if x.get('run') else ''}  {x['model']}  "
                   f"{x['elapsed_s']:.0f} s, {tokens}")
    return out


def _canary_lines(info: dict[str, Any]) -> list[str]:
    """Each running canary (``daemon/canary.describe``), under its scenario's name."""
    out = []
    for c in info.get("canaries") or []:
        out += [f"canary   {c['scenario']}: {c['lines'][0]}", *(f"         {line}" for line in c["lines"][1:])]
    return out


def _spend_lines(spend: dict[str, Any]) -> list[str]:
    """Each learning scenario's trainer time (today against its cap, and in all), the cost per point of reward
    gained, its proposer's provider tokens where it used any or has a cap, and whether a cap stops it
    (``daemon/spend.py``)."""
    out = []
    for name, v in sorted(spend.items()):
        tokens, token_cap = v.get("proposer_tokens_today") or 0, v.get("max_proposer_tokens")
        if v.get("kind") == "harness":  # its proposer's tokens, where it used any or has a cap
            if not (v.get("proposer_tokens_total") or token_cap is not None):
                continue
            said = f"spend    {name}: {tokens} proposer tokens today" + (
                f" of max_proposer_tokens {token_cap}" if token_cap is not None else " (no cap)")
            said += f", {v.get('proposer_tokens_total') or 0} in all"
        else:
            today, total, cap = v["trainer_seconds_today"], v["trainer_seconds_total"], v.get("max_trainer_hours")
            said = f"spend    {name}: {today:.1f} s trainer time today" + (
                f" of {cap * 3600:g} s (max_trainer_hours {cap:g})" if cap is not None else " (no cap)")
            said += f", {total:.1f} s in all"
            cost = v.get("seconds_per_point")
            said += f"; {cost:.1f} s per +0.01 batch reward" if cost is not None else "; no reward gained yet"
        if v.get("capped"):
            said += f"; cap reached: no step until {v['resumes_at']} or a higher cap"
        out.append(said)
    return out


def _storage_lines(info: dict[str, Any]) -> list[str]:
    """Each weights scenario's weights on disk, kept and pruned by its retention policy, and each step waiting for
    disk space with why (``daemon/retention.py``)."""
    out = []
    for name, v in sorted((info.get("retention") or {}).items()):
        out.append(f"weights  {name}: {v['weights_bytes'] / 1e6:.1f} MB in the store; {v['releases']} releases, "
                   f"{v['pruned']} pruned (keep_releases {v['keep_releases']}, {v.get('keep_policy', 'latest')})")
    for name, v in sorted((info.get("storage") or {}).items()):
        out.append(f"storage  {name}: {v['summary']}")
    return out


def _provider_line(info: dict[str, Any]) -> list[str]:
    """Where the default model's answers come from when a provider serves it (the key's variable, by name)."""
    up = (info["models"].get(info["default_model"]) or {}).get("upstream")
    if not isinstance(up, dict):
        return []
    key = f"key from ${up['api_key_env']}" if up.get("api_key_env") else "no key"
    return [f"provider {up.get('model') or 'the client model'} at {up.get('url')} ({up.get('format')}, {key})"]
