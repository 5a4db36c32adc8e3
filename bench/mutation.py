"""Mutation testing of the safety-critical modules with cosmic-ray (PyPI ``cosmic-ray``, the ``mutation`` extra), a
score per module, and a ratchet so that no score falls.

For each module named in ``MODULES`` (or on the command line), in a scratch copy of the working tree (your
checkout is never touched): cosmic-ray plants every mutant its operators make (a flipped comparison, a dropped
``not``, ``<`` for ``<=``, a changed constant, a ``break`` for a ``continue``...), one at a time, and runs that
module's tests against it. A mutant the tests fail on is killed; one they pass is a bug the suite would ship. A test
run past the timeout counts as killed (cosmic-ray's own rule: a mutant that hangs is noticed). Lines marked
``# pragma: no mutate`` are skipped (keep those few, and say why beside each), and so are mutants inside
annotations of a module that postpones them (``from __future__ import annotations``: ``str | None`` made
``str + None`` is never evaluated, so no test could tell), arithmetic made bitwise (``EXCLUDED_OPERATORS``: a
TypeError on any float), a parameter list's ``*`` taken for a multiplication, ``if not TYPE_CHECKING:``, and the
definitions a module leaves out (``Module.leave_out``: code only a running daemon exercises, named with the reason).

Printed per module: mutants, killed, survived, the score (killed / mutants), seconds per mutant with the load
average beside them, and each survivor (line, operator, the diff). ``--retry-survivors`` (with ``--keep``) runs
only the survivors of the kept run again, after tests or pragma comments were added: a mutant the tests killed stays
killed by more tests, so the score is the whole run's (the module must be otherwise unchanged: a changed line is
refused, run it whole). ``bench/mutation_scores.json`` keeps the best score each module has reached: a run whose score for a
module falls below it exits 1, naming the module (the ratchet); ``--record`` writes the new scores when none falls.
The scores and the date are also in docs/mutation.md.

Each module's tests are a selection that runs in seconds where the module allows (unit tests; a daemon test only
where the behaviour lives in the daemon), since every mutant runs them once: hundreds of mutants per module.

Run: ``.venv/bin/pip install -e '.[mutation]'`` once, then
``.venv/bin/python bench/mutation.py [MODULE ...] [--record] [--timeout 120] [--keep DIR [--resume | --retry-survivors]]``
(``--list`` shows the modules and their tests).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCORES = ROOT / "bench" / "mutation_scores.json"
DOC = ROOT / "docs" / "mutation.md"


@dataclass(frozen=True)
class Module:
    path: str  # the source file mutated
    tests: tuple[str, ...]  # pytest arguments: files and -k selections
    # top-level definitions (``name`` or ``Class.method``) whose mutants are not scored: code whose behaviour only a
    # running daemon shows, left to the daemon tests (say why beside each); printed as "left out"
    leave_out: tuple[str, ...] = ()


PY = "tests/test_harness_policy.py"
HELDOUT_UNIT = ("not restart and not keeps_answering_is_served and not online_rl_step and not fails_the_step and not "
                "malformed_held_out and not reserved_recorded_prompts_are_asked")
MODULES: dict[str, Module] = {
    # its tests without a daemon (the daemon's, one start of 50 s, are the attack suite on every path)
    "harness_policy": Module("daemon/harness_policy.py", (PY, "-k", "each_rule or ordinary_text or only_changed or "
                                                          "proposer or settings_file_is_refused or followed or "
                                                          "served_harness or script_is_refused or control_character "
                                                          "or not_utf8 or second_frontmatter or never_closed or "
                                                          "parse_error or long_frontmatter or several_rights or "
                                                          "finding_cannot")),
    "watchdog": Module("daemon/watchdog.py", ("tests/test_watchdog.py", "-k", "not daemon and not online_rl and "
                                              "not hacked_run")),
    # its unit tests (the daemon's, test_gates.py, start one daemon per test)
    "gate": Module("daemon/gate.py", ("tests/test_gate_noise.py",)),
    # the decision, settings, arms and lines, by its unit tests (test_canary.py and test_canary_learning.py take 25 s
    # to import: their daemon tests); the ``Canaries`` class (the serve path's look-up, the judging loop, starting
    # and ending on the chain) lives in a daemon and is tested through one there and in test_canary_live.py. The
    # simulations of error rates and intervals (2 to 5 s each: a surviving mutant runs them all) test the betting
    # underneath, and are in betting's selection
    "canary": Module("daemon/canary.py", ("tests/test_canary_decision.py", *(x for t in (
        "equal_arms_are_rarely_decided_however_often_the_test_looks", "the_difference_interval_is_the_decisions_own",
        "each_arms_interval_by_betting_holds_at_every_look_and_is_narrower_than_hoeffding")
        for x in ("--deselect", f"tests/test_canary_decision.py::test_{t}"))),
        leave_out=("Canaries", "CHECK_S", "ENDED_LOOKBACK", "unreadable")),  # (what only the class reads)
    "betting": Module("daemon/betting.py", ("tests/test_betting.py", "tests/test_canary_decision.py")),
    # each step alone against a stand-in host (through a daemon: test_learning.py, test_heldout.py, ...)
    "gating_steps": Module("daemon/gating/steps.py", ("tests/test_gate_steps.py", *(f"tests/test_heldout.py::test_{t}"
                           for t in ("the_first_release_is_read_once_and_is_none_where_the_head_is_it",
                                     "a_lineage_is_compared_with_the_chains_first_release_through_the_step",
                                     "the_heads_answers_asked_during_training_are_not_asked_again")))),
    # what the next step trains on (the lineage through canaries, harm restarts, training ahead), pure; the gate
    # steps that call it against a stand-in host
    "lineage": Module("daemon/lineage.py", ("tests/test_lineage.py", "tests/test_gate_steps.py")),
    # against a stand-in daemon (test_forgetting_unit.py), and the chain's marks (test_forget.py's pure tests; its
    # others check the bytes in SQLite, PostgreSQL and agent files, and through a daemon)
    "forgetting": Module("daemon/forgetting.py", ("tests/test_forgetting_unit.py", *(f"tests/test_forget.py::test_{t}"
                         for t in ("releases_built_on_forgotten_data_are_marked_and_a_clean_rollback_is_not",
                                   "harness_releases_made_from_forgotten_feedback_or_a_forgotten_run_are_marked",
                                   "a_backlog_larger_than_a_round_goes_within_one_check")))),
    # the figures, the decision, the two stages and the kept answers against stand-in engines (test_heldout.py's
    # daemon tests: a crafted candidate held through a real daemon, a minute each)
    "heldout": Module("daemon/gating/heldout.py", ("tests/test_heldout.py", "-k", HELDOUT_UNIT)),
    # the early warning: the trend (detect), the batch's figures, reading the chain and writing the warning down
    # against stand-ins, and the gate's steps that call it (test_warning.py's others: a daemon whose scenario is
    # warned, a minute each; the TUI's screen, which reads what the daemon answers)
    "warning": Module("daemon/gating/warning.py", ("tests/test_warning.py", *(f"tests/test_gate_steps.py::test_{t}"
                      for t in ("a_hold_by_the_watchdog_may_warn_as_well",
                                "a_trend_that_warns_holds_the_candidate_and_raises_the_warning")),
                      "-k", "not publishes_nothing and not accepting and not tui")),
    # its own tests (all of test_loops.py: "loop" matches the file's name), and the held-out check's use of it
    "loops": Module("daemon/loops.py", ("tests/test_loops.py", "tests/test_heldout.py", "-k",
                                        "loop or degenerate or said_twice")),
    "scopes": Module("daemon/scopes.py", ("tests/test_scopes.py",)),  # the daemon's: test_sandbox_escape.py
    # its unit tests: parse, the mutation and candidate a proposal makes, the listing (the file's others drive a
    # daemon and a real agent: 41 s a run)
    "proposals": Module("daemon/proposals.py", ("tests/test_proposals.py", "-k", "reason_of_exactly or "
                                                "path_is_a_400 or listed_once or malformed_proposal or size_limit "
                                                "or fields_trimmed or archived_or_paused or recipes_own_caps or "
                                                "becomes_the_mutation or what_is_there_or or candidate_is_the_tree "
                                                "or origin_names or each_verdict or cannot_be_changed")),
    # its own tests (all of test_mutations.py: "mutation" matches the file's name), and harness-search's and the
    # harness policy's tests of its screens
    "mutations": Module("recipes/harness_search/mutations.py", ("tests/test_mutations.py", "tests/test_harness_search.py",
                                                                PY, "-k", "mutation or screen or proposer or settings_file")),
    # its unit tests: real checks and git projects in a temporary folder (the file's others wrap the real pi against
    # a daemon, or train through one)
    "outcomes": Module("reef_cli/outcomes.py", ("tests/test_outcomes.py", "-k", "times_out or 126_or_127 or "
                                                "keeps_its_tail or check_in_config or git_mv or outcome_flags or "
                                                "snapshot_names or changes_of_a_run or cannot_start or "
                                                "exit_code_scores or interrupted or hundreds or cannot_be_read or "
                                                "killed_by_a_signal or left_its_session or first_commit or "
                                                "without_a_commit")),
    # its unit tests: from_line and to_line (the file's others import and export through a daemon)
    "export": Module("daemon/export.py", ("tests/test_export.py", "-k", "label_is_true or refused_naming or "
                                          "item_of_the_batch or at_their_edge or keyed_by_its_receipt or "
                                          "messages_line or exported_again_is or more_bounds or "
                                          "served_exchange or failed_or_unreadable or one_line_in_order or "
                                          "keeps_its_arguments")),
    # its unit tests (the daemon's: test_remote_clients.py, test_hardening.py, test_providers.py)
    "listening": Module("daemon/listening.py", ("tests/test_listening.py",)),
    # its unit tests (test_trainer_memory.py runs real steps in a trainer, torch imported: seconds a start)
    "trainer_memory": Module("recipes/memory.py", ("tests/test_memory_estimate.py",)),
}


# pytest plugins no module's tests use, not loaded: each mutant starts pytest once, and these cost most of it (with
# them 7.2 s for test_betting.py's 12 tests, 1.4 s without, at load 4: hypothesis alone imports for 2 s)
NOT_LOADED = tuple(x for name in ("xdist", "xdist.looponfail", "textual-snapshot", "syrupy", "schemathesis", "anyio",
                                  "platformdirs", "hypothesispytest") for x in ("-p", f"no:{name}"))


def tracked_copy(dest: Path) -> None:
    """The working tree's files (tracked and untracked but not ignored) copied to ``dest``: what the tests see."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    for raw in names:
        if not raw:
            continue
        src = ROOT / raw.decode()
        if not src.is_file():
            continue
        out = dest / raw.decode()
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out)


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (start, end) positions, (line, column) with lines from 1, of every annotation in ``source``: arguments',
    returns' and annotated assignments'. Under ``from __future__ import annotations`` they are never evaluated, so a
    mutant inside one (``str | None`` to ``str + None``) changes nothing a test could see."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        found: list[ast.expr | None] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            found = [node.returns, *(x.annotation for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                                     if x is not None)]
        elif isinstance(node, ast.AnnAssign):
            found = [node.annotation]
        spans += [((e.lineno, e.col_offset), (e.end_lineno or e.lineno, e.end_col_offset or 0))
                  for e in found if e is not None]
    return spans


# mutants left out by operator: an arithmetic operator replaced by a bitwise one (``*`` by ``|``, ``>>``...). On the
# floats these modules compute with it raises TypeError wherever the line runs, so it only says the line ran (the
# same line's ``+``, ``-``, ``*``, ``/``, ``//``, ``%`` and ``**`` mutants say whether its value matters); they were
# 5 of every 11 arithmetic mutants, and a module's run is its mutants' count times a pytest start
EXCLUDED_OPERATORS = re.compile(r"core/ReplaceBinaryOperator_\w+_(BitOr|BitAnd|BitXor|LShift|RShift)$")


def signature_marker(lines: list[str], pos: tuple[int, int]) -> bool:
    """Whether the ``*`` at ``pos`` (line from 1, column) is the keyword-only marker of a parameter list, which
    cosmic-ray takes for a multiplication: made ``/`` it only lets callers name the arguments before it."""
    line = lines[pos[0] - 1]
    return line[pos[1]:pos[1] + 1] == "*" and line[pos[1] + 1:].lstrip()[:1] in (",", ")", "")


def type_checking(lines: list[str], pos: tuple[int, int]) -> bool:
    """Whether line ``pos[0]`` is ``if TYPE_CHECKING:``, whose imports serve annotations only: made ``if not``, the
    module imports them at run time, which no test can tell."""
    return re.match(r"\s*if TYPE_CHECKING:", lines[pos[0] - 1]) is not None


def skip_operators(db: Path, source: Path) -> int:
    """Mark the mutants of ``EXCLUDED_OPERATORS``, those of a parameter list's ``*`` (``signature_marker``) and a
    ``not`` added to ``if TYPE_CHECKING:`` (``type_checking``), as skipped: the count."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    lines = source.read_text().splitlines()
    skipped = 0
    with use_db(str(db), WorkDB.Mode.open) as wdb:
        for item in list(wdb.pending_work_items):
            if all(EXCLUDED_OPERATORS.match(m.operator_name) or (
                    m.operator_name.startswith("core/ReplaceBinaryOperator_Mul_")
                    and signature_marker(lines, tuple(m.start_pos))) or (
                    m.operator_name == "core/AddNot" and type_checking(lines, tuple(m.start_pos)))
                   for m in item.mutations):
                wdb.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
                skipped += 1
    return skipped


def skip_annotations(db: Path, source: Path) -> int:
    """Mark the mutants inside annotations as skipped (``annotation_spans``), when the module postpones them."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    text = source.read_text()
    if "from __future__ import annotations" not in text:
        return 0
    spans = annotation_spans(text)
    skipped = 0
    with use_db(str(db), WorkDB.Mode.open) as wdb:
        for item in list(wdb.pending_work_items):
            if all(any(a <= tuple(m.start_pos) and tuple(m.end_pos) <= b for a, b in spans) for m in item.mutations):
                wdb.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
                skipped += 1
    return skipped


def definition_spans(source: str, names: tuple[str, ...]) -> list[tuple[int, int]]:
    """The (first, last) lines, decorators included, of the top-level definitions (functions, classes, assigned
    names) or ``Class.method`` named in ``names``; a name not found is an error (a renamed function would otherwise
    be scored silently)."""
    spans: dict[str, tuple[int, int]] = {}
    for node in ast.parse(source).body:
        defs: list[tuple[str, ast.stmt]] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defs.append((node.name, node))
            if isinstance(node, ast.ClassDef):
                defs += [(f"{node.name}.{sub.name}", sub) for sub in node.body
                         if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef)]
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defs += [(t.id, node) for t in targets if isinstance(t, ast.Name)]
        for name, d in defs:
            first = min([d.lineno, *(x.lineno for x in getattr(d, "decorator_list", []))])
            spans[name] = (first, d.end_lineno or d.lineno)
    missing = [n for n in names if n not in spans]
    if missing:
        raise ValueError(f"no top-level definition {', '.join(missing)} to leave out")
    return [spans[n] for n in names]


def skip_left_out(db: Path, source: Path, names: tuple[str, ...]) -> int:
    """Mark the mutants inside the definitions ``names`` (``Module.leave_out``) as skipped: the count."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    if not names:
        return 0
    spans = definition_spans(source.read_text(), names)
    left = 0
    with use_db(str(db), WorkDB.Mode.open) as wdb:
        for item in list(wdb.pending_work_items):
            if all(any(a <= m.start_pos[0] <= b for a, b in spans) for m in item.mutations):
                wdb.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
                left += 1
    return left


class LoadSampler:
    """The 1-minute load average sampled every few seconds while a module runs (reported beside its timing)."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.samples = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(sum(self.samples) / len(self.samples), 1)


def unpragmaed(text: str) -> str:
    """``text`` without its ``# pragma: no mutate`` comments: what a retry checks is unchanged (``retry``)."""
    return re.sub(r"[ \t]*#[ \t]*pragma: no mutate[^\n]*", "", text)


def retry(db: Path, source: Path, seen: Path) -> int:
    """Make the survivors of the run kept in ``db`` pending again (for tests added since: a mutant the tests killed
    stays killed by more tests), after skipping those on lines since marked ``# pragma: no mutate``; the count.
    The module must be the one that run mutated (``seen``: its text then), pragma comments aside: a changed line
    would make the kept positions wrong."""
    from cosmic_ray.work_db import WorkDB, WorkResultStorage, use_db
    from cosmic_ray.work_item import TestOutcome

    if not seen.exists() or unpragmaed(seen.read_text()) != unpragmaed(source.read_text()):
        raise ValueError(f"{source.name} changed since its kept run (not only pragma comments): run it whole")
    subprocess.run([str(Path(sys.executable).parent / "cr-filter-pragma"), str(db)], cwd=db.parent, check=True)
    with use_db(str(db), WorkDB.Mode.open) as wdb:
        again = [item.job_id for item, result in wdb.completed_work_items
                 if result.test_outcome == TestOutcome.SURVIVED]
        with wdb._session_maker.begin() as session:  # (cosmic-ray has no call that forgets a result)
            session.query(WorkResultStorage).filter(WorkResultStorage.job_id.in_(again)).delete()
    return len(again)


def run_module(name: str, mod: Module, work: Path, timeout: float, resume: bool = False,
               again: bool = False) -> dict[str, object]:
    """Plant every mutant of ``mod`` in the copy at ``work`` and run its tests: the counts and the survivors.
    ``resume``: go on with the mutants an earlier run in ``work`` left untried (its database is kept there);
    ``again``: run the survivors of that run again (``retry``)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    if not (work / mod.path).is_file():
        return {"module": name, "error": f"{mod.path} does not exist"}
    py = sys.executable
    test_cmd = " ".join([py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *NOT_LOADED,
                         "-o", "addopts=", "-o", "filterwarnings=error", "--timeout", str(int(timeout)),
                         *[f"'{a}'" if " " in a else a for a in mod.tests]])
    cfg = work / f"cr-{name}.toml"
    db = work / f"cr-{name}.sqlite"
    cfg.write_text(
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(mod.path)}\n"
        f"timeout = {float(timeout)}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(test_cmd)}\n"
        "[cosmic-ray.distributor]\nname = \"local\"\n")
    env = {**os.environ, "PYTHONPATH": str(work), "HF_HUB_OFFLINE": "1"}
    bin_dir = Path(sys.executable).parent
    t0 = time.monotonic()
    base = subprocess.run(test_cmd, shell=True, cwd=work, env=env, capture_output=True, text=True)
    if base.returncode != 0:  # the tests must pass on the real code, or every mutant looks killed
        return {"module": name, "error": "the module's tests fail without any mutant:\n" + base.stdout[-2000:]}
    base_s = time.monotonic() - t0
    seen = work / f"cr-{name}.source"
    if again:
        try:
            retry(db, work / mod.path, seen)
        except ValueError as e:
            return {"module": name, "error": str(e)}
    elif not (resume and db.exists()):
        seen.write_text((work / mod.path).read_text())
        subprocess.run([str(bin_dir / "cosmic-ray"), "init", "--force", str(cfg), str(db)], cwd=work, env=env, check=True)
        subprocess.run([str(bin_dir / "cr-filter-pragma"), str(db)], cwd=work, env=env, check=True)
    skip_annotations(db, work / mod.path)  # (on what is pending: a retry's survivors too)
    skip_left_out(db, work / mod.path, mod.leave_out)
    skip_operators(db, work / mod.path)
    with use_db(str(db), WorkDB.Mode.open) as wdb:
        pending = sum(1 for _ in wdb.pending_work_items)
    load = LoadSampler()
    t1 = time.monotonic()
    try:
        subprocess.run([str(bin_dir / "cosmic-ray"), "exec", str(cfg), str(db)], cwd=work, env=env, check=True)
    finally:
        mean_load = load.stop()
    per_mutant = (time.monotonic() - t1) / pending if pending else None
    timing = work / f"cr-{name}.timing.json"  # the whole run's pace, which a retry of its survivors reports
    if again and timing.exists():
        per_mutant, mean_load = json.loads(timing.read_text())
    elif not again and not resume:
        timing.write_text(json.dumps([per_mutant, mean_load]))
    killed = survived = skipped = 0
    survivors = []
    with use_db(str(db), WorkDB.Mode.open) as wdb:
        for item, result in wdb.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                skipped += 1
            elif result.test_outcome == TestOutcome.SURVIVED:
                survived += 1
                m = item.mutations[0]
                survivors.append({"line": m.start_pos[0], "operator": m.operator_name,
                                  "diff": "\n".join((result.diff or "").splitlines()[2:12])})
            else:
                killed += 1
    total = killed + survived
    return {"module": name, "path": mod.path, "mutants": total, "killed": killed, "survived": survived,
            "skipped": skipped, "score": round(killed / total, 4) if total else None,
            "minutes": round((time.monotonic() - t0) / 60, 1), "tests_s": round(base_s, 1),
            "s_per_mutant": None if per_mutant is None else round(per_mutant, 2), "load": mean_load,
            "survivors": sorted(survivors, key=lambda s: s["line"])}


def fallen(results: list[dict[str, Any]], best: dict[str, dict[str, Any]]) -> list[str]:
    """The ratchet: each module of ``results`` whose score is below the one recorded in ``best``, as
    ``name score < recorded``; an equal or higher score, or a module never recorded, passes."""
    return [f"{r['module']} {r['score']:.1%} < {best[r['module']]['score']:.1%}" for r in results
            if "error" not in r and r["score"] is not None and r["module"] in best
            and r["score"] < best[r["module"]]["score"]]


def recorded(results: list[dict[str, Any]], best: dict[str, dict[str, Any]], day: str) -> dict[str, dict[str, Any]]:
    """``best`` with each module of ``results`` written over it (called only when none fell)."""
    out = dict(best)
    for r in results:
        if "error" not in r and r["score"] is not None:
            out[r["module"]] = {k: r[k] for k in ("path", "mutants", "killed", "survived", "score", "s_per_mutant",
                                                  "load")} | {"date": day}
    return out


TABLE_START, TABLE_END = "<!-- scores: bench/mutation.py --record writes this table -->", "<!-- /scores -->"


def table(best: dict[str, dict[str, Any]]) -> str:
    """The recorded scores as docs/mutation.md shows them."""
    rows = ["| module | file | mutants | killed | score | s per mutant | load | date |", "|---|---|---|---|---|---|---|---|"]
    for name in [*(m for m in MODULES if m in best), *sorted(set(best) - set(MODULES))]:
        r = best[name]
        rows.append(f"| {name} | `{r.get('path', '')}` | {r['mutants']} | {r.get('killed', r['mutants'] - r['survived'])} "
                    f"| {r['score']:.1%} | {r.get('s_per_mutant', '')} | {r.get('load', '')} | {r['date']} |")
    return "\n".join(rows)


def write_table(best: dict[str, dict[str, Any]], doc: Path) -> None:
    """Replace the table between ``TABLE_START`` and ``TABLE_END`` in ``doc``."""
    text = doc.read_text()
    a, b = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    doc.write_text(text[:a] + "\n" + table(best) + "\n" + text[b:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help=f"modules to test (default all: {', '.join(MODULES)})")
    ap.add_argument("--record", action="store_true", help="write the scores to bench/mutation_scores.json")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per mutant's test run (past it: killed)")
    ap.add_argument("--keep", type=Path, help="leave the scratch copy and cosmic-ray's databases here")
    ap.add_argument("--resume", action="store_true", help="with --keep: go on where a stopped run there left off "
                    "(the copy is made again, so a mutant the stop left in place is undone)")
    ap.add_argument("--retry-survivors", action="store_true", help="with --keep: run the survivors of the kept "
                    "run again, after adding tests or pragma comments (the module otherwise unchanged)")
    ap.add_argument("--list", action="store_true", help="list the modules and their tests")
    args = ap.parse_args(argv)
    if args.list:
        for name, mod in MODULES.items():
            left = f"  (left out: {', '.join(mod.leave_out)})" if mod.leave_out else ""
            print(f"{name:16} {mod.path:42} {' '.join(mod.tests)}{left}")
        return 0
    if (args.resume or args.retry_survivors) and args.keep is None:
        ap.error("--resume and --retry-survivors need --keep DIR (where the earlier run kept its databases)")
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        ap.error(f"unknown module(s) {', '.join(unknown)}; known: {', '.join(MODULES)}")
    if not have_cosmic_ray():
        print("cosmic-ray is not installed: .venv/bin/pip install -e '.[mutation]'", file=sys.stderr)
        return 2
    best = json.loads(SCORES.read_text()) if SCORES.exists() else {}
    work = args.keep or Path(tempfile.mkdtemp(prefix="reef-mutation-"))
    work.mkdir(parents=True, exist_ok=True)
    tracked_copy(work)
    results: list[dict[str, Any]] = []
    try:
        for name in args.modules or list(MODULES):
            r = run_module(name, MODULES[name], work, args.timeout, args.resume, args.retry_survivors)
            results.append(r)
            if "error" in r:
                print(f"{name}: failed: {r['error']}")
                continue
            print(f"{name:16} {r['mutants']:4} mutants  {r['killed']:4} killed  {r['survived']:3} survived  "
                  f"score {r['score']:.1%}  ({r['skipped']} skipped or left out; {r['minutes']} min, "
                  f"{r['s_per_mutant']} s a mutant at load {r['load']}; its tests alone {r['tests_s']} s)", flush=True)
            for s in r["survivors"]:
                print(f"    survived: {r['path']}:{s['line']} {s['operator']}\n        "
                      + str(s["diff"]).replace("\n", "\n        "), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    fell = fallen(results, best)
    if fell:
        print("the ratchet: scores fell: " + "; ".join(fell))
        return 1
    if args.record:
        best = recorded(results, best, time.strftime("%Y-%m-%d"))
        SCORES.write_text(json.dumps(best, indent=1, sort_keys=True) + "\n")
        write_table(best, DOC)
        print(f"recorded in {SCORES.relative_to(ROOT)} and {DOC.relative_to(ROOT)}")
    return 0


def have_cosmic_ray() -> bool:
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
