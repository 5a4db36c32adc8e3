"""bench/mutation.py's own logic, without cosmic-ray: the ratchet (a module whose score falls below its recorded
one exits 1 naming it; an equal or higher score passes and ``--record`` writes it, in the JSON and the table of
docs/mutation.md), and the definitions a module leaves out of its score."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_imports import ROOT

spec = importlib.util.spec_from_file_location("bench_mutation", ROOT / "bench" / "mutation.py")
assert spec is not None and spec.loader is not None
mutation = importlib.util.module_from_spec(spec)
sys.modules["bench_mutation"] = mutation  # (its dataclasses look their module up)
spec.loader.exec_module(mutation)

DOC = f"# Mutation testing\n\nbefore\n\n{mutation.TABLE_START}\nold table\n{mutation.TABLE_END}\n\nafter\n"


def result(module: str, killed: int, mutants: int) -> dict[str, Any]:
    return {"module": module, "path": mutation.MODULES[module].path, "mutants": mutants, "killed": killed,
            "survived": mutants - killed, "skipped": 0, "score": round(killed / mutants, 4), "minutes": 1.0,
            "tests_s": 1.0, "s_per_mutant": 2.5, "load": 3.1, "survivors": []}


@pytest.fixture
def bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The bench with its scores and doc in ``tmp_path`` and ``run_module`` answering from ``runs``."""
    runs: dict[str, dict[str, Any]] = {}
    monkeypatch.setattr(mutation, "SCORES", tmp_path / "mutation_scores.json")
    monkeypatch.setattr(mutation, "DOC", tmp_path / "mutation.md")
    monkeypatch.setattr(mutation, "ROOT", tmp_path)
    monkeypatch.setattr(mutation, "have_cosmic_ray", lambda: True)
    monkeypatch.setattr(mutation, "tracked_copy", lambda dest: None)
    monkeypatch.setattr(mutation, "run_module", lambda name, mod, work, timeout, resume, again: runs[name])
    (tmp_path / "mutation.md").write_text(DOC)
    (tmp_path / "mutation_scores.json").write_text(json.dumps({
        "canary": {"score": 0.95, "mutants": 100, "killed": 95, "survived": 5, "date": "2026-12-01"},
        "scopes": {"score": 0.9, "mutants": 50, "killed": 45, "survived": 5, "date": "2026-12-01"}}))
    return {"runs": runs, "keep": ["--keep", str(tmp_path / "work")], "scores": tmp_path / "mutation_scores.json",
            "doc": tmp_path / "mutation.md"}


def test_a_score_that_falls_exits_1_naming_the_module_and_records_nothing(bench: dict[str, Any],
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    before = bench["scores"].read_text()
    bench["runs"].update(canary=result("canary", 94, 100), scopes=result("scopes", 46, 50))
    assert mutation.main(["canary", "scopes", "--record", *bench["keep"]]) == 1
    out = capsys.readouterr().out
    assert "scores fell: canary 94.0% < 95.0%" in out
    assert "scopes" not in out.split("scores fell:")[1]  # the one that rose is not named
    assert bench["scores"].read_text() == before and bench["doc"].read_text() == DOC


def test_an_equal_or_higher_score_passes_and_record_writes_it_and_the_table(bench: dict[str, Any]) -> None:
    bench["runs"].update(canary=result("canary", 95, 100), scopes=result("scopes", 49, 50))
    assert mutation.main(["canary", "scopes", *bench["keep"]]) == 0
    assert json.loads(bench["scores"].read_text())["scopes"]["score"] == 0.9  # without --record: unchanged
    assert mutation.main(["canary", "scopes", "--record", *bench["keep"]]) == 0
    best = json.loads(bench["scores"].read_text())
    assert (best["canary"]["score"], best["scopes"]["score"], best["scopes"]["killed"]) == (0.95, 0.98, 49)
    assert best["scopes"]["s_per_mutant"] == 2.5 and best["scopes"]["load"] == 3.1
    doc = bench["doc"].read_text()
    assert "old table" not in doc and doc.startswith("# Mutation testing\n\nbefore") and doc.endswith("after\n")
    assert "| scopes | `daemon/scopes.py` | 50 | 49 | 98.0% | 2.5 | 3.1 |" in doc


def test_a_module_never_recorded_passes_whatever_its_score(bench: dict[str, Any]) -> None:
    bench["runs"]["betting"] = result("betting", 1, 100)
    assert mutation.main(["betting", *bench["keep"]]) == 0
    assert mutation.fallen([result("betting", 1, 100)], {}) == []


def test_a_module_whose_run_failed_fails_no_ratchet_and_is_not_recorded(bench: dict[str, Any]) -> None:
    bench["runs"]["canary"] = {"module": "canary", "error": "the module's tests fail without any mutant"}
    assert mutation.main(["canary", "--record", *bench["keep"]]) == 0
    assert json.loads(bench["scores"].read_text())["canary"]["score"] == 0.95


SOURCE = '''
X = 1


@decorated
def f():
    return 2


class C:
    def m(self):
        return 3

    def n(self):
        return 4
'''


def test_left_out_definitions_span_their_decorators_and_methods_and_a_missing_name_is_an_error() -> None:
    assert mutation.definition_spans(SOURCE, ("f", "C.n", "X")) == [(5, 7), (14, 15), (2, 2)]
    assert mutation.definition_spans(SOURCE, ("C",)) == [(10, 15)]
    with pytest.raises(ValueError, match="no top-level definition g"):
        mutation.definition_spans(SOURCE, ("f", "g"))


def test_every_left_out_name_exists_in_its_module() -> None:
    for mod in mutation.MODULES.values():
        mutation.definition_spans((ROOT / mod.path).read_text(), mod.leave_out)


def test_a_parameter_lists_star_is_not_a_multiplication() -> None:
    lines = ["def f(a, *, b=2 * 3):", "def g(*args):", "x = a * b", "def h(a, *", "         ) -> None:"]
    assert mutation.signature_marker(lines, (1, 9)) and mutation.signature_marker(lines, (4, 9))
    assert not mutation.signature_marker(lines, (1, 17))  # 2 * 3
    assert not mutation.signature_marker(lines, (2, 6))  # *args
    assert not mutation.signature_marker(lines, (3, 6))
    assert mutation.EXCLUDED_OPERATORS.match("core/ReplaceBinaryOperator_Mul_BitOr")
    assert not mutation.EXCLUDED_OPERATORS.match("core/ReplaceBinaryOperator_Mul_Div")
    assert not mutation.EXCLUDED_OPERATORS.match("core/ReplaceBinaryOperator_BitOr_Add")
    assert mutation.type_checking(["if TYPE_CHECKING:", "    import ssl"], (1, 3))
    assert not mutation.type_checking(["if TYPE_CHECKING or x:"], (1, 3))


def test_a_retry_sees_a_module_unchanged_but_for_pragma_comments() -> None:
    before = "x = 1\nif x > 0:  # why\n    y = 2\n"
    assert mutation.unpragmaed("x = 1\nif x > 0:  # why  # pragma: no mutate (the reason)\n    y = 2\n") == \
        mutation.unpragmaed(before)
    assert mutation.unpragmaed("x = 1\nif x >= 0:  # why\n    y = 2\n") != mutation.unpragmaed(before)
