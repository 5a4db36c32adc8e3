"""The ``lessons`` recipe: written feedback and direct instructions become edits of a harness tree.

A harness release is a tree of text files in a neutral layout that adapters render into each coding agent's own
(``adapters/``):

    AGENTS.md                 rules, one ``- `` entry per lesson under a ``## Lessons`` heading
    skills/<name>/SKILL.md    skills (front matter ``name`` and ``description``, then the text)
    commands/<name>.md        commands / prompt templates
    settings.json             agent-neutral settings

Each lesson is screened first (nothing that looks like a secret, no instructions to send files or credentials
anywhere, no paths outside the tree); a refused lesson is written down with its reason and never edits the tree.
An accepted lesson becomes a rule entry (or a skill, when it names one), merged with a similar existing entry
(word overlap) so the rules do not fill with near-duplicates, and the rules are kept within a size cap (oldest
entries dropped first). The edit is plain and deterministic: the same tree and lessons always give the same
candidate, so a crash and retry make the same release.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from daemon.errors import BadRequest, CapReached
from daemon.layout import RULES_FILE, SKILL_NAME, check_tree, rules_of
from recipes.base import (
    Candidate,
    FeedbackReport,
    HarnessContext,
    HeldoutSettings,
    ProposerSpendSettings,
    Recipe,
    Scores,
)

LESSONS_HEADING = "## Lessons"
RULES_PREAMBLE = (
    "# Rules\n\nThese rules are maintained by Reef from feedback on earlier runs. Follow them.\n\n"
    f"{LESSONS_HEADING}\n\n"
)

@dataclass
class LessonsSettings(ProposerSpendSettings, HeldoutSettings):
    gate: str = "always"  # always | review (held until ``reef releases promote``) | compare (on ``tasks``)
    # compare gate: prompts answered by the scenario's model under the current rules and under the candidate's
    # (temperature 0); a task scores 1 when its answer contains ``expect`` (case-insensitive)
    tasks: list[dict[str, Any]] = field(default_factory=list)
    # compare (daemon/gate.py): published when shown better at error rate alpha (None: 0.05), by a lead of at
    # least margin (wins - losses; None: 0) on top of the test; fewer tasks than a clean sweep needs is refused
    margin: float | None = None
    alpha: float | None = None
    max_rules: int = 50  # rule entries kept (oldest dropped first)
    max_rules_bytes: int = 16 * 1024  # size cap of the rules file
    similarity: float = 0.6  # word overlap (Jaccard) at which a lesson replaces an existing entry
    min_chars: int = 4  # shorter feedback is not a lesson
    # a model (any configured model name: the served one, or an upstream) that phrases each lesson as one rule;
    # its answer is screened like any lesson, and an empty, refused or overlong answer falls back to the plain edit
    proposer: str | None = None
    max_chars: int = 1000  # longer feedback is cut at a sentence boundary

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def settings_from(raw: dict[str, Any]) -> LessonsSettings:
    known = set(LessonsSettings.__dataclass_fields__)
    unknown = set(raw) - known
    if unknown:
        raise BadRequest(f"unknown lessons settings: {', '.join(sorted(unknown))}", param="settings")
    s = LessonsSettings(**raw)
    if s.gate not in ("always", "review", "compare"):
        raise BadRequest(f"lessons gate must be always, review or compare, got {s.gate!r}", param="gate")
    for t in s.tasks:
        if not (isinstance(t, dict) and isinstance(t.get("prompt"), str) and isinstance(t.get("expect"), str)):
            raise BadRequest('each lessons task is {"prompt": text, "expect": text}', param="tasks")
    if s.gate == "compare" and not s.tasks:
        raise BadRequest("the compare gate needs tasks: [recipes.lessons] tasks = [{prompt, expect}, ...]",
                         param="tasks")
    for key in ("alpha", "margin"):
        value = getattr(s, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise BadRequest(f"lessons {key} must be a number, not {value!r}", param=f"settings.{key}")
    from recipes.base import check_alpha, check_eval_size

    check_alpha(s, gates=("compare",))
    check_eval_size("lessons", s, len(s.tasks), "tasks")
    from daemon import spend
    from daemon.gating.heldout import check_settings as check_heldout

    check_heldout(s)  # the held-out check's settings (a candidate's rules asked the probes: daemon/gating/steps.py)
    spend.check(s)  # max_proposer_tokens
    if s.max_proposer_tokens is not None and not s.proposer:
        raise BadRequest("max_proposer_tokens caps a proposer model's calls, and lessons calls none without one: set "
                         "proposer (a configured model) too, or leave the cap unset", param="settings.max_proposer_tokens")
    return s


def task_score(task: dict[str, Any], answer: str) -> float:
    return 1.0 if task["expect"].lower() in answer.lower() else 0.0


PROPOSER_PROMPT = (
    "You maintain the rules file of a coding agent. Rewrite the feedback below as one short imperative rule "
    "for the agent (at most 30 words). Answer with the rule only."
)


def proposal(answer: str, limit: int = 300) -> str | None:
    """The rule in a proposer's answer: its first non-empty line, without list marks or quotes; None if unusable."""
    for line in answer.splitlines():
        line = line.strip().lstrip("-*0123456789. ").strip().strip('"').strip()
        if line:
            return line if 4 <= len(line) <= limit else None
    return None


@dataclass
class Lesson:
    """One piece of experience: a report's written feedback (with its score) or a direct instruction."""

    id: str  # the report record holding it
    text: str
    score: float | None = None
    instruction: bool = False
    skill: str | None = None  # write a skill of this name instead of a rule entry
    proposed: str | None = None  # the rule as a proposer model phrased it (used as written when it passes)
    proposer: str | None = None


@dataclass
class Outcome:
    tree: dict[str, bytes]
    applied: list[dict[str, Any]] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)
    unchanged: list[dict[str, Any]] = field(default_factory=list)
    changed: bool = False

    def summary(self) -> str:
        parts = []
        if self.applied:
            parts.append(f"{len(self.applied)} lesson(s) applied")
        if self.unchanged:
            parts.append(f"{len(self.unchanged)} already in the harness")
        if self.refused:
            parts.append(f"{len(self.refused)} refused ({'; '.join(r['reason'] for r in self.refused)})")
        return ", ".join(parts) or "nothing to learn"


# --- screening ------------------------------------------------------------------------------------------------

_SECRETS = [
    (re.compile(r"\bsk-(?:ant-|proj-)?[A-Za-z0-9_-]{16,}"), "an API key (sk-...)"),
    (re.compile(r"\bAKIA[0-9A-Z]{16}\b"), "an AWS access key"),
    (re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"), "a GitHub token"),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"), "a Slack token"),
    (re.compile(r"\bAIza[0-9A-Za-z_-]{30,}"), "a Google API key"),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"), "a private key"),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), "a JSON web token"),
    (re.compile(r"(?i)\b(?:api[_-]?key|secret|password|passwd|token|bearer)\b\s*[:=]\s*['\"]?[^\s'\"]{8,}"),
     "a credential assignment"),
    (re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/-]{20,}"), "a bearer token"),
]
_LONG_RANDOM = re.compile(r"\b[A-Za-z0-9_+/=-]{32,}\b")
_SENSITIVE = re.compile(
    r"(?i)(~/\.ssh|\.ssh/|id_rsa|id_ed25519|\.aws/|credentials|\.env\b|/etc/passwd|/etc/shadow|\.netrc|\.npmrc"
    r"|\.pypirc|\.git-credentials|keychain|private key|secrets?\b|tokens?\b|api keys?|\$REEF_TOKEN|reef/token"
    r"|environment variables|env vars|printenv|\benv\b)"
)
_OUTBOUND = re.compile(
    r"(?i)(https?://|\bcurl\b|\bwget\b|\bnc\b|\bnetcat\b|\bscp\b|\brsync\b|\bftp\b|\bssh\s+\S+@|webhook|pastebin"
    r"|\bupload|\bsend\b|\bpost\b|\bemail\b|\bmail\b|\bexfiltrat)"
)
_UPLOAD_FLAGS = re.compile(r"(?i)(--data(?:-binary|-raw)?\s+@|-d\s*@|-F\s*\S*=@|--upload-file|-T\s)")


def _looks_random(token: str) -> bool:
    classes = sum(bool(re.search(p, token)) for p in (r"[a-z]", r"[A-Z]", r"[0-9]"))
    return classes >= 3 and len(set(token)) >= 16


def screen(text: str) -> str | None:
    """Why ``text`` must not enter a harness, or None when it may."""
    for pattern, what in _SECRETS:
        if pattern.search(text):
            return f"it looks like it contains {what}"
    for token in _LONG_RANDOM.findall(text):
        if _looks_random(token):
            return "it contains a long random string that may be a secret"
    if re.search(r"(?i)\bexfiltrat", text) or _UPLOAD_FLAGS.search(text):
        return "it asks to send files off the machine"
    if _SENSITIVE.search(text) and _OUTBOUND.search(text):
        return "it asks to send credentials or private files somewhere"
    return None


def _policy(path: str, data: str | bytes) -> str | None:
    """Why the harness policy (``daemon/harness_policy.py``) keeps this lesson out, or None. A lesson is never
    something only a person may admit (a tool grant, a script): those are refused here too."""
    from daemon.harness_policy import file_findings

    found = file_findings(path, data)
    return f"the harness policy refuses it: {found[0].reason}" if found else None


# --- editing --------------------------------------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def similarity(a: str, b: str) -> float:
    wa, wb = _words(a), _words(b)
    if not wa or not wb:
        return 0.0
    return len(wa & wb) / len(wa | wb)


def _clean(text: str, limit: int) -> str:
    text = " ".join(text.split())
    if len(text) > limit:
        cut = text[:limit]
        end = max(cut.rfind(". "), cut.rfind("; "))
        text = cut[: end + 1] if end > limit // 2 else cut.rstrip() + "..."
    return text


# the first words of feedback that is already an instruction ("always run the tests first"): kept as written
_IMPERATIVE = frozenset((
    "always never don't dont do use run prefer keep avoid write add remove check make put start stop answer reply "
    "respond be ask cite test explain include follow read try give show list call say mention reproduce verify "
    "confirm split name document commit lint format fix").split())
_PRAISE = re.compile(r"(?i)^(?:(?:very|really|so|a|an|the|this|that|it|was|is|answer|job|work|one|response|reply|"
                     r"good|great|nice|perfect|excellent|awesome|amazing|correct|right|exactly|helpful|useful|fine|"
                     r"ok|okay|cool|brilliant|fantastic|superb|love|loved|liked|like|works|worked|well|done|thanks|"
                     r"thank|you|thx|ty|lgtm|yes|yep|spot|on)[\s!.,:;)*-]*|[\U0001F44D\U0001F64F\u2764\u2705\U0001F389]"
                     r"[\s!.]*)+$")


def imperative(text: str) -> bool:
    """Whether written feedback is already an instruction: its first word is a verb of the kind rules start with."""
    first = text.strip().split(maxsplit=1)[0].lower().strip(".,:;!-*\"'") if text.strip() else ""
    return first in _IMPERATIVE


def praise(text: str, score: float | None) -> bool:
    """Feedback that only says the answer was good ("good answer", "thanks!", "perfect"): no rule in it."""
    return (score is None or score >= 0.5) and bool(_PRAISE.match(text.strip())) and len(text.split()) <= 8


def phrase(lesson: Lesson, limit: int) -> str:
    """The rule entry for a lesson: an instruction as written (a direct one, or feedback that is one); other
    feedback on a poor run as a mistake to avoid."""
    text = _clean(lesson.text, limit)
    if lesson.instruction or imperative(text):
        return text
    if lesson.score is not None and lesson.score < 0.5:
        return f"Avoid a past mistake: {text}"
    return f"From feedback: {text}"


def parse_rules(text: str) -> tuple[str, list[str]]:
    """Split a rules file into what precedes the lessons section and the section's entries."""
    head, sep, tail = text.partition(LESSONS_HEADING)
    if not sep:
        prefix = text if text.strip() else RULES_PREAMBLE[: -len(LESSONS_HEADING) - 2]
        return prefix.rstrip("\n") + "\n\n", []
    entries = [line[2:].strip() for line in tail.splitlines() if line.startswith("- ") and line[2:].strip()]
    return head, entries


def render_rules(prefix: str, entries: list[str]) -> str:
    body = "".join(f"- {e}\n" for e in entries)
    return f"{prefix}{LESSONS_HEADING}\n\n{body}"


def render_skill(name: str, text: str) -> str:
    description = _clean(text.split("\n", 1)[0], 200).replace('"', "'")
    # a JSON string is a YAML double-quoted scalar: a backslash or a colon in the first line cannot break the block
    return f"---\nname: {name}\ndescription: {json.dumps(description, ensure_ascii=False)}\n---\n\n{text.strip()}\n"


def apply(tree: dict[str, bytes], lessons: list[Lesson], settings: LessonsSettings) -> Outcome:
    """The candidate tree after ``lessons`` (in order), and what happened to each."""
    out = Outcome(tree=dict(tree))
    prefix, entries = parse_rules(rules_of(out.tree))
    rules_changed = False
    for lesson in lessons:
        view: dict[str, str | None] = {"id": lesson.id, "text": lesson.text[:200]}
        text = lesson.text.strip() if isinstance(lesson.text, str) else ""
        if len(text) < settings.min_chars:
            out.refused.append({**view, "reason": f"feedback shorter than {settings.min_chars} characters"})
            continue
        reason = screen(text)
        if reason is not None:
            out.refused.append({**view, "reason": reason})
            continue
        if not lesson.instruction and lesson.skill is None and praise(text, lesson.score):
            out.unchanged.append({**view, "why": "praise, not an instruction: the report keeps it, no rule changes"})
            continue
        if lesson.skill is not None:
            if not SKILL_NAME.fullmatch(lesson.skill):
                out.refused.append({**view, "reason": f"skill name {lesson.skill!r} is not a-z, 0-9 and -"})
                continue
            path = f"skills/{lesson.skill}/SKILL.md"
            data = render_skill(lesson.skill, text).encode()
            reason = _policy(path, data)
            if reason is not None:
                out.refused.append({**view, "reason": reason})
                continue
            if out.tree.get(path) == data:
                out.unchanged.append({**view, "path": path})
            else:
                out.tree[path] = data
                out.applied.append({**view, "path": path, "edit": "skill"})
            continue
        entry = phrase(lesson, settings.max_chars)
        if lesson.proposed is not None and screen(lesson.proposed) is None and \
                _policy(RULES_FILE, _clean(lesson.proposed, settings.max_chars)) is None:
            entry = _clean(lesson.proposed, settings.max_chars)
            view["proposed_by"] = lesson.proposer
        reason = _policy(RULES_FILE, entry)
        if reason is not None:
            out.refused.append({**view, "reason": reason})
            continue
        if entry in entries:
            out.unchanged.append({**view, "path": RULES_FILE})
            continue
        best = max(range(len(entries)), key=lambda i: similarity(entry, entries[i]), default=None)
        if best is not None and similarity(entry, entries[best]) >= settings.similarity:
            entries.pop(best)  # merged: the newer phrasing replaces the similar entry and moves to the end
            edit = "merged"
        else:
            edit = "added"
        entries.append(entry)
        rules_changed = True
        out.applied.append({**view, "path": RULES_FILE, "edit": edit, "rule": entry})
    if rules_changed:
        while len(entries) > settings.max_rules or (
            len(entries) > 1 and len(render_rules(prefix, entries).encode()) > settings.max_rules_bytes
        ):
            entries.pop(0)  # the oldest entry goes first
        out.tree[RULES_FILE] = render_rules(prefix, entries).encode()
    out.changed = out.tree != tree
    return out


def lesson_from_report(report: FeedbackReport) -> Lesson | None:
    """A lesson from a stored report, or None when it carries no written feedback."""
    feedback = report.feedback
    meta = report.metadata or {}
    if isinstance(feedback, dict):
        feedback = feedback.get("text") or feedback.get("feedback") or json.dumps(feedback, sort_keys=True)
    if not isinstance(feedback, str) or not feedback.strip():
        return None
    skill = meta.get("skill")
    return Lesson(
        id=report.id,
        text=feedback,
        score=report.score,
        instruction=meta.get("kind") == "instruction",
        skill=skill if isinstance(skill, str) else None,
    )


class Lessons(Recipe):
    """``lessons``: each written feedback (or ``evolve`` instruction) becomes a screened rule or skill edit of
    the harness tree, in the daemon, at once: the report's answer says what happened."""

    name = "lessons"
    kind = "harness"
    source = "feedback"
    inline = True
    Settings = LessonsSettings

    @classmethod
    def parse_settings(cls, raw: dict[str, Any]) -> LessonsSettings:
        try:
            return settings_from(dict(raw))
        except TypeError as e:
            raise BadRequest(f"invalid settings for recipe lessons: {e}", param="settings") from None

    def models_used(self) -> list[str]:
        return [self.settings.proposer] if self.settings.proposer else []

    def batch(self, records: list[FeedbackReport]) -> list[FeedbackReport] | None:
        return records or None  # every unconsumed feedback at once: an edit of a few files takes milliseconds

    async def edit(self, tree: dict[str, bytes], batch: list[FeedbackReport], ctx: HarnessContext) -> Candidate:
        settings: LessonsSettings = self.settings
        lessons = [x for x in map(lesson_from_report, batch) if x is not None]
        if settings.proposer:
            await self._propose(ctx, lessons)
        outcome = apply(tree, lessons, settings)
        metrics = {"lessons": len(lessons), "applied": len(outcome.applied), "refused": len(outcome.refused),
                   "unchanged": len(outcome.unchanged), "tree_files": len(outcome.tree)}
        details = {"applied": outcome.applied, "refused": outcome.refused, "unchanged": outcome.unchanged,
                   "summary": outcome.summary()}
        if not outcome.changed:
            return Candidate(metrics=metrics, skipped=f"no change: {outcome.summary()}", details=details)
        check_tree(outcome.tree)
        scores = None
        if settings.gate == "compare":  # the scenario's model answers each task under both sets of rules
            scores = Scores(candidate=await self._task_scores(ctx, outcome.tree),
                            base=await self._task_scores(ctx, tree))
        return Candidate(tree=outcome.tree, metrics=metrics, eval=scores, details=details)

    async def assess(self, tree: dict[str, bytes], candidate: Candidate, ctx: HarnessContext) -> Candidate:
        """An agent's proposal: under gate ``compare``, the tasks answered under both sets of rules, as ``edit``."""
        if self.settings.gate == "compare" and candidate.tree is not None:
            candidate.eval = Scores(candidate=await self._task_scores(ctx, candidate.tree),
                                    base=await self._task_scores(ctx, tree))
        return candidate

    async def _task_scores(self, ctx: HarnessContext, tree: dict[str, bytes]) -> list[float]:
        """Each configured task answered by the scenario's model with ``tree``'s rules as the system prompt."""
        rules = rules_of(tree)
        return [task_score(task, await ctx.answer(None, rules, task["prompt"], int(task.get("max_tokens", 32))))
                for task in self.settings.tasks]

    async def _propose(self, ctx: HarnessContext, lessons: list[Lesson]) -> None:
        """Ask the proposer model to phrase each rule lesson; failures leave the plain, deterministic edit."""
        import logging

        model = self.settings.proposer
        for lesson in lessons:
            if lesson.skill is not None:
                continue
            try:
                lesson.proposed = proposal(await ctx.answer(model, PROPOSER_PROMPT, lesson.text, 64, proposal=True))
                lesson.proposer = model
            except CapReached:  # the day's proposer tokens are spent: the step ends failed, "cap reached"
                raise
            except Exception:
                logging.getLogger("reef.learning").warning(
                    "proposer model %s failed on %s; making a plain edit", model, lesson.id, exc_info=True)
