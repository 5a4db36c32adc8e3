"""Mutation testing of the safety-critical modules with cosmic-ray (PyPI ``cosmic-ray``, the ``mutation`` extra), a
score per module, and a ratchet so that no score falls.

For each module named in ``MODULES`` (or on the command line), in a scratch copy of the working tree (your
checkout is never touched): cosmic-ray plants every mutant its operators make (a flipped comparison, a dropped
``not``, ``<`` for ``<=``, a changed constant, a ``break`` for a ``continue``...), one at a time, and runs that
module's tests against it. A mutant the tests fail on is killed; one they pass is a bug the suite would ship. A test
run past the timeout counts as killed (cosmic-ray's own rule: a mutant that hangs is noticed). Lines marked
``# pragma: no mutate`` are skipped (keep those few, and say why beside each), and so are mutants inside
annotations of a module that postpones them (``from __future__ import annotations``: ``str | None`` made
``str + None`` is never evaluated, so no test could tell).

Printed per module: mutants, killed, survived, the score (killed / mutants) and each survivor (line, operator,
the diff). ``bench/mutation_scores.json`` keeps the best score each module has reached: a run whose score for a
module falls below it exits 1, naming the module (the ratchet); ``--record`` writes the new scores when none falls.
The scores and the date are also in docs/mutation.md.

Each module's tests are a selection that runs in seconds where the module allows (unit tests; a daemon test only
where the behaviour lives in the daemon), since every mutant runs them once: hundreds of mutants per module.

Run: ``.venv/bin/pip install -e '.[mutation]'`` once, then
``.venv/bin/python bench/mutation.py [MODULE ...] [--record] [--timeout 120] [--keep DIR [--resume]]``
(``--list`` shows the modules and their tests).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCORES = ROOT / "bench" / "mutation_scores.json"


@dataclass(frozen=True)
class Module:
    path: str  # the source file mutated
    tests: tuple[str, ...]  # pytest arguments: files and -k selections


PY = "tests/test_harness_policy.py"
MODULES: dict[str, Module] = {
    # its tests without a daemon (the daemon's, one start of 50 s, are the attack suite on every path)
    "harness_policy": Module("daemon/harness_policy.py", (PY, "-k", "each_rule or ordinary_text or only_changed or "
                                                          "proposer or settings_file_is_refused or followed")),
    "watchdog": Module("daemon/watchdog.py", ("tests/test_watchdog.py", "-k", "not daemon and not online_rl and "
                                              "not hacked_run")),
    "gate": Module("daemon/gate.py", ("tests/test_gate_noise.py", "tests/test_gates.py")),
    "canary": Module("daemon/canary.py", ("tests/test_canary.py",)),
    "betting": Module("daemon/betting.py", ("tests/test_betting.py", "tests/test_canary_decision.py")),
    "forgetting": Module("daemon/forgetting.py", ("tests/test_forget.py",)),
    "scopes": Module("daemon/scopes.py", ("tests/test_scopes.py",)),  # the daemon's: test_sandbox_escape.py
    "proposals": Module("daemon/proposals.py", ("tests/test_proposals.py",)),
    "mutations": Module("recipes/harness_search/mutations.py", ("tests/test_harness_search.py", PY, "-k",
                                                                "mutation or screen or proposer or settings_file")),
    "outcomes": Module("reef_cli/outcomes.py", ("tests/test_outcomes.py",)),
    "export": Module("daemon/export.py", ("tests/test_export.py",)),
    # its unit tests (the daemon's: test_remote_clients.py, test_hardening.py, test_providers.py)
    "listening": Module("daemon/listening.py", ("tests/test_listening.py",)),
    "trainer_memory": Module("recipes/memory.py", ("tests/test_trainer_memory.py",)),
}


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


def run_module(name: str, mod: Module, work: Path, timeout: float, resume: bool = False) -> dict[str, object]:
    """Plant every mutant of ``mod`` in the copy at ``work`` and run its tests: the counts and the survivors.
    ``resume``: go on with the mutants an earlier run in ``work`` left untried (its database is kept there)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    if not (work / mod.path).is_file():
        return {"module": name, "error": f"{mod.path} does not exist"}
    py = sys.executable
    test_cmd = " ".join([py, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
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
    if not (resume and db.exists()):
        subprocess.run([str(bin_dir / "cosmic-ray"), "init", str(cfg), str(db)], cwd=work, env=env, check=True)
        subprocess.run([str(bin_dir / "cr-filter-pragma"), str(db)], cwd=work, env=env, check=True)
        skip_annotations(db, work / mod.path)
    subprocess.run([str(bin_dir / "cosmic-ray"), "exec", str(cfg), str(db)], cwd=work, env=env, check=True)
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
            "minutes": round((time.monotonic() - t0) / 60, 1), "survivors": sorted(survivors, key=lambda s: s["line"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help=f"modules to test (default all: {', '.join(MODULES)})")
    ap.add_argument("--record", action="store_true", help="write the scores to bench/mutation_scores.json")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per mutant's test run (past it: killed)")
    ap.add_argument("--keep", type=Path, help="leave the scratch copy and cosmic-ray's databases here")
    ap.add_argument("--resume", action="store_true", help="with --keep: go on where a stopped run there left off "
                    "(the copy is made again, so a mutant the stop left in place is undone)")
    ap.add_argument("--list", action="store_true", help="list the modules and their tests")
    args = ap.parse_args(argv)
    if args.list:
        for name, mod in MODULES.items():
            print(f"{name:16} {mod.path:42} {' '.join(mod.tests)}")
        return 0
    if args.resume and args.keep is None:
        ap.error("--resume needs --keep DIR (where the stopped run kept its databases)")
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        ap.error(f"unknown module(s) {', '.join(unknown)}; known: {', '.join(MODULES)}")
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        print("cosmic-ray is not installed: .venv/bin/pip install -e '.[mutation]'", file=sys.stderr)
        return 2
    best = json.loads(SCORES.read_text()) if SCORES.exists() else {}
    work = args.keep or Path(tempfile.mkdtemp(prefix="reef-mutation-"))
    work.mkdir(parents=True, exist_ok=True)
    tracked_copy(work)
    results = []
    fell = []
    try:
        for name in args.modules or list(MODULES):
            r = run_module(name, MODULES[name], work, args.timeout, args.resume)
            results.append(r)
            if "error" in r:
                print(f"{name}: failed: {r['error']}")
                continue
            print(f"{name:16} {r['mutants']:4} mutants  {r['killed']:4} killed  {r['survived']:3} survived  "
                  f"score {r['score']:.1%}  ({r['minutes']} min)")
            for s in r["survivors"]:  # type: ignore[union-attr]
                print(f"    survived: {r['path']}:{s['line']} {s['operator']}\n        "
                      + str(s["diff"]).replace("\n", "\n        "))
            if r["score"] is not None and name in best and r["score"] < best[name]["score"]:
                fell.append(f"{name} {r['score']:.1%} < {best[name]['score']:.1%}")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    if fell:
        print("the ratchet: scores fell: " + "; ".join(fell))
        return 1
    if args.record:
        for r in results:
            if "error" not in r and r["score"] is not None:
                best[str(r["module"])] = {"score": r["score"], "mutants": r["mutants"], "survived": r["survived"],
                                          "date": time.strftime("%Y-%m-%d")}
        SCORES.write_text(json.dumps(best, indent=1, sort_keys=True) + "\n")
        print(f"recorded in {SCORES.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
