"""The early warning: a scenario whose scored reward rises while its answers collapse is told so, in plain words,
and stops publishing until the user acts.

The held-out check (``heldout.py``) judges one candidate against the head: it holds a collapsed one. The warning
reads the trend over the scenario's recent weights candidates (``WINDOW``: the newest ones since the warning was
last cleared, published, held or written down, and the candidate at the gate), and fires when the scored reward
(``batch_reward``: the mean score of the batch a step trained on) rose by ``RISE`` or more, first to last, while
one of these fell, the first point's figures being the baseline (for the held-out ones, the head that first
candidate was checked against: the model before the trend):
- it stops answering: the held-out share of empty answers rose by ``SILENT_RISE`` (cut-short ones are left out: a
  right terse answer is cut short by that measure, and the demo's honest "say the word" task was warned by it), or the mean length
  of its answers (the held-out ones, or the sampled answers the step trained on) fell to ``LENGTH_FALL`` of the
  baseline's or less *and* to ``SHORT_TOKENS`` or fewer tokens, from more than twice that (a preference for brief
  answers shortens them too; only one that leaves almost nothing of real answers is read as silence);
- it forgets: probe accuracy fell by ``PROBE_FALL`` or more;
- its answers degenerate: the held-out share of degenerate answers (empty, cut short, loops) rose by
  ``DEGENERATE_RISE``;
- its answers collapse into one pattern: the sampled answers' mean token entropy fell to ``ENTROPY_FALL`` of the
  baseline's or less, read only beside another signal: alone it is what learning any preference looks like (the
  demo's honest "say the word" task fell from 0.68 to 0.20 nats and was warned and paused when it fired alone).
Degenerate groups (groups whose answers all scored alike) rising are shown as evidence, never fire alone: a
preference that is being learned saturates groups too.

"The scorer may reward empty answers" is checked against the scorer itself: each step writes down how its batch's
empty answers (the end-of-text token alone) scored against the rest (``batch_empty``, ``batch_empty_reward``,
``batch_rest_reward``). When the window's batches hold at least ``MIN_EMPTY`` empty answers and they scored lower
than the rest by ``PUNISHED`` or more, the scorer punishes silence, and "it stops answering" does not fire: answers
falling silent under such a scorer are the training's instability, not the scorer's reward (the held-out check
still holds any candidate past its own bound). Measured: ``reef demo``'s honest "say the word" task (an empty answer
scores 0) was warned so about one run in four (reward 0.06 -> 0.25 over 4 steps, held-out answers empty 0% ->
18%) and its learning paused for good.

Fired, the candidate at the gate is held (not served) with the warning as its reason, and the scenario's warning
is written to the record store (``scenarios.warning``: it outlives a restart): learning pauses (``Learner.step``
takes no step while it stands), so nothing more is published. Pausing was chosen over holding every later
candidate: on a small machine each step costs minutes that would only make candidates nobody should serve, and
the reports wait to be learned from under whatever the user decides. The user acts by ``reef scenarios resume S``
(learning goes on; the trend is read afresh from then), by changing the settings (``reef scenarios update S``: the
same), or by ``reef scenarios accept-warning S`` (learning goes on and this scenario is not warned again until its
settings change). A scorer is the user's own: after changing it, ``resume``.

Shown on ``GET /reef/scenarios/{s}`` (``warning``), ``GET /reef/status`` (``warnings``), ``reef status``, the
wrappers' stderr at a run's start, the TUI's scenarios, an event (``warning``) and ``/metrics``
(``reef_scenario_warning``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from daemon.gating.outcome import GateRun, Host, StepOutcome

log = logging.getLogger("reef.warning")

WINDOW = 4  # candidates read: the newest three before the one at the gate, and it
MIN_STEPS = 2  # fewer candidates than this since the last clear: no trend to read (the first one's held-out
# baseline is the head it was checked against, so two already show a trend against the model before it)
RISE = 0.1  # the scored reward, first to last
SILENT_RISE = 0.15  # the held-out share of empty or cut-short answers, against the baseline
DEGENERATE_RISE = 0.25  # the held-out share of degenerate answers
NOISE_HEAD = 0.5  # a head with more degenerate held-out answers than this: their rise says nothing (a tiny model)
PROBE_FALL = 0.15  # probe accuracy, absolute
LENGTH_FALL = 0.5  # mean answer length, as a share of the baseline's...
SHORT_TOKENS = 6.0  # ...and at most this many tokens
ENTROPY_FALL = 1 / 3  # mean token entropy of the sampled answers, as a share of the baseline's
MIN_EMPTY = 3  # empty answers in the window's batches from which their scores say what the scorer makes of silence
PUNISHED = 0.1  # they scored this much below the rest, or more: the scorer punishes silence
EMPTY_TOKENS = 1  # an answer of at most this many tokens (the end-of-text token alone) is empty

# what each signal means, and what the scorer may be rewarding
SAYS = {
    "silent": ("the model stops answering", "the scorer may reward empty answers"),
    "forgets": ("the model forgets what it knew", "the scorer may reward answers that are not about the question"),
    "degenerate": ("the model's answers degenerate into fragments or loops",
                   "the scorer may reward degenerate answers"),
    "entropy": ("the model's answers collapse into one pattern",
                "the scorer may reward a trick rather than good answers"),
}


def _num(m: Mapping[str, Any], key: str) -> float | None:
    v = m.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _ratio(m: Mapping[str, Any], num: str, den: str) -> float | None:
    a, b = _num(m, num), _num(m, den)
    return a / b if a is not None and b else None


@dataclass(frozen=True)
class Point:
    """One candidate's figures, as the warning reads them (None: not measured)."""

    reward: float | None  # batch_reward
    answer_tokens: float | None  # the sampled answers' mean length: tokens / samples
    entropy: float | None  # their mean token entropy
    degenerate_groups: float | None  # share of the batch's groups whose answers all scored alike
    silent: float | None  # held-out: share of empty answers (a cut-short one may be a right terse answer)
    degenerate: float | None  # held-out: share of degenerate answers
    probe_accuracy: float | None
    heldout_tokens: float | None  # held-out: mean answer length, tokens
    # the head's held-out figures this candidate was checked against (the first point's are the baseline)
    head_silent: float | None = None
    head_degenerate: float | None = None
    head_probe_accuracy: float | None = None
    head_tokens: float | None = None
    empty_n: float = 0.0  # the batch's empty answers (batch_empty) and how they and the rest scored
    empty_reward: float | None = None
    rest_reward: float | None = None

    @classmethod
    def of(cls, m: Mapping[str, Any]) -> Point:
        return cls(reward=_num(m, "batch_reward"), empty_n=_num(m, "batch_empty") or 0.0,
                   empty_reward=_num(m, "batch_empty_reward"), rest_reward=_num(m, "batch_rest_reward"),
                   answer_tokens=_ratio(m, "tokens", "samples"),
                   entropy=_num(m, "entropy"), degenerate_groups=_ratio(m, "degenerate_groups", "groups"),
                   silent=_num(m, "heldout_empty"), degenerate=_loops(m, ""),
                   probe_accuracy=_num(m, "heldout_probe_accuracy"), heldout_tokens=_num(m, "heldout_tokens"),
                   head_silent=_num(m, "heldout_head_empty"), head_degenerate=_loops(m, "head_"),
                   head_probe_accuracy=_num(m, "heldout_head_probe_accuracy"),
                   head_tokens=_num(m, "heldout_head_tokens"))


def _loops(m: Mapping[str, Any], who: str) -> float | None:
    """The held-out share of empty answers and loops: degenerate ones less those only cut short (a right terse answer
    is cut short by the check's measure: reef demo's honest one-word answers were warned by it)."""
    deg, silent, empty = (_num(m, f"heldout_{who}{k}") for k in ("degenerate", "silent", "empty"))
    if deg is None or silent is None or empty is None:
        return deg
    return max(0.0, deg - silent + empty)


def _base(first: Point, key: str) -> float | None:
    """The baseline of a figure: the head's the first candidate was checked against, else the first candidate's."""
    head: float | None = getattr(first, f"head_{key}", None)
    own: float | None = getattr(first, key)
    return head if head is not None else own


def detect(series: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """``series``: candidates' metrics, oldest first, the one at the gate last (at most ``WINDOW`` are read).
    The warning (``signals``, ``figures``, ``says``: one sentence in plain words) or None."""
    points = [Point.of(m) for m in series[-WINDOW:]]
    if len(points) < MIN_STEPS:
        return None
    first, last = points[0], points[-1]
    # each change is judged at the 4 places its figures are written to: 0.3 - 0.2 is 0.09999999999999998, and a
    # reward from 0.2 to 0.3 rose by RISE
    if first.reward is None or last.reward is None or round(last.reward - first.reward, 4) < RISE:
        return None
    figures: dict[str, Any] = {"steps": len(points), "reward_from": round(first.reward, 4),
                               "reward_to": round(last.reward, 4)}
    evidence = [f"reward {first.reward:.2f} -> {last.reward:.2f} over {len(points)} steps"]
    signals: list[str] = []

    def fell(key: str, label: str, unit: str, test: Any, signal: str, base: float | None = None) -> None:
        a = base if base is not None else getattr(first, key)
        b = getattr(last, key)
        if a is None or b is None:
            return
        figures[f"{key}_from"], figures[f"{key}_to"] = round(a, 4), round(b, 4)
        if test(a, b):
            evidence.append(f"{label} {a:{unit}} -> {b:{unit}}")
            if signal not in signals:
                signals.append(signal)

    fell("silent", "held-out answers empty", ".0%", lambda a, b: round(b - a, 4) >= SILENT_RISE, "silent",
         _base(first, "silent"))
    for key, label in (("heldout_tokens", "held-out answers"), ("answer_tokens", "sampled answers")):
        base = first.head_tokens if key == "heldout_tokens" and first.head_tokens is not None else None
        fell(key, f"{label} (tokens)", ".1f",
             lambda a, b: a > 2 * SHORT_TOKENS and b <= LENGTH_FALL * a and b <= SHORT_TOKENS, "silent", base)
    fell("probe_accuracy", "probe accuracy", ".0%", lambda a, b: round(a - b, 4) >= PROBE_FALL, "forgets",
         _base(first, "probe_accuracy"))
    head_degenerate = _base(first, "degenerate")
    if head_degenerate is None or head_degenerate <= NOISE_HEAD:  # a head that already answers in fragments: noise
        fell("degenerate", "held-out answers degenerate", ".0%", lambda a, b: round(b - a, 4) >= DEGENERATE_RISE,
             "degenerate", head_degenerate)
    punished = _silence_punished(points)
    if "silent" in signals and punished is not None:
        signals.remove("silent")
        evidence.append(punished)
    if not signals:  # entropy falling alone is what learning a preference looks like (the demo's honest task)
        return None
    fell("entropy", "token entropy (nats)", ".2f", lambda a, b: round(b - ENTROPY_FALL * a, 4) <= 0,
         "entropy")
    if first.degenerate_groups is not None and last.degenerate_groups is not None and \
            last.degenerate_groups > first.degenerate_groups:
        evidence.append(f"groups that all scored alike {first.degenerate_groups:.0%} -> {last.degenerate_groups:.0%}")
    what, why = SAYS[signals[0]]
    also = [SAYS[s][0] for s in signals[1:]]
    says = f"the reward is rising while {what}: {why}" + (f" (also: {'; '.join(also)})" if also else "")
    return {"signals": signals, "figures": figures, "says": says, "evidence": "; ".join(evidence)}


def batch_figures(scored: Sequence[Any]) -> dict[str, float]:
    """A step's batch as the warning reads it: its mean score, and how its empty answers scored against the rest
    (``scored``: the scored exchanges it trained on, each with ``score`` and ``token_ids``)."""
    out = {"batch_reward": round(sum(r.score for r in scored) / len(scored), 4)}
    empty = [r.score for r in scored if len(r.token_ids) <= EMPTY_TOKENS]
    rest = [r.score for r in scored if len(r.token_ids) > EMPTY_TOKENS]
    out["batch_empty"] = float(len(empty))
    if empty:
        out["batch_empty_reward"] = round(sum(empty) / len(empty), 4)
    if rest:
        out["batch_rest_reward"] = round(sum(rest) / len(rest), 4)
    return out


def _silence_punished(points: Sequence[Point]) -> str | None:
    """The evidence that the window's scorer punishes empty answers, or None (too few of them, or not lower)."""
    empty = [(p.empty_n, p.empty_reward) for p in points if p.empty_n and p.empty_reward is not None]
    n = sum(k for k, _ in empty)
    rest = [(p.reward, p.empty_n, p.rest_reward) for p in points if p.rest_reward is not None]
    if n < MIN_EMPTY or not rest:
        return None
    mean_empty = sum(k * r for k, r in empty) / n
    mean_rest = sum(r for _, _, r in rest) / len(rest)
    if round(mean_rest - mean_empty, 4) < PUNISHED:
        return None
    return (f"its {n:.0f} empty sampled answers scored {mean_empty:.2f} against {mean_rest:.2f} for the rest: the "
            "scorer does not reward silence, so answers falling silent are not read as its reward")


def text(name: str, warning: Mapping[str, Any]) -> str:
    """The warning as a person reads it: what happens, the figures, and the three ways on."""
    return (f"{warning['says']} ({warning['evidence']}). Learning on {name} is paused and nothing is published "
            f"until you act: reef scenarios resume {name} (go on; after changing the scorer, say), reef scenarios "
            f"update {name} --settings JSON (change the settings), or reef scenarios accept-warning {name} (go on, "
            "and do not warn again until the settings change)")


def state(warning: Mapping[str, Any] | None) -> str:
    """``warned``, ``accepted``, ``cleared`` or ``none``."""
    return str(warning.get("state")) if warning else "none"


def since(warning: Mapping[str, Any] | None) -> float:
    """From when the trend is read: the last clear or accept (0: the whole chain)."""
    return float(warning.get("since") or 0.0) if warning else 0.0


def raised(name: str, found: Mapping[str, Any], release_id: str | None, step: int | None) -> dict[str, Any]:
    """The stored state of a warning that fired on ``release_id`` (held)."""
    return {"state": "warned", "since": time.time(), "at": time.time(), "release_id": release_id, "step": step,
            "signals": list(found["signals"]), "figures": dict(found["figures"]), "says": found["says"],
            "evidence": found["evidence"], "reason": text(name, found)}


def cleared(how: str, previous: Mapping[str, Any] | None) -> dict[str, Any]:
    """The stored state after the user acted (``how``: resumed, updated, accepted): the trend is read afresh from
    now; ``accepted`` keeps the scenario from being warned again until its settings change."""
    out: dict[str, Any] = {"state": "accepted" if how == "accepted" else "cleared", "since": time.time(),
                           "how": how}
    if previous and previous.get("state") == "warned":
        out["was"] = {k: previous.get(k) for k in ("says", "release_id", "at")}
    return out


# --- at the gate -------------------------------------------------------------------------------------------------


async def read(host: Host, run: GateRun) -> dict[str, Any] | None:
    """The warning the trend of ``run``'s scenario raises with its candidate, or None (harness candidates, an
    accepted warning, too few steps since the last clear, no trend)."""
    if not run.weights or state(run.scenario.warning) == "accepted":
        return None
    name, after = run.scenario.name, since(run.scenario.warning)
    earlier: list[tuple[float, dict[str, Any]]] = []
    for rel in await host.chains.history(name, WINDOW):
        if rel.operation != "train":  # a rollback or a promote: the trend starts again after it
            after = max(after, rel.created_at)
            break
        earlier.append((rel.created_at, rel.metrics))
    earlier += [(r.created_at, r.metrics) for r in await host.chains.pending(name)]
    earlier += [(r.created_at, r.metrics) for r in await host.chains.rejections(name, WINDOW)]
    series = [m for t, m in sorted(earlier, key=lambda x: x[0]) if t > after and "batch_reward" in m]
    return detect([*series[-(WINDOW - 1):], run.metrics])


async def raise_warning(host: Host, run: GateRun, found: dict[str, Any], release_id: str | None,
                        step: int | None) -> dict[str, Any]:
    """Write the warning down (it outlives a restart), publish it (``warning`` on ``/reef/events``) and say it in
    the log; the scenario's learning waits from now on."""
    name = run.scenario.name
    stored = raised(name, found, release_id, step)
    await host.set_warning(name, stored)
    host.events.publish("warning", scenario=name, state="warned", release_id=release_id, says=found["says"],
                        reason=stored["reason"], signals=stored["signals"], figures=stored["figures"])
    log.warning("scenario %s: %s", name, stored["reason"])
    return stored


async def after_hold(host: Host, run: GateRun, held: StepOutcome) -> None:
    """A candidate another step held (the held-out check, the drift bound): the trend may warn as well."""
    found = await read(host, run)
    if found is not None:
        await raise_warning(host, run, found, held.release_id, held.step)


# --- the user acts -----------------------------------------------------------------------------------------------


async def clear(store: Any, events: Any, name: str, how: str) -> Any:
    """The user acted on ``name``'s warning (``how``: resumed, updated, accepted): write the new state, say so on
    ``/reef/events``; the scenario (unchanged when nothing needed clearing: a resume with no warning standing, an
    update of a scenario never warned). ``accepted`` with no warning standing is a ``Conflict``."""
    from daemon.errors import Conflict

    scenario = await store.scenarios.get(name)
    if how == "accepted" and not scenario.warned:
        raise Conflict(f"no early warning stands on scenario {name!r}: nothing to accept", scenario=name)
    if (how == "resumed" and not scenario.warned) or (how == "updated" and scenario.warning is None):
        return scenario
    new = cleared(how, scenario.warning)
    scenario = await store.scenarios.set_warning(name, new)
    events.publish("warning", scenario=name, state=new["state"], how=how)
    return scenario


async def standing(store: Any) -> dict[str, dict[str, Any]]:
    """Every scenario's early-warning state that was ever written, by scenario (``GET /reef/status``, ``/metrics``)."""
    return {s.name: s.warning for s in await store.scenarios.warned()}
