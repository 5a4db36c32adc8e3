"""The held-out check: before a weights candidate serves, its greedy answers to prompts it was never trained on are
compared with the serving head's, and a candidate that stops answering, forgets what the head knew, or drifts too
far from its base is held (not served) with the figures. A harness candidate meets it on the probes: the same model
asked under the candidate's rules file and under the head's (``Rules``; ``daemon/gating/steps.py``), no KL.

The prompts:
- a reserved share of the scenario's own recorded prompts (``heldout_share``, 0.1): a prompt is reserved or not by
  a hash of its token ids, so every exchange of that prompt, before and after a restart, is left out of every
  training batch (``reserved``); the check asks the most recent ``RECORDED`` (16) of them. Fewer than ``ENOUGH``
  reserved yet (too little traffic) is said in the figures (``heldout_note``); the probe set decides then.
- a probe set shipped with Reef (``probes.json``: short checkable questions and instructions written for Reef), or
  the scenario's own (``heldout_probes``: ``[{"prompt": ..., "accept": [...]}, ...]``, checked at
  ``scenarios create/update``). A probe answer is right when it holds an accepted answer as a whole word, case and
  punctuation ignored.

The candidate answers the recorded prompts and every other probe first, and the rest only when that first look
shows a sign of harm (``clean``, ``run``). Both models answer greedily, at most ``heldout_max_tokens`` (16)
tokens to a probe and ``heldout_recorded_tokens`` (48) to a recorded prompt (long enough to see a loop that starts
after an opener: a learned head's "A volcano is a volcano that erupts. It erupts when magma erupts and creates a
volcano. It erupts when ..." passed at 16), through the scenario's engine, all prompts at once (``Engine.answer_many``: the embedded engine decodes
them as one batch beside its users' requests, ``daemon/engines/bulk.py``): the candidate's weights are loaded
beside the head's as an unpublished release (never served to a request) and dropped afterwards; the head's answers
are kept per head release, so a lineage's checks sample the head once.

The figures (``Figures``: the release's ``heldout_*`` metrics) and what holds a candidate (``Figures.hold``):
- degenerate answers: empty, cut short (at most ``SHORT`` tokens where the head said ``LONG`` or more, and no word in
  them: "Paris" or "apple" is a terse answer, "." or "-" is none; a right one-word answer was held for silence when
  reef demo's model learned its "say the word" task and a user's "answer in one word" would have been), or a loop
  (``daemon/loops.py``: half its token pairs repeat, or a run of tokens said twice in a row; counted in tokens, so
  a random model's garbage is a loop whichever way it tokenises); held when the share of silent answers (empty or cut short: it stops
  answering), or of all degenerate ones, or of degenerate ones among the answers to the recorded prompts alone
  (once ``ENOUGH`` are asked: 7 looping answers of 16 are 19% of the 36 a passing check reads, diluted by the
  probes' short answers), rises above the head's by more than ``heldout_max_degenerate`` (0.25).
  The empty share and the mean answer length against the head's are shown.
- probe accuracy, paired with the head's on the same probes: held when the probes the candidate lost outnumber the
  ones it gained by more than the check's noise, ``heldout_probe_z`` (2) standard errors of that paired difference
  (``sqrt(lost + gained)``, the sign test's), and by at least 2. Greedy answers are deterministic, so the noise is
  the spread of which probes happen to flip, measured on the same answers.
- probe accuracy paired with the base's (the chain's first release) the same way: steps that each lose a little,
  each within the noise against its head, add up, and a lineage that forgot what the base knew is held once the
  sum shows beyond the noise (measured: a step at 53% of the probes against its head's 67%, 6 lost and 1 gained,
  passed the head's test alone). The base's answers are asked once and kept.
- KL from the base: the mean per-token KL(candidate || base) of the next-token distributions at the positions of
  the candidate's own held-out answers, the base being the model its adapter applies to (whole weights: the
  serving head), teacher-forced through the engine (``Engine.divergence_many``: both models on the same batched
  rows, so a model's KL from itself is 0 exactly); held above ``heldout_max_kl`` nats per token. An engine that
  cannot score says so (``heldout_kl`` absent, ``heldout_note``); the other figures still decide.

A check that cannot run (the engine is down, it times out after ``heldout_timeout_s``, 600) raises ``CheckFailed``: the
step is written down as failed with the reason, never as passed. ``heldout_check = false`` turns the check off;
every release then says ``heldout: unchecked``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from daemon.errors import BadRequest, CheckFailed, ReefError
from daemon.loops import LOOP, loops

PROBES_FILE = Path(__file__).with_name("probes.json")
RECORDED = 16  # the most recent reserved recorded prompts the check asks
ENOUGH = 16  # reserved recorded prompts below which the figures say the probe set decided
SHORT, LONG = 2, 8  # an answer of at most SHORT tokens where the head said LONG or more was cut short...
WORD = re.compile(r"[^\W_]{2,}|\d")  # ...unless it holds a word (two letters or more) or a number
KL_ANSWERS = 12  # answers the KL is measured on (two teacher-forced forwards each, one at a time: an average,
# which a dozen answers give at a fraction of the forwards; heldout_kl_seconds shows what it costs)
MIN_PROBES = 8  # a user's probe set smaller than this cannot show a loss beyond its noise
MIN_LOST = 2  # the least net loss of probes that holds a candidate, whatever the noise


# --- the probe set ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    prompt: str
    accept: tuple[str, ...]

    def right(self, answer: str) -> bool:
        """Whether ``answer`` holds one of the accepted answers as a whole word (case, punctuation ignored)."""
        words = f" {_norm(answer)} "
        return any(f" {_norm(a)} " in words for a in self.accept)


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w]+", " ", text.lower()).split())


def parse_probes(raw: Any, param: str = "settings.heldout_probes") -> tuple[Probe, ...]:
    """A probe set from JSON (``[{"prompt": text, "accept": [text, ...]}, ...]``); a ``BadRequest`` naming
    ``param`` and the probe when it is malformed."""
    if not isinstance(raw, list) or len(raw) < MIN_PROBES:
        raise BadRequest(f"{param.split('.')[-1]} must be a list of at least {MIN_PROBES} probes "
                         '({"prompt": text, "accept": [text, ...]}): fewer cannot show a loss beyond their noise',
                         param=param)
    out = []
    for i, item in enumerate(raw):
        prompt = item.get("prompt") if isinstance(item, dict) else None
        accept = item.get("accept") if isinstance(item, dict) else None
        if (not isinstance(item, dict) or set(item) - {"prompt", "accept"} or not isinstance(prompt, str)
                or not prompt.strip() or not isinstance(accept, list) or not accept
                or not all(isinstance(a, str) and _norm(a) for a in accept)):
            raise BadRequest(f"{param.split('.')[-1]}[{i}] must be {{\"prompt\": text, \"accept\": [text, ...]}} "
                             f"(a non-empty prompt, at least one accepted answer with a letter or digit), not "
                             f"{json.dumps(item)[:120]}", param=param)
        out.append(Probe(prompt.strip(), tuple(accept)))
    return tuple(out)


@cache
def shipped_probes() -> tuple[Probe, ...]:
    """The probe set shipped with Reef (``probes.json``)."""
    return parse_probes(json.loads(PROBES_FILE.read_text(encoding="utf-8"))["probes"], param="probes.json")


# --- settings ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckSettings:
    """The check's settings, read from a recipe's (``recipes.base.GateSettings`` holds them)."""

    on: bool = True
    share: float = 0.1
    probes: tuple[Probe, ...] = ()
    max_degenerate: float = 0.25
    probe_z: float = 2.0
    max_kl: float = 1.0
    max_tokens: int = 16
    recorded_tokens: int = 48
    timeout_s: float = 600.0

    @property
    def lengths(self) -> tuple[int, int]:
        """The answers' lengths (the probes', the recorded prompts'): kept answer sets are keyed by them."""
        return self.max_tokens, self.recorded_tokens

    def asking(self, recorded: Sequence[str]) -> tuple[int, frozenset[str], int]:
        """``answers``' lengths: ``max_tokens``, and ``recorded_tokens`` for the recorded prompts (one that is also
        a probe is a probe: the same prompt is asked at the same length whichever list it came from)."""
        return self.max_tokens, frozenset(recorded) - {p.prompt for p in self.probes}, self.recorded_tokens

    @classmethod
    def of(cls, settings: Any) -> CheckSettings:
        raw = getattr(settings, "heldout_probes", None)
        return cls(
            on=bool(getattr(settings, "heldout_check", True)),
            share=float(getattr(settings, "heldout_share", cls.share)),
            probes=shipped_probes() if raw is None else parse_probes(raw),
            max_degenerate=float(getattr(settings, "heldout_max_degenerate", cls.max_degenerate)),
            probe_z=float(getattr(settings, "heldout_probe_z", cls.probe_z)),
            max_kl=float(getattr(settings, "heldout_max_kl", cls.max_kl)),
            max_tokens=int(getattr(settings, "heldout_max_tokens", cls.max_tokens)),
            recorded_tokens=int(getattr(settings, "heldout_recorded_tokens", cls.recorded_tokens)),
            timeout_s=float(getattr(settings, "heldout_timeout_s", cls.timeout_s)),
        )


def check_settings(settings: Any) -> None:
    """The held-out settings of a recipe's settings, beyond their types: a ``BadRequest`` naming the setting."""
    ranges = {
        "heldout_share": (0.0, 0.5, "a share of the recorded prompts in [0, 0.5]"),
        "heldout_max_degenerate": (0.0, 1.0, "a rise in the share of degenerate answers in [0, 1]"),
        "heldout_probe_z": (0.5, 10.0, "standard errors in [0.5, 10]"),
        "heldout_max_kl": (0.0, 100.0, "nats per token in (0, 100]"),
        "heldout_max_tokens": (4, 512, "tokens in [4, 512]"),
        "heldout_recorded_tokens": (4, 512, "tokens in [4, 512]"),
        "heldout_timeout_s": (0.0, 3600.0, "seconds in (0, 3600]"),
    }
    for key, (lo, hi, what) in ranges.items():
        value = getattr(settings, key, None)
        if value is None:
            continue
        if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi) or (
                key in ("heldout_max_kl", "heldout_timeout_s") and value <= 0):
            raise BadRequest(f"{key} must be {what}, not {value!r}", param=f"settings.{key}")
    raw = getattr(settings, "heldout_probes", None)
    if raw is not None:
        parse_probes(raw)


# --- which recorded prompts are reserved -------------------------------------------------------------------------


def reserved(prompt_token_ids: Sequence[int], share: float) -> bool:
    """Whether a recorded prompt is kept out of training for the check: a hash of its tokens, so the same prompt
    is reserved every time, on every daemon, before and after a restart."""
    if share <= 0:  # pragma: no mutate (a shortcut: the hash's fraction, in [0, 1), is never below a share <= 0)
        return False
    digest = hashlib.blake2b(",".join(map(str, prompt_token_ids)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < share


def user_prompt(record: Mapping[str, Any]) -> str | None:
    """The user's prompt in a recorded exchange: its last user message with text (tool results left out), read
    through the protocol of the request's format; None when there is none. ``daemon/harness.py`` (promoting a run
    into a task) and the learner use it too."""
    from daemon.protocols.formats import FORMATS

    proto = FORMATS.get(record.get("format") or "")
    if proto is None or not isinstance(record.get("request"), dict):
        return None
    try:
        messages = proto.parse_request(record["request"]).messages
    except Exception:  # noqa: BLE001 - a request recorded as it came, then refused: it has no prompt to take
        return None
    texts = [m.text.strip() for m in messages if m.role == "user" and m.text.strip()]
    return texts[-1] if texts else None


# --- answers and figures -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    text: str
    prompt_token_ids: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()  # EOS included when the model stopped
    logprobs: tuple[float, ...] = ()

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


def degenerate(answer: Answer, head: Answer | None = None) -> str | None:
    """Why an answer is degenerate (``empty``, ``short``: cut short, no word left where the head answered at length, ``loop``:
    ``daemon/loops.py``), or None."""
    if not answer.text.strip():
        return "empty"
    if head is not None and answer.tokens <= SHORT and head.tokens >= LONG and not WORD.search(answer.text):
        return "short"
    # a loop in tokens, not words: "orersorersorers" is one word and the same loop as "large large large"
    units: Sequence[Any] = answer.token_ids if len(answer.token_ids) >= LOOP else answer.text.split()
    return "loop" if loops(units) else None


@dataclass
class Figures:
    """What the check measured: the candidate's and the head's answers compared, and why it holds (or None)."""

    recorded: int  # reserved recorded prompts asked
    probes: int
    empty: float  # share of the candidate's answers that are empty
    head_empty: float
    silent: float  # share of the candidate's answers that are empty or cut short: it stops answering
    head_silent: float
    degenerate: float  # share of the candidate's answers that are degenerate (empty, cut short, a loop)
    head_degenerate: float
    recorded_degenerate: float  # the same share among the answers to the recorded prompts alone (0: none asked)
    head_recorded_degenerate: float
    length_ratio: float | None  # the candidate's mean answer length (tokens) over the head's
    probe_accuracy: float
    head_probe_accuracy: float
    probes_lost: int  # probes the head answered right and the candidate wrong
    probes_gained: int
    probe_noise: float  # the net loss of probes the check reads as noise
    kl: float | None  # nats per token from the base, on the candidate's answers; None: the engine cannot score
    base_probe_accuracy: float | None = None  # the same probes against the base's answers (None: the head is the base)
    probes_lost_base: int = 0
    probes_gained_base: int = 0
    base_probe_noise: float = 0.0
    seconds: float = 0.0
    answer_seconds: float = 0.0  # of which: the answers (the head's too when not kept from an earlier check)
    kl_seconds: float = 0.0  # and the KL's forwards
    head_sampled: int = 0  # prompts the head was asked by this check (the others' answers were kept)
    prefetch_seconds: float | None = None  # the head's answers asked during training (overlapped with it)
    tokens: float | None = None  # the candidate's mean answer length, tokens (the early warning reads its trend)
    head_tokens: float | None = None
    notes: list[str] = field(default_factory=list)
    hold: str | None = None  # why the candidate is held

    def metrics(self) -> dict[str, Any]:
        """The release's ``heldout_*`` metrics (scalars: a manifest's metrics are)."""
        out: dict[str, Any] = {
            "heldout": "held" if self.hold else "passed",
            "heldout_recorded": self.recorded, "heldout_probes": self.probes,
            "heldout_empty": round(self.empty, 4), "heldout_head_empty": round(self.head_empty, 4),
            "heldout_silent": round(self.silent, 4), "heldout_head_silent": round(self.head_silent, 4),
            "heldout_degenerate": round(self.degenerate, 4),
            "heldout_head_degenerate": round(self.head_degenerate, 4),
            "heldout_recorded_degenerate": round(self.recorded_degenerate, 4),
            "heldout_head_recorded_degenerate": round(self.head_recorded_degenerate, 4),
            "heldout_probe_accuracy": round(self.probe_accuracy, 4),
            "heldout_head_probe_accuracy": round(self.head_probe_accuracy, 4),
            "heldout_probes_lost": self.probes_lost, "heldout_probes_gained": self.probes_gained,
            "heldout_probe_noise": round(self.probe_noise, 3), "heldout_seconds": round(self.seconds, 3),
            "heldout_answer_seconds": round(self.answer_seconds, 3), "heldout_kl_seconds": round(self.kl_seconds, 3),
            "heldout_head_sampled": self.head_sampled,
        }
        if self.base_probe_accuracy is not None:
            out.update(heldout_base_probe_accuracy=round(self.base_probe_accuracy, 4),
                       heldout_probes_lost_base=self.probes_lost_base,
                       heldout_probes_gained_base=self.probes_gained_base,
                       heldout_base_probe_noise=round(self.base_probe_noise, 3))
        if self.prefetch_seconds is not None:
            out["heldout_prefetch_seconds"] = round(self.prefetch_seconds, 3)
        if self.length_ratio is not None:
            out["heldout_length_ratio"] = round(self.length_ratio, 4)
        if self.tokens is not None and self.head_tokens is not None:
            out["heldout_tokens"], out["heldout_head_tokens"] = round(self.tokens, 2), round(self.head_tokens, 2)
        if self.kl is not None:
            out["heldout_kl"] = round(self.kl, 4)
        if self.notes:
            out["heldout_note"] = "; ".join(self.notes)
        if self.hold:
            out["heldout_reason"] = self.hold
        return out


def figures(candidate: Sequence[Answer], head: Sequence[Answer], probes: Sequence[Probe], recorded: int,
            kl: float | None, settings: CheckSettings, base: Sequence[Answer] | None = None, *,
            harness: bool = False) -> Figures:
    """The figures of paired answers (the recorded prompts' first, then the probes', same order for both) and the
    decision; ``base``: the base's answers to the probes (None where the head is the base); ``harness``: a harness
    candidate's (the same weights under other rules: no reserved prompts, no KL)."""
    assert len(candidate) == len(head) == recorded + len(probes), (len(candidate), len(head), recorded, len(probes))
    n = len(candidate)
    cand_bad = [degenerate(c, h) for c, h in zip(candidate, head, strict=True)]
    head_bad = [degenerate(h) for h in head]
    right_c = [p.right(a.text) for p, a in zip(probes, candidate[recorded:], strict=True)]
    right_h = [p.right(a.text) for p, a in zip(probes, head[recorded:], strict=True)]
    lost = sum(h and not c for c, h in zip(right_c, right_h, strict=True))
    gained = sum(c and not h for c, h in zip(right_c, right_h, strict=True))
    head_len = sum(h.tokens for h in head)
    fig = Figures(
        recorded=recorded, probes=len(probes),
        empty=sum(b == "empty" for b in cand_bad) / n, head_empty=sum(b == "empty" for b in head_bad) / n,
        silent=sum(b in ("empty", "short") for b in cand_bad) / n,
        head_silent=sum(b in ("empty", "short") for b in head_bad) / n,
        degenerate=sum(b is not None for b in cand_bad) / n, head_degenerate=sum(b is not None for b in head_bad) / n,
        recorded_degenerate=sum(b is not None for b in cand_bad[:recorded]) / max(1, recorded),
        head_recorded_degenerate=sum(b is not None for b in head_bad[:recorded]) / max(1, recorded),
        length_ratio=sum(c.tokens for c in candidate) / head_len if head_len else None,
        probe_accuracy=sum(right_c) / max(1, len(probes)), head_probe_accuracy=sum(right_h) / max(1, len(probes)),
        probes_lost=lost, probes_gained=gained, probe_noise=settings.probe_z * math.sqrt(lost + gained), kl=kl,
        tokens=sum(c.tokens for c in candidate) / n, head_tokens=head_len / n,
    )
    base_lost = base_gained = 0  # pragma: no mutate (read only where base is given, which sets both)
    if base is not None:
        assert len(base) == len(probes), (len(base), len(probes))
        right_b = [p.right(a.text) for p, a in zip(probes, base, strict=True)]
        base_lost = sum(b and not c for c, b in zip(right_c, right_b, strict=True))
        base_gained = sum(c and not b for c, b in zip(right_c, right_b, strict=True))
        fig.base_probe_accuracy = sum(right_b) / max(1, len(probes))
        fig.probes_lost_base, fig.probes_gained_base = base_lost, base_gained
        fig.base_probe_noise = settings.probe_z * math.sqrt(base_lost + base_gained)
    if harness:
        fig.notes.append(HARNESS_NOTE)
    elif recorded < ENOUGH:
        fig.notes.append(f"too little traffic for the reserved share: {recorded} of the scenario's recorded prompts "
                         f"are reserved yet ({ENOUGH} wanted); the probe set decides")
    if kl is None and not harness:
        fig.notes.append("the engine cannot score tokens: KL from the base not measured")
    why = []
    if fig.silent - fig.head_silent > settings.max_degenerate:
        why.append(f"it stops answering: {fig.silent:.0%} of its answers are empty or cut short ({fig.empty:.0%} "
                   f"empty) against the head's {fig.head_silent:.0%}")
    elif fig.degenerate - fig.head_degenerate > settings.max_degenerate:
        why.append(f"its answers degenerate: {fig.degenerate:.0%} are empty, cut short or loops against the head's "
                   f"{fig.head_degenerate:.0%}")
    elif recorded >= ENOUGH and fig.recorded_degenerate - fig.head_recorded_degenerate > settings.max_degenerate:
        why.append(f"its answers to the scenario's own prompts degenerate: {fig.recorded_degenerate:.0%} of "
                   f"{recorded} are empty, cut short or loops against the head's {fig.head_recorded_degenerate:.0%}")
    if lost - gained >= MIN_LOST and lost - gained > fig.probe_noise:
        why.append(f"it forgets: probe accuracy {fig.probe_accuracy:.0%} against the head's "
                   f"{fig.head_probe_accuracy:.0%} ({lost} probes lost, {gained} gained; noise {fig.probe_noise:.1f})")
    elif base is not None and base_lost - base_gained >= MIN_LOST and base_lost - base_gained > fig.base_probe_noise:
        why.append(f"it forgets what the base knew: probe accuracy {fig.probe_accuracy:.0%} against the base's "
                   f"{fig.base_probe_accuracy:.0%} ({base_lost} probes lost, {base_gained} gained since the base; "
                   f"noise {fig.base_probe_noise:.1f})")
    if kl is not None and kl > settings.max_kl:
        why.append(f"it drifts: {kl:.3f} nats per token from its base on held-out prompts, more than "
                   f"heldout_max_kl {settings.max_kl:g}")
    if why:
        fig.hold = ("held-out check: " + "; ".join(why) + "; held, not served (reef releases promote ID serves "
                    "it anyway)")
    return fig


HARNESS_NOTE = ("a harness candidate: the same weights asked under its rules and under the head's (its rules file "
                "as the system prompt); no KL, no reserved prompts")


@dataclass(frozen=True)
class Rules:
    """The system prompts a harness candidate's check asks under: the candidate's rules, the head's, the chain's
    first release's (a harness release's rules file, ``AGENTS.md``)."""

    candidate: str = ""
    head: str = ""
    first: str | None = None  # None: the head is the chain's first release


class KeptAnswers:
    """The answer sets a scenario's checks keep, by (release content, max tokens): the ``SIZE`` most recently used
    (the head's, the chain's first release's, and a newly published head's or a canary's)."""

    SIZE = 4

    def __init__(self) -> None:
        self._sets: OrderedDict[tuple[Any, ...], dict[str, Answer]] = OrderedDict()

    def __call__(self, key: tuple[Any, ...], answers: dict[str, Answer] | None = None) -> dict[str, Answer] | None:
        """The set kept for ``key`` (None: none); with ``answers``, keep them first."""
        if answers is not None:
            self._sets[key] = answers
        got = self._sets.get(key)
        if got is not None:
            self._sets.move_to_end(key)
        while len(self._sets) > self.SIZE:
            self._sets.popitem(last=False)
        return got


# --- running it --------------------------------------------------------------------------------------------------


async def answers(engine: Any, model: str, prompts: Sequence[str], release: Any, max_tokens: int,
                  longer: Collection[str] = (), longer_tokens: int = 0, system: str = "") -> list[Answer]:  # pragma: no mutate (longer_tokens is read only for the prompts in longer, none by default)
    """Greedy answers of ``release`` (an engine ``ReleaseRef``; None: the model itself) to ``prompts``, all asked
    at once (``Engine.answer_many``: the embedded engine decodes them as one batch beside its users' requests), each
    of at most ``max_tokens``, or ``longer_tokens`` for the prompts in ``longer`` (the recorded ones); ``system``:
    the system prompt (a harness release's rules), none by default."""
    from daemon.exchange import internal_exchange

    if not prompts:
        return []
    done = await engine.answer_many([internal_exchange(model, system, p, longer_tokens if p in longer else max_tokens)
                                     for p in prompts], release)
    return [Answer(c.text or "", tuple(c.prompt_token_ids or ()), tuple(c.token_ids or ()), tuple(c.logprobs or ()))
            for c in done]


async def kl_from_base(engine: Any, answers: Sequence[Answer], candidate: Any, base: Any) -> float | None:
    """Mean per-token KL(candidate || base) over the positions of the candidate's own answers (teacher-forced, in
    a few batched forwards where the engine can: ``Engine.divergence_many``; at most ``KL_ANSWERS`` of them, evenly
    spread); None when the engine cannot say."""
    answered = [a for a in answers if a.token_ids]
    step = max(1, -(-len(answered) // KL_ANSWERS))  # spread over the recorded prompts and the probes alike
    picked = answered[::step]
    if not picked:
        return None
    kls = await engine.divergence_many([(list(a.prompt_token_ids), list(a.token_ids)) for a in picked], candidate,
                                       base)
    if kls is None:
        return None
    den = sum(len(kl) for kl in kls)
    return sum(map(sum, kls)) / den if den else None


def clean(fig: Figures, settings: CheckSettings) -> bool:
    """Whether a first look shows no sign of harm at all: no probe lost net (against the head, nor against the
    base), silent and degenerate shares (of all answers, and of the recorded prompts' alone) within half their
    bound of the head's (the KL, measured on the first stage's answers, decides alone). The check then stops there (``run``)."""
    half = settings.max_degenerate / 2
    return (fig.probes_lost <= fig.probes_gained and fig.probes_lost_base <= fig.probes_gained_base
            and fig.silent - fig.head_silent <= half
            and fig.degenerate - fig.head_degenerate <= half
            and fig.recorded_degenerate - fig.head_recorded_degenerate <= half)


async def run(engine: Any, model: str, candidate: Any, head: Any, base: Any, recorded: Sequence[str],
              settings: CheckSettings, head_known: dict[str, Answer] | None = None, *, first_release: Any = None,
              first_known: dict[str, Answer] | None = None,
              rules: Rules | None = None, candidate_known: dict[str, Answer] | None = None,
              ) -> tuple[Figures, dict[str, Answer], dict[str, Answer]]:
    """The check: the figures, and the candidate's and the head's answers by prompt (to keep: the head is asked
    only the prompts it was not asked before, and a published candidate's answers are the new head's). Raises
    ``CheckFailed`` when it cannot run. ``base`` is the model the KL is measured from; ``first_release`` the
    chain's first release, whose probe answers the candidate's are compared with too (None: the head is it), kept
    in ``first_known`` (the caller's, filled here: they are asked once).

    ``rules``: a harness candidate's check: ``candidate``, ``head`` and ``first_release`` are then the weights they
    all serve (None: the model itself), asked under each one's rules as the system prompt; no KL is measured (the
    weights are the same) and the candidate's weights are not unloaded (they are the head's); ``candidate_known``:
    the candidate's answers known already (rules equal to the head's: the head's), not asked again.

    In two stages: the recorded prompts and every other probe first; a candidate that shows no sign of harm
    there (``clean``) passes on them, any other is asked the rest of the probes and decided on all of them. A
    candidate that loses probes beyond the noise of the whole set almost surely loses some in either half (one
    that loses 6 of 36 and gains none shows no loss in the first half about once in a hundred), so the first stage
    costs the check little power and saves a third of its answers on the common case, a candidate that passes."""
    t0 = time.perf_counter()
    first, rest = settings.probes[::2], settings.probes[1::2]
    known = dict(head_known or {})
    firsts = first_known if first_known is not None else {}
    cands: dict[str, Answer] = dict(candidate_known or {})
    spent = {"answer": 0.0, "kl": 0.0}
    head_sampled = 0
    lengths = settings.asking(recorded)
    systems = rules or Rules()
    has_first = first_release is not None if rules is None else rules.first is not None

    async def ask(prompts: Sequence[str]) -> None:
        nonlocal head_sampled
        t = time.perf_counter()
        missing = [p for p in dict.fromkeys(prompts) if p not in known]
        if missing:
            known.update(zip(missing, await answers(engine, model, missing, head, *lengths, system=systems.head),
                             strict=True))
            head_sampled += len(missing)
        if has_first:
            probed = {p.prompt for p in settings.probes}
            missing = [p for p in dict.fromkeys(prompts) if p in probed and p not in firsts]
            if missing:
                firsts.update(zip(missing, await answers(engine, model, missing, first_release, *lengths,
                                                         system=systems.first or ""), strict=True))
        todo = [p for p in dict.fromkeys(prompts) if p not in cands]
        cands.update(zip(todo, await answers(engine, model, todo, candidate, *lengths, system=systems.candidate),
                         strict=True))
        spent["answer"] += time.perf_counter() - t

    async def measure() -> tuple[Figures, int]:
        asked = [*recorded, *(p.prompt for p in first)]
        await ask(asked)
        t = time.perf_counter()
        kl = None if rules is not None else await kl_from_base(engine, [cands[p] for p in asked], candidate, base)
        spent["kl"] = time.perf_counter() - t

        def decide(probes: Sequence[Probe]) -> Figures:
            prompts = [*recorded, *(p.prompt for p in probes)]
            return figures([cands[p] for p in prompts], [known[p] for p in prompts], probes, len(recorded), kl,
                           settings, [firsts[p.prompt] for p in probes] if has_first else None,
                           harness=rules is not None)

        fig = decide(first)
        if not rest or clean(fig, settings):
            return fig, 1
        await ask([p.prompt for p in rest])
        return decide(settings.probes), 2  # pragma: no mutate (the stage is only compared with 1)

    try:
        fig, stages = await asyncio.wait_for(measure(), settings.timeout_s)
    except TimeoutError:
        raise CheckFailed(f"it took longer than heldout_timeout_s {settings.timeout_s:g}") from None
    except CheckFailed:
        raise
    except ReefError as e:
        raise CheckFailed(e.message) from None
    except Exception as e:  # noqa: BLE001 - whatever the engine raised: the check did not run
        raise CheckFailed(f"{type(e).__name__}: {e}") from None
    finally:
        try:
            if rules is None:  # a harness candidate's weights are the head's: they stay
                await engine.unload(candidate)
        except Exception:  # noqa: BLE001 - a candidate left loaded is evicted by the engine's budget later
            pass
    if stages == 1 and rest:
        fig.notes.append(f"passed on the first {len(first)} of {len(settings.probes)} probes: no sign of harm there")
    fig.seconds = time.perf_counter() - t0
    fig.answer_seconds, fig.kl_seconds, fig.head_sampled = spent["answer"], spent["kl"], head_sampled
    return fig, cands, known


def describe(m: Any) -> str | None:
    """What a release's held-out figures say, for people (``reef releases show``, ``list --all``, the release
    page), or None where the check said nothing (a harness release, one from before the check)."""
    state = m.get("heldout") if hasattr(m, "get") else None
    if state is None:
        return None
    if state == "unchecked":
        return "held-out check: unchecked (heldout_check = false)"
    parts = [f"held-out check: {state}"]
    if "heldout_degenerate" in m:
        own = (f", on recorded prompts {m['heldout_recorded_degenerate']:.0%} (head "
               f"{m.get('heldout_head_recorded_degenerate', 0):.0%})" if m.get("heldout_recorded") and
               "heldout_recorded_degenerate" in m else "")
        parts.append(f"degenerate answers {m['heldout_degenerate']:.0%} (head {m.get('heldout_head_degenerate', 0):.0%})"
                     f"{own}, empty {m.get('heldout_empty', 0):.0%}")
    if "heldout_probe_accuracy" in m:
        first = (f", first release {m['heldout_base_probe_accuracy']:.0%}" if "heldout_base_probe_accuracy" in m
                 else "")
        parts.append(f"probes {m['heldout_probe_accuracy']:.0%} right (head {m.get('heldout_head_probe_accuracy', 0):.0%}"
                     f"{first}, noise {m.get('heldout_probe_noise', 0):.1f})")
    if "heldout_length_ratio" in m:
        parts.append(f"length {m['heldout_length_ratio']:.2f}x the head's")
    if "heldout_kl" in m:
        parts.append(f"KL from base {m['heldout_kl']:.3f} nats/token")
    parts.append(f"on {m.get('heldout_recorded', 0)} recorded prompt(s) and {m.get('heldout_probes', 0)} probes")
    line = "; ".join(parts)
    if m.get("heldout_reason"):
        line += f". {m['heldout_reason']}"
    if m.get("heldout_note"):
        line += f" ({m['heldout_note']})"
    return line
