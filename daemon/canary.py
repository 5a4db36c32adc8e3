"""Canary releases: a candidate serves a share of new runs beside the head, live scores decide.

- Start: a candidate held for review (a pending release) becomes a scenario's canary (``POST
  /reef/scenarios/<s>/canary``, ``reef releases canary ID``): a ``share`` of new runs goes to it, the rest to the
  head it is compared with. One canary per scenario; its row in the record store (``canaries``) is what survives a
  restart, with the same arms and counts (both are derived, never kept in memory only).
- Arms. A run stays on one release from start to end: the arm is a hash of the canary's release id and the run
  (or, for clients without runs, the session: ``daemon/sessions.session_key``); a request with neither is drawn
  on its own. A pinned release (``x-reef-release-id``) is served as pinned. Every record names the release that
  served it, so the arms' exchanges and reports are read back from the store.
- Decision: an anytime-valid test by betting (``daemon/betting.py``), checked every ``CHECK_S`` while a canary
  runs. The i-th report of each arm (scores clipped to [0, 1]) make a paired difference; two bettors stake on the
  canary being better and worse (aGRAPA's stake, fixed before each difference) and the canary is promoted when the
  first one's wealth reaches ``2 / alpha``, ended when the second's does: a wrong verdict with equal arms has
  probability at most ``alpha``, however often it is checked. Chosen over the per-arm Hoeffding confidence sequences
  it replaced, which needed about 2,000 reports to see a difference of 0.2 on pass/fail scores (a union bound over
  sample sizes, two intervals to separate): betting adapts to the scores' variance and needs a median of 112 canary
  reports for +0.2 and 53 for -0.3 (``bench/canary.py``). No model of the scores is assumed (any scores in [0, 1]).
  People read intervals by betting too (``intervals``): each arm's mean, and the difference's, which is the
  decision's own (above 0 exactly when it promotes, below exactly when it ends). Ended as a tie when both arms have
  ``max_reports`` reports; ended early when its share of failed exchanges exceeds ``max_error_rate`` (after
  ``min_exchanges``), or when it serves more than ``max_latency_ratio`` times slower than the head: its median time to
  first token or time per output token (after ``min_exchanges`` complete exchanges on each arm: a release that
  makes the agent's every request slower is worse whatever its scores; whole exchanges would count a longer answer
  at the same speed as a slower one). Guards that need no score end it sooner: from ``guard_answers`` (10) answers on each arm,
  a share of empty answers more than ``max_empty_excess`` (0.3) above the head's, or a median answer shorter than
  ``min_length_ratio`` (0.25) of the head's (a candidate that stopped answering, which a scorer counting words or
  commas would rate well), or a share of answers that loop (``daemon/loops.py``) more than ``max_loop_excess``
  (0.3) above the head's: a candidate that says a sentence again and again past the held-out check's first tokens,
  read on the answers its arm served, at their full length.
- Bounds (``max_answers``, ``max_hours``; set by the learning loop from a weights recipe's ``canary_answers`` and
  ``canary_hours``, off for a canary started by hand): once it has served ``max_answers`` answers with no guard
  tripped and no verdict from the test, a canary is decided by what its scores say so far: promoted (``quiet``) when
  it has no paired report or its paired difference is not below 0 at the 5% level (``BOUND_Z`` standard errors,
  one look), ended (``lower``) when it is; one still
  undecided after ``max_hours`` is promoted (``expired``). The pace of learning is the traffic's: a release waits
  for its canary's verdict (the next step trains ahead meanwhile: ``daemon/lineage.py``), and a user who scores every answer would otherwise wait for the
  test's ~100 reports an arm per step; the test's error rate holds for its own verdicts (promoted, ended), the
  bound is a decision on a point estimate, made only for a candidate that passed its gate and held-out check. ``describe`` words a running canary for people, with the
  smallest difference it can still decide by its end (``betting.detectable``).
- The head it is compared with must stay the head: when a rollback or a promote moves it while the canary runs, the
  canary is ended (``canary-head-moved``) with the reason, since its head arm no longer serves anyone; a new canary
  can start against the new head. A run on an ended canary's arm is served on that arm to its end, after a restart
  too (the ended canaries are read back from the chain's rejection log).
- Ending is on the chain: a promotion is a ``promote`` release whose manifest holds the verdict and the figures;
  an end is the candidate's rejection, with the same. ``reef releases canary-end [--promote]`` does it by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from daemon import betting
from daemon.errors import BadRequest, NotFound, ReefError
from daemon.services import Daemon

if TYPE_CHECKING:
    from daemon.records import Scenario
    from daemon.releases import Release

log = logging.getLogger("reef.canary")

CHECK_S = 0.5  # how often running canaries are judged
ENDED_LOOKBACK = 200  # rejections read back (newest first) for canaries ended before a restart: runs on them go on
DEFAULTS: dict[str, float | int | None] = {
    "alpha": 0.05, "max_reports": 400, "max_error_rate": 0.2, "min_exchanges": 20, "max_latency_ratio": 2.0,
    "max_empty_excess": 0.3, "min_length_ratio": 0.25, "max_loop_excess": 0.3, "guard_answers": 10,
    # the bounds a learning canary ends by (recipes' canary_answers and canary_hours); None (a canary started by
    # hand): off, it runs until its scores, its guards, max_reports or a person decide
    "max_answers": None, "max_hours": None}
OPTIONAL = ("max_answers", "max_hours")  # settings that may be None (off)
# verdicts that promote the candidate: its scores showed it better; or a bound was reached with no guard tripped and
# no score verdict (``quiet``: max_answers answers with no report on its arm; ``expired``: max_hours)
PROMOTING = ("promoted", "quiet", "expired")
# at its answer bound, a canary is ended as ``lower`` when its paired difference is below 0 by this many standard
# errors: a one-sided test at 5%, made once (equal arms ended about 5% of the time, as the betting test's alpha)
BOUND_Z = 1.645
EMPTY_TOKENS = 1  # an answer of at most this many tokens says nothing (the end-of-text token alone)


def radius(n: int, delta: float) -> float:
    """Half-width of the anytime-valid Hoeffding interval for the mean of ``n`` scores in [0, 1]: the rule the
    betting test replaced, which ``bench/canary.py`` measures beside it."""
    if n == 0:  # pragma: no mutate (a count is never below 0: <= is ==)
        return math.inf
    return math.sqrt(math.log(math.pi ** 2 * n ** 2 / (3 * delta)) / (2 * n))


@dataclass(frozen=True)
class Decision:
    verdict: str | None  # promoted | ended | tie | errors | latency | empty | short | loops | quiet | lower | expired
    # | None
    # (and, from outside ``decide``: head-moved, unreadable)
    reason: str
    figures: dict[str, Any]


def decide(head: list[float], canary: list[float], *, alpha: float, max_reports: int,
           errors: int = 0, exchanges: int = 0, max_error_rate: float = 1.0, min_exchanges: int = 20,
           head_ms: list[float] | None = None, canary_ms: list[float] | None = None,
           head_speed: dict[str, list[float]] | None = None, canary_speed: dict[str, list[float]] | None = None,
           max_latency_ratio: float = math.inf, head_tokens: list[int] | None = None,
           canary_tokens: list[int] | None = None, max_empty_excess: float = 1.0, min_length_ratio: float = 0.0,  # pragma: no mutate (guards off: an excess above 1 or a ratio below 0 is off too)
           head_loops: list[bool] | None = None, canary_loops: list[bool] | None = None,
           max_loop_excess: float = 1.0, guard_answers: int = 10, max_answers: int | None = None, age_s: float = 0.0,  # pragma: no mutate (the loop guard off: an excess above 1 is off too; an age below 0 reads as none)
           max_age_s: float | None = None) -> Decision:
    """The canary's verdict from both arms' scores so far (clipped to [0, 1]), its failed exchanges, both arms'
    times of complete exchanges (ms), how fast each served (``*_speed``: ``ttft`` and ``tpot`` lists, ms, from
    ``arm_outcomes``; when given, the latency guard reads them instead of whole exchanges), and their answers'
    lengths in tokens and whether each loops (the guards that need no score), and its
    bounds: ``max_answers`` canary answers with no report on its arm, or ``max_age_s`` since it started (``age_s``),
    promote it when nothing else decided (None: no such bound)."""
    h = [min(1.0, max(0.0, x)) for x in head]
    c = [min(1.0, max(0.0, x)) for x in canary]
    mh = sum(h) / len(h) if h else None
    mc = sum(c) / len(c) if c else None
    figures: dict[str, Any] = {
        "canary_reports": len(c), "head_reports": len(h), "canary_mean": mc, "head_mean": mh, "alpha": alpha,
        "canary_exchanges": exchanges, "canary_errors": errors,
        "canary_p50_ms": _median(canary_ms), "head_p50_ms": _median(head_ms),
    }
    guard = _guard(head_tokens or [], canary_tokens or [], max_empty_excess=max_empty_excess,
                   min_length_ratio=min_length_ratio, guard_answers=guard_answers, head_loops=head_loops or [],
                   canary_loops=canary_loops or [], max_loop_excess=max_loop_excess)
    figures.update(guard.figures)
    if guard.verdict is not None:
        return Decision(guard.verdict, guard.reason, figures)
    if exchanges >= min_exchanges and errors / exchanges > max_error_rate:
        return Decision("errors", f"the canary failed {errors} of {exchanges} exchanges, more than "
                        f"{max_error_rate:.0%}", figures)
    slower = _slower(figures, head_ms, canary_ms, head_speed, canary_speed, min_exchanges, max_latency_ratio)
    if slower is not None:
        return Decision("latency", slower, figures)
    ev = betting.evidence(h, c, alpha=alpha)
    figures.update({"pairs": ev.pairs, "difference": None if ev.mean is None else round(ev.mean, 4),
                    "evidence_better": round(ev.better, 4), "evidence_worse": round(ev.worse, 4),
                    "evidence_needed": round(ev.threshold, 4)})
    if ev.verdict == "better":
        return Decision("promoted", f"canary {mc:.3f} > head {mh:.3f} at error rate {alpha} "
                        f"({len(c)} and {len(h)} reports, {ev.pairs} pairs)", figures)
    if ev.verdict == "worse":
        return Decision("ended", f"canary {mc:.3f} < head {mh:.3f} at error rate {alpha} "
                        f"({len(c)} and {len(h)} reports, {ev.pairs} pairs)", figures)
    by_end = float(max_reports)  # the pairs it may still see: the bound on reports, or what its rate so far gives
    if max_age_s is not None and age_s > 0:
        by_end = min(by_end, ev.pairs + ev.pairs / age_s * max(0.0, max_age_s - age_s))
    smallest = betting.detectable(by_end, ev.var, alpha)
    figures.update({"pairs_by_end": round(by_end, 1), "detectable": None if smallest is None else round(smallest, 3)})
    if len(c) >= max_reports and len(h) >= max_reports:
        return Decision("tie", f"no difference found in {max_reports} reports per arm (canary "
                        f"{mc:.3f}, head {mh:.3f}): the head stays", figures)
    answers = len(canary_tokens or ())
    if max_answers is not None and answers >= max_answers and len(head_tokens or ()) >= guard_answers:
        if not ev.pairs:
            return Decision("quiet", f"{answers} answers on the canary's arm tripped no guard, and no paired report "
                            f"came to judge its scores by: promoted on its guards (bound: {max_answers} answers)",
                            figures)
        se = math.sqrt(ev.var / ev.pairs)  # the mean difference's standard error, by the stake's variance
        figures["difference_se"] = round(se, 4)
        if ev.mean is not None and ev.mean >= -BOUND_Z * se:  # pragma: no mutate (a mean exactly at the bound to the last bit: no data gives it)
            return Decision("quiet", f"{answers} answers on the canary's arm tripped no guard, and its scores were "
                            f"not lower than the head's at the 5% level over {ev.pairs} pairs (difference "
                            f"{ev.mean:+.3f}, standard error {se:.3f}): promoted at its bound of {max_answers} "
                            "answers", figures)
        return Decision("lower", f"{answers} answers on the canary's arm tripped no guard, but its scores were lower "
                        f"than the head's at the 5% level over {ev.pairs} pairs (difference {ev.mean:+.3f}, "
                        f"standard error {se:.3f}): ended at its bound of {max_answers} answers", figures)
    if max_age_s is not None and age_s >= max_age_s:
        return Decision("expired", f"undecided after {_duration(max_age_s)}: no guard tripped and its scores "
                        f"({len(c)} and {len(h)} reports) did not show it worse: promoted", figures)
    return Decision(None, "undecided", figures)


def describe(status: dict[str, Any], now: float | None = None) -> list[str]:
    """A running canary in lines a person reads (``reef status``, ``reef releases list``, the TUI, the release
    page): its share and bounds, each arm's reports, mean, interval and guard figures, the difference's interval
    (the decision's: ``intervals``), the smallest difference it can still decide by its end (``betting.detectable``
    over ``pairs_by_end``), and the bettors' evidence."""
    f, st = status.get("figures") or {}, status.get("settings") or {}

    def num(v: Any, fmt: str = ".3f") -> str:
        return "-" if v is None else format(v, fmt)

    def arm(name: str) -> str:
        iv = f.get(f"{name}_interval")
        ms = f.get(f"{name}_p50_ms")
        failed = f", {f.get('canary_errors', 0)} of {f.get('canary_exchanges', 0)} failed" if name == "canary" else ""  # pragma: no mutate (two names, head after canary: <= is ==)
        return (f"  {name + ' arm:':<12}{f.get(f'{name}_reports', 0)} reports, mean {num(f.get(f'{name}_mean'))}"
                + (f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv else "") + f"; {f.get(f'{name}_answers', 0)} answers, "
                f"{num(f.get(f'{name}_empty_rate'), '.0%')} empty, {num(f.get(f'{name}_loop_rate'), '.0%')} "
                f"looping, median {num(f.get(f'{name}_p50_tokens'), 'g')} "
                f"tokens{failed}, median {num(ms, '.0f')} ms")

    age = max(0.0, (time.time() if now is None else now) - float(status.get("started_at") or 0))
    bounds = [f"running {_duration(age)}"]
    if st.get("max_hours") is not None:
        bounds.append(f"promoted undecided at {_duration(st['max_hours'] * 3600)}")
    if st.get("max_answers") is not None:
        bounds.append(f"promoted on its guards at {st['max_answers']} answers if no report comes")
    smallest = f.get("detectable")
    decides = (f"decides a difference of {smallest:.2f} or more by its end" if smallest is not None else
               "can decide no difference by its end at its reports' rate")
    div = f.get("difference_interval")
    return [f"canary {str(status.get('release_id'))[:12]} serves {status.get('share', 0):.0%} of new runs beside "
            f"{str(status.get('base_id'))[:12]} (alpha {f.get('alpha', st.get('alpha'))}; {', '.join(bounds)})",
            arm("canary"), arm("head"),
            f"  difference canary - head {num(f.get('difference'), '+.3f')}"
            + (f" [{div[0]:+.2f}, {div[1]:+.2f}]" if div else "") + f" over {f.get('pairs', 0)} paired reports: "
            "promoted once it lies above 0, ended once below",
            f"  {decides} (about {num(f.get('pairs_by_end'), '.0f')} paired reports, {f.get('pairs', 0)} so far); "
            f"evidence better {num(f.get('evidence_better'), '.2f')}, worse {num(f.get('evidence_worse'), '.2f')} "
            f"of {num(f.get('evidence_needed'), '.2f')} needed"]


def _duration(s: float) -> str:
    return f"{s / 3600:.3g} h" if s >= 3600 else f"{s / 60:.3g} min" if s >= 60 else f"{s:.3g} s"


def _guard(head: list[int], canary: list[int], *, max_empty_excess: float, min_length_ratio: float,
           guard_answers: int, head_loops: list[bool], canary_loops: list[bool], max_loop_excess: float) -> Decision:
    """The guards that need no score, on the arms' answer lengths in tokens: from ``guard_answers`` canary answers
    on (and as many on the head, so its rates mean something), the canary ends when its share of empty answers (at
    most ``EMPTY_TOKENS``) exceeds the head's by more than ``max_empty_excess``, or when its median answer is
    shorter than ``min_length_ratio`` of the head's. A candidate that stopped answering is ended before anyone
    scores it: scorers that count commas or words would rate its silence well. Likewise, from ``guard_answers``
    answers with their tokens on each arm (``*_loops``: whether each loops), when its share of answers that loop
    exceeds the head's by more than ``max_loop_excess``."""
    def empty(xs: list[int]) -> float | None:
        return round(sum(x <= EMPTY_TOKENS for x in xs) / len(xs), 4) if xs else None

    figures: dict[str, Any] = {"canary_answers": len(canary), "head_answers": len(head),
                               "canary_empty_rate": empty(canary),
                               "head_empty_rate": empty(head), "canary_p50_tokens": _median([float(x) for x in canary]),
                               "head_p50_tokens": _median([float(x) for x in head]),
                               "canary_loop_rate": _share(canary_loops), "head_loop_rate": _share(head_loops)}
    if len(canary) < guard_answers or len(head) < guard_answers:
        return Decision(None, "undecided", figures)
    ce, he = figures["canary_empty_rate"], figures["head_empty_rate"]
    if round(ce - he, 4) > max_empty_excess:  # (rates of 4 decimals: 0.4 - 0.1 is 0.30000000000000004)
        return Decision("empty", f"{ce:.0%} of the canary's {len(canary)} answers were empty against {he:.0%} of the "
                        f"head's: it stopped answering (bound: {max_empty_excess:.0%} more than the head)", figures)
    cl, hl = figures["canary_p50_tokens"], figures["head_p50_tokens"]
    if hl > 0 and cl / hl < min_length_ratio:  # (a ratio: 0.55 * 100 is 55.00000000000001)  # pragma: no mutate (a median length is never below 0: != is >)
        return Decision("short", f"the canary's median answer is {cl:g} tokens against the head's {hl:g}: shorter "
                        f"than {min_length_ratio:g} of it", figures)
    if len(canary_loops) >= guard_answers and len(head_loops) >= guard_answers:
        cr, hr = figures["canary_loop_rate"], figures["head_loop_rate"]
        if round(cr - hr, 4) > max_loop_excess:
            return Decision("loops", f"{cr:.0%} of the canary's {len(canary_loops)} answers loop (a run of tokens "
                            f"said again and again) against {hr:.0%} of the head's {len(head_loops)}: its answers "
                            f"degenerate (bound: {max_loop_excess:.0%} more than the head)", figures)
    return Decision(None, "undecided", figures)


def _share(flags: list[bool]) -> float | None:
    return round(sum(flags) / len(flags), 4) if flags else None


MAX_WHOLE = 10 ** 9  # max_reports and min_exchanges: a bound past any canary's life
MAX_HOURS = 10 ** 6


def unreadable(row: dict[str, Any], e: ReefError) -> str:
    return (f"its release {row['release_id'][:12]} could not be read from the release store ({e.message}): ended, "
            "not promoted; the head serves its share of runs")


def settings_of(body: dict[str, Any]) -> dict[str, Any]:
    """A canary's settings from a request body (``DEFAULTS`` for what it leaves out): a ``BadRequest`` naming the
    setting for a value out of range, not finite or not a number, and for an unknown key."""
    unknown = sorted(set(body) - {"release_id", "share", *DEFAULTS})
    if unknown:
        raise BadRequest(f"unknown keys {', '.join(unknown)} (known: release_id, share, {', '.join(DEFAULTS)})",
                         param=unknown[0])
    settings = dict(DEFAULTS)
    for key, default in DEFAULTS.items():
        value = body.get(key, default)
        whole = key in ("max_reports", "min_exchanges", "guard_answers", "max_answers")
        fraction = key in ("alpha", "max_error_rate", "max_empty_excess", "min_length_ratio", "max_loop_excess")
        if value is None and key in OPTIONAL:
            settings[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0 or (
                fraction and value >= 1) or (
                key == "max_latency_ratio" and value < 1) or (whole and (value != int(value) or value > MAX_WHOLE)) or (
                key == "max_hours" and value > MAX_HOURS):
            kind = ("a fraction in (0, 1)" if fraction else
                    "a finite ratio of at least 1" if key == "max_latency_ratio" else
                    f"a positive number of hours up to {MAX_HOURS}, or null" if key == "max_hours" else
                    f"a positive whole number up to {MAX_WHOLE}")
            raise BadRequest(f"{key} must be {kind}, got {value!r}", param=key)
        settings[key] = int(value) if whole else value
    return settings


def _slower(figures: dict[str, Any], head_ms: list[float] | None, canary_ms: list[float] | None,
            head_speed: dict[str, list[float]] | None, canary_speed: dict[str, list[float]] | None,
            min_exchanges: int, ratio: float) -> str | None:
    """Why the canary serves more than ``ratio`` times slower than the head (after ``min_exchanges`` on each arm),
    or None. By its time to first token and its time per output token when the arms' speeds are known: a candidate
    that answers three times longer at the same speed is not slower (its length is its scores' business, and a
    shorter one the length guard's); by whole exchanges otherwise. Adds the medians to ``figures``."""
    if head_speed is None or canary_speed is None:
        ch, hh = figures["canary_p50_ms"], figures["head_p50_ms"]
        if (ch is not None and hh is not None and min(len(canary_ms or ()), len(head_ms or ())) >= min_exchanges
                and ch > ratio * max(hh, 1e-3)):
            return f"the canary's median exchange took {ch:.0f} ms, more than {ratio:g}x the head's {hh:.0f} ms"
        return None
    why = None
    for key, what in (("ttft", "time to first token"), ("tpot", "time per output token")):
        cs, hs = canary_speed.get(key) or [], head_speed.get(key) or []
        cm, hm = _median(cs), _median(hs)
        figures[f"canary_p50_{key}_ms"], figures[f"head_p50_{key}_ms"] = cm, hm
        if (why is None and cm is not None and hm is not None and min(len(cs), len(hs)) >= min_exchanges
                and cm > ratio * max(hm, 1e-3)):
            why = (f"the canary's median {what} was {cm:.1f} ms, more than {ratio:g}x the head's {hm:.1f} ms "
                   "(whatever its answers' lengths)")
    return why


def _median(xs: list[float] | None) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    mid = len(s) // 2
    return round(s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2, 3)


@functools.lru_cache(maxsize=32)  # judged every CHECK_S and shown on every status: computed once per new report  # pragma: no mutate (a cache: its size or absence changes no answer)
def intervals(head: tuple[float, ...], canary: tuple[float, ...], alpha: float) -> dict[str, list[float] | None]:
    """The intervals people read, by betting, from both arms' scores: each arm's mean at ``alpha / 2`` (both hold at
    once with probability ``1 - alpha``; ``betting.mean_interval``), and the difference canary - head over the
    decision's pairs at ``alpha`` (``betting.interval``), whose bettors at 0 are the decision's: it lies above 0
    exactly when the scores promote the canary, below 0 exactly when they end it."""
    def shown(iv: tuple[float, float] | None) -> list[float] | None:
        return None if iv is None else [round(iv[0], 4), round(iv[1], 4)]

    return {"canary_interval": shown(betting.mean_interval(canary, alpha / 2)),
            "head_interval": shown(betting.mean_interval(head, alpha / 2)),
            "difference_interval": shown(betting.interval(betting.pairs(head, canary), alpha))}


def arm_key(headers: Any, run: str | None) -> str | None:
    """What keeps a request on one arm: its run (a wrapped agent's), else its session (``session_key``)."""
    from daemon.sessions import session_key

    return f"run={run}" if run else session_key(headers, None)


def in_canary(release_id: str, key: str | None, share: float) -> bool:
    """Whether the run (or session) ``key`` is served by the canary: a stable hash, so a run never changes arm."""
    if key is None:
        return random.random() < share  # pragma: no mutate (a draw exactly at the share has probability 0)
    digest = hashlib.blake2b(f"{release_id}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2 ** 64 < share  # pragma: no mutate (a hash exactly at the share: 1 in 2^64)


class Canaries:
    """The running canaries of a daemon: arm assignment on the serve path (a dict look-up and a hash), and the
    loop that judges them."""

    def __init__(self, reef: Daemon) -> None:
        self.reef = reef
        self.active: dict[str, dict[str, Any]] = {}  # scenario -> its canaries row
        self._releases: dict[str, Release] = {}
        self.ended: dict[str, set[str]] = {}  # scenario -> ended canaries (read from the chain once, then kept)
        self._ended_read: set[str] = set()  # scenarios whose ended canaries were read from the rejection log
        self._task: asyncio.Task[None] | None = None
        self._judging = asyncio.Lock()
        # told each end (scenario, promoted): the learning loop, which waits while a canary runs (set by the daemon)
        self.on_end: Callable[[str, bool, str | None], None] | None = None

    async def start(self) -> None:
        for row in await self.reef.store.canaries.running():
            self.active[row["scenario"]] = row
        if self.active:
            self._ensure_loop()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="reef-canaries")

    # --- the serve path ------------------------------------------------------------------------------------

    async def arm(self, scenario: Scenario, key: str | None) -> Release | None:
        """The canary's release when this run is in its share; None: the head serves. A candidate the release store
        can no longer read (its commit lost) ends its canary here, on the run that found it, and the head serves
        that run: nothing could have been served on that arm, and the judge alone would never reach an end."""
        row = self.active.get(scenario.name)
        if row is None or not in_canary(row["release_id"], key, row["share"]):
            return None
        return await self._readable(scenario, row)

    async def _readable(self, scenario: Scenario, row: dict[str, Any]) -> Release | None:
        try:
            return await self._release(row)
        except ReefError as e:
            log.error("canary of %s: its candidate %s cannot be read: %s", scenario.name, row["release_id"][:12],
                      e.message)
            async with self._judging:
                if self.active.get(scenario.name) is row:
                    await self.end(scenario, promote=False, verdict="unreadable", reason=unreadable(row, e))
            return None

    async def pinned(self, scenario: Scenario, release_id: str) -> Release | None:
        """The running canary when a request pins it (a wrapper pins the harness it installed for the run), or
        one that ended while a run on its arm was still going: that run is served to its end on the arm it got."""
        row = self.active.get(scenario.name)
        if row is not None and row["release_id"] == release_id:  # (unreadable: ended, and the pin is refused)
            return await self._readable(scenario, row)
        if scenario.name not in self._ended_read:  # ended before this daemon started: the chain says which
            self._ended_read.add(scenario.name)
            for rej in await self.reef.chains.rejections(scenario.name, ENDED_LOOKBACK):
                if rej.verdict.startswith("canary-") and rej.candidate:
                    self.ended.setdefault(scenario.name, set()).add(rej.candidate)
        if release_id in self.ended.get(scenario.name, ()):
            return await self.reef.chains.release(release_id)
        return None

    async def _release(self, row: dict[str, Any]) -> Release:
        rel = self._releases.get(row["release_id"])
        if rel is None:
            rel = self._releases[row["release_id"]] = await self.reef.chains.release(row["release_id"])
        return rel

    # --- starting and ending -------------------------------------------------------------------------------

    async def begin(self, scenario: Scenario, body: dict[str, Any]) -> dict[str, Any]:
        release_id = body.get("release_id")
        if not isinstance(release_id, str) or not release_id:
            raise BadRequest("release_id is required: a candidate held for review (reef releases list --all)",
                             param="release_id")
        share = body.get("share", 0.2)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
            raise BadRequest(f"share must be a fraction of new runs in (0, 1), got {share!r}", param="share")
        settings = settings_of(body)
        pending = {r.release_id: r for r in await self.reef.chains.pending(scenario.name)}
        rel = pending.get(release_id) or next((r for rid, r in pending.items() if rid.startswith(release_id)
                                               and len(release_id) >= 7), None)
        if rel is None:
            raise NotFound(f"no candidate {release_id} held for review in scenario {scenario.name!r}; a canary "
                           "serves a pending release (reef releases list --all)", release_id=release_id)
        # a candidate this machine cannot run never serves a share of runs (docs/releases.md#what-a-release-requires)
        await self.reef.chains.check_needs(rel, f"serving release {rel.release_id[:12]} as a canary", fresh=True)
        if rel.serves_weights:  # loaded before it serves anyone: else its first answers wait for the load, behind
            # the head's, and the latency guard counts that wait against it (a burst of 64 requests at once, reef
            # demo's: medians of 1.8 s against 0.5 s, a healthy candidate ended). A load that fails shows as failed
            # exchanges on its arm (chains.preload says nothing), which the error guard counts.
            await self.reef.chains.preload(scenario, rel, await self.reef.engine(scenario.model))
        head = await self.reef.chains.head(scenario)
        row = await self.reef.store.canaries.start(scenario.name, rel.release_id, head.release_id, float(share),
                                                   settings)
        self.active[scenario.name] = row
        self.reef.events.publish("canary.start", scenario=scenario.name, release_id=rel.release_id,
                                 base_id=head.release_id, share=share, settings=settings)
        self._ensure_loop()
        return row

    async def end(self, scenario: Scenario, *, promote: bool, reason: str | None = None,
                  figures: dict[str, Any] | None = None, verdict: str | None = None) -> dict[str, Any]:
        """End the scenario's canary: promote its candidate (a release) or discard it (a rejection), with the
        verdict and figures on the chain either way."""
        row = self.active.get(scenario.name)
        if row is None:
            raise NotFound(f"scenario {scenario.name!r} has no canary", scenario=scenario.name)
        if figures is None:
            figures = (await self._judge(row)).figures
        chains = self.reef.chains
        try:
            cand: Release | None = await chains.release(row["release_id"])
        except ReefError as e:  # its commit lost: it can be neither promoted nor kept; written down as ended
            cand, promote, verdict, reason = None, False, "unreadable", unreadable(row, e)
        verdict = verdict or ("promoted" if promote else "ended")
        reason = reason or f"{'promoted' if promote else 'ended'} by hand"
        metrics = {f"canary_{k}" if not k.startswith(("canary_", "head_")) else k: v for k, v in figures.items()}
        metrics["canary_verdict"] = verdict
        if promote:
            engine = await self.reef.engine(scenario.model)
            rel = await chains.promote(scenario, row["release_id"], None, engine,
                                       summary=f"canary {verdict}: {reason}", metrics=metrics)
            out = {"verdict": verdict, "reason": reason, "release_id": rel.release_id, "step": rel.step}
        else:
            if cand is not None:
                manifest = cand.manifest(metrics={**cand.metrics, **metrics})
            else:  # what the chain can still say of it: the head's kind and recipe, the canary's figures
                from daemon.releases import Manifest

                head = await chains.release(row["base_id"])
                manifest = Manifest(scenario=scenario.name, operation="train", kind=head.kind, recipe=head.recipe,
                                    metrics=metrics)
            await chains.reject(manifest, verdict=f"canary-{verdict}", reason=reason, base=row["base_id"],
                                candidate=row["release_id"])
            out = {"verdict": verdict, "reason": reason, "release_id": None}
        await self.reef.store.canaries.end(scenario.name, row["release_id"])
        self.reef.metrics.canary_ends.labels(verdict).inc()
        for arm in ("head", "canary"):
            for gauge in (self.reef.metrics.canary_reports, self.reef.metrics.canary_mean):
                with contextlib.suppress(KeyError):  # never judged: never set
                    gauge.remove(scenario.name, arm)
        self.active.pop(scenario.name, None)
        self._releases.pop(row["release_id"], None)
        self.ended.setdefault(scenario.name, set()).add(row["release_id"])
        self.reef.events.publish("canary.end", scenario=scenario.name, candidate=row["release_id"], figures=figures,
                                 **out)
        log.info("canary of %s %s: %s", scenario.name, verdict, reason)
        if self.on_end is not None:
            self.on_end(scenario.name, promote, rel.release_id if promote else None)
        return {**out, "figures": figures, "candidate": row["release_id"]}

    async def status(self, name: str) -> dict[str, Any] | None:
        row = self.active.get(name)
        if row is None:
            return None
        d = await self._judge(row)
        out = {**row, "figures": d.figures, "decision": d.verdict, "reason": d.reason}
        return {**out, "lines": describe(out)}

    # --- judging -------------------------------------------------------------------------------------------

    async def _judge(self, row: dict[str, Any], *, shown: bool = True) -> Decision:
        """The canary's decision on what the store holds now; ``shown``: with the intervals people read (for a
        status and an end; the verdict needs none, so the loop's rounds leave them out)."""
        arms = (row["base_id"], row["release_id"])
        got = await self.reef.store.canaries.arm_outcomes(row["scenario"], row["started_at"], arms)
        s = row["settings"]
        head, cand = got[row["base_id"]], got[row["release_id"]]
        m = self.reef.metrics
        for arm, got_arm in (("head", head), ("canary", cand)):
            m.canary_reports.labels(row["scenario"], arm).set(len(got_arm["scores"]))
            if got_arm["scores"]:
                m.canary_mean.labels(row["scenario"], arm).set(sum(got_arm["scores"]) / len(got_arm["scores"]))
        d = decide(head["scores"], cand["scores"], alpha=s["alpha"], max_reports=int(s["max_reports"]),
                   errors=cand["errors"], exchanges=cand["exchanges"], max_error_rate=s["max_error_rate"],
                   min_exchanges=int(s["min_exchanges"]), head_ms=head["ms"], canary_ms=cand["ms"],
                   head_speed={k: head[k] for k in ("ttft", "tpot")},
                   canary_speed={k: cand[k] for k in ("ttft", "tpot")},
                   # (rows from before a bound existed: the bound off, as they were started)
                   max_latency_ratio=s.get("max_latency_ratio", math.inf), head_tokens=head["tokens"],
                   canary_tokens=cand["tokens"], max_empty_excess=s.get("max_empty_excess", 1.0),
                   head_loops=head["loops"], canary_loops=cand["loops"],
                   max_loop_excess=s.get("max_loop_excess", 1.0),  # (rows from before the guard: off)
                   min_length_ratio=s.get("min_length_ratio", 0.0), guard_answers=int(s.get("guard_answers", 10)),
                   max_answers=s.get("max_answers"), age_s=max(0.0, time.time() - row["started_at"]),
                   max_age_s=None if s.get("max_hours") is None else s["max_hours"] * 3600)
        if shown:  # (in a thread: 400 reports an arm take some 0.1 s of pure Python, once per new report)
            d.figures.update(await asyncio.to_thread(intervals, tuple(head["scores"]), tuple(cand["scores"]),
                                                     s["alpha"]))
        return d

    async def _loop(self) -> None:
        while self.active:
            await asyncio.sleep(CHECK_S)
            for name, row in list(self.active.items()):
                try:
                    async with self._judging:
                        if self.active.get(name) is not row:
                            continue
                        scenario = await self.reef.store.scenarios.get(name)
                        head = await self.reef.chains.head(scenario)
                        if head.release_id != row["base_id"]:  # a rollback or a promote moved the head meanwhile
                            await self.end(scenario, promote=False, verdict="head-moved", reason=(
                                f"the head moved from {row['base_id'][:12]} to {head.release_id[:12]} while the canary "
                                "ran (a rollback or a promote): it was compared with a release that no longer serves, "
                                "so it is ended, not promoted; start a new canary against the new head"))
                            continue
                        if (await self._judge(row, shown=False)).verdict is None:
                            continue
                        # again, with the intervals for the chain: the same verdict, unless a report came meanwhile
                        d = await self._judge(row)
                        if d.verdict is None:
                            continue
                        await self.end(scenario, promote=d.verdict in PROMOTING, reason=d.reason,
                                       figures=d.figures, verdict=d.verdict)
                except ReefError as e:  # the store or the chain is away: judged again at the next round
                    log.warning("canary of %s could not be judged: %s", name, e.message)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("judging the canary of %s", name)
