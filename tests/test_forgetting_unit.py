"""Forgetting's own logic (``daemon/forgetting.py``) against a stand-in daemon that records what it was asked:
the forget request's checks, a run with only a file, what the learner, the copies and the events are told, the
chain's view, and each retention round's bounds. Where the bytes go (SQLite, PostgreSQL, agent files) and the same
through a real daemon are in tests/test_forget.py; these run in milliseconds, so that every mutant of the module
meets them (``bench/mutation.py forgetting``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from daemon import copies, forgetting
from daemon.errors import BadRequest, NotFound, ReefError


def rel(rid: str, operation: str, parent: str | None, content: str, receipts: tuple[str, ...] = ()) -> Any:
    return SimpleNamespace(release_id=rid, operation=operation, parent=parent, content_id=content,
                           receipts=list(receipts), origin=None)


class UserData:
    """The record store's forgetting calls: what each was asked, and what it answers."""

    def __init__(self, known_runs: set[str] | None = None) -> None:
        self.known_runs = known_runs
        self.calls: list[tuple[str, Any]] = []
        self.due: list[list[str]] = []

    async def forget(self, *, receipts: list[str], runs: list[str], scrub: bool = False) -> dict[str, Any]:
        self.calls.append(("forget", (list(receipts), list(runs), scrub)))
        unknown = [r for r in runs if self.known_runs is not None and r not in self.known_runs]
        if unknown:
            raise NotFound(f"no exchanges of runs {unknown}", runs=unknown)
        return {"forgotten": list(receipts), "already": [], "reports": 0, "scenarios": ["s"] if receipts or runs else [],
                "runs": list(runs), "remains": "0 bytes"}

    async def retention_due(self, *, before: float | None, max_bytes: int | None, limit: int) -> list[str]:
        self.calls.append(("due", (before, max_bytes, limit)))
        return self.due.pop(0) if self.due else []


class Reef:
    def __init__(self, home: Path, **config: Any) -> None:
        runs = home / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        self.config = SimpleNamespace(**{"runs_dir": runs, "retention_days": None, "retention_max_mb": None,
                                         "retention_check_s": 60.0, **config})
        self.store = SimpleNamespace(user_data=UserData())
        self.told: list[tuple[str, set[str]]] = []
        self.learner = SimpleNamespace(forget=self._forget)
        self.published: list[tuple[str, dict[str, Any]]] = []
        self.events = SimpleNamespace(publish=lambda kind, **data: self.published.append((kind, data)))
        self.history: list[Any] = []
        self.chains = SimpleNamespace(history=self._history)

    async def _forget(self, scenario: str, ids: set[str]) -> None:
        self.told.append((scenario, ids))

    async def _history(self, scenario: str, n: Any) -> list[Any]:
        assert n is None  # the whole chain
        return self.history


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Forgotten sources by scenario, and the copies removed (recorded)."""
    seen: dict[str, Any] = {"sources": {"s": ({"rec_1"}, {"run_1"})}, "removed": [], "old_runs": []}

    async def sources(store: Any, scenario: str) -> Any:
        return seen["sources"].get(scenario, (set(), set()))

    monkeypatch.setattr(forgetting, "forgotten_sources", sources)
    monkeypatch.setattr(copies, "remove_runs", lambda config, runs: (
        seen["removed"].append(list(runs)), {"runs": len(runs), "agent_files": 2 * len(runs)})[1])
    monkeypatch.setattr(copies, "remove_pages", lambda config: 3)

    def started_before(config: Any, before: float, *, limit: int) -> list[str]:
        seen["before"], seen["limit"] = before, limit
        return seen["old_runs"]

    monkeypatch.setattr(copies, "runs_started_before", started_before)
    return seen


@pytest.mark.parametrize(("body", "param"), [
    ({}, "receipts"), ({"receipts": [], "runs": []}, "receipts"), ({"receipts": "rec_1"}, "receipts"),
    ({"receipts": ["rec_1", ""]}, "receipts"), ({"receipts": [3]}, "receipts"), ({"runs": [None]}, "runs"),
    ({"runs": "run_1"}, "runs"), ({"receipts": ["rec_1"], "scrub": "yes"}, "scrub"),
    ({"receipts": ["rec_1"], "scrub": 1}, "scrub"),
    ({"receipts": [f"rec_{i}" for i in range(forgetting.MAX_FORGET + 1)]}, "receipts"),
    ({"runs": [f"run_{i}" for i in range(forgetting.MAX_FORGET + 1)]}, "runs"),
])
def test_a_forget_request_out_of_shape_is_refused_naming_the_field(tmp_path: Path, stand_ins: Any, body: Any,
                                                                   param: str) -> None:
    reef = Reef(tmp_path)
    with pytest.raises(BadRequest) as e:
        asyncio.run(forgetting.forget(reef, body))  # type: ignore[arg-type]
    assert e.value.data["param"] == param and reef.store.user_data.calls == []


def test_a_forget_tells_the_learner_removes_the_copies_and_says_which_releases_it_touched(
        tmp_path: Path, stand_ins: Any) -> None:
    reef = Reef(tmp_path)
    reef.history = [rel("r2", "train", "r1", "c2", ("rec_1",)), rel("r1", "init", None, "c1")]
    many = [f"rec_{i}" for i in range(forgetting.MAX_FORGET)]  # at the bound: taken
    out = asyncio.run(forgetting.forget(reef, {"receipts": many, "runs": ["run_1"], "scrub": True}))  # type: ignore[arg-type]
    assert reef.store.user_data.calls == [("forget", (many, ["run_1"], True))]
    assert reef.told == [("s", {"rec_1"})]
    assert stand_ins["removed"] == [["run_1"]]
    assert out["copies"] == {"runs": 1, "agent_files": 2, "pages": 3}
    assert out["releases"] == {"s": {"trained_on_forgotten": ["r2"], "rollback_to": "r1",
                                     "command": "reef releases rollback r1 --scenario s"}}
    assert reef.published == [("forget", {"receipts": forgetting.MAX_FORGET, "scenarios": ["s"]})]


def test_a_run_with_a_file_here_and_no_exchange_is_forgotten_too_and_an_unknown_one_is_not_found(
        tmp_path: Path, stand_ins: Any) -> None:
    reef = Reef(tmp_path)
    reef.store.user_data.known_runs = {"run_1"}
    (reef.config.runs_dir / "run_quiet.json").write_text("{}")
    out = asyncio.run(forgetting.forget(reef, {"runs": ["run_1", "run_quiet"]}))  # type: ignore[arg-type]
    assert reef.store.user_data.calls == [("forget", ([], ["run_1", "run_quiet"], False)),
                                          ("forget", ([], ["run_1"], False))]  # again without the file-only run
    assert stand_ins["removed"] == [["run_1", "run_quiet"]]
    reef = Reef(tmp_path)
    reef.store.user_data.known_runs = set()
    out = asyncio.run(forgetting.forget(reef, {"runs": ["run_quiet"]}))  # type: ignore[arg-type]
    assert [c[0] for c in reef.store.user_data.calls] == ["forget"]  # nothing else to ask the store
    assert out["forgotten"] == [] and out["scenarios"] == [] and stand_ins["removed"][-1] == ["run_quiet"]
    assert (out["reports"], out["runs"], out["remains"], out["already"]) == (0, [], "", [])
    assert reef.told == []
    for runs in (["run_quiet", "run_elsewhere"], ["run_elsewhere"]):
        reef = Reef(tmp_path)
        reef.store.user_data.known_runs = set()
        with pytest.raises(NotFound):  # a run neither stored nor with a file here
            asyncio.run(forgetting.forget(reef, {"runs": runs}))  # type: ignore[arg-type]
    reef = Reef(tmp_path)
    reef.store.user_data.known_runs = set()

    async def broken(**kw: Any) -> Any:
        raise NotFound("no such receipts", receipts=["rec_x"])

    reef.store.user_data.forget = broken  # type: ignore[method-assign]
    with pytest.raises(NotFound):  # a NotFound naming no runs is passed on
        asyncio.run(forgetting.forget(reef, {"receipts": ["rec_x"], "runs": ["run_quiet"]}))  # type: ignore[arg-type]


def test_the_chain_view_marks_whats_built_on_forgotten_data_and_names_the_newest_clean_release(
        tmp_path: Path, stand_ins: Any) -> None:
    reef = Reef(tmp_path)
    stand_ins["sources"] = {"s": ({"rec_bad"}, set())}
    reef.history = [rel("r3", "train", "r2", "c3"), rel("r2", "train", "r1", "c2", ("rec_bad",)),
                    rel("r1", "init", None, "c1")]
    view = asyncio.run(forgetting.chain_view(reef, "s"))  # type: ignore[arg-type]
    assert view == {"trained_on_forgotten": ["r3", "r2"], "rollback_to": "r1",
                    "command": "reef releases rollback r1 --scenario s"}
    long = "rel_0123456789abcdef"  # the command names a release by its first 12 characters
    reef.history[2] = rel(long, "init", None, "c1")
    view = asyncio.run(forgetting.chain_view(reef, "s"))  # type: ignore[arg-type]
    assert view["rollback_to"] == long and view["command"] == "reef releases rollback rel_01234567 --scenario s"
    reef.history = [rel("r4", "rollback", "r3", "c1"), *reef.history]  # the head is clean again
    view = asyncio.run(forgetting.chain_view(reef, "s"))  # type: ignore[arg-type]
    assert view == {"trained_on_forgotten": ["r3", "r2"], "rollback_to": None}
    reef.history = [rel("r2", "train", "r1", "c2", ("rec_bad",))]  # nothing clean to go back to
    assert asyncio.run(forgetting.chain_view(reef, "s")) == {  # type: ignore[arg-type]
        "trained_on_forgotten": ["r2"], "rollback_to": None}
    assert asyncio.run(forgetting.chain_view(reef, "other")) == {  # type: ignore[arg-type]
        "trained_on_forgotten": [], "rollback_to": None}


def test_retention_asks_for_what_is_due_by_days_and_megabytes_and_forgets_it(tmp_path: Path, stand_ins: Any) -> None:
    reef = Reef(tmp_path, retention_days=2, retention_max_mb=1.5)
    reef.store.user_data.due = [["rec_1", "rec_2"]]
    stand_ins["old_runs"] = ["run_old"]
    t0 = time.time()
    out = asyncio.run(forgetting.apply_retention(reef))  # type: ignore[arg-type]
    (kind, (before, max_bytes, limit)), forget = reef.store.user_data.calls
    assert kind == "due" and t0 - 2 * 86400 - 1 < before <= time.time() - 2 * 86400
    assert max_bytes == 1_500_000 and limit == forgetting.RETENTION_ROUND
    assert stand_ins["before"] == before and stand_ins["limit"] == forgetting.RETENTION_ROUND
    assert forget == ("forget", (["rec_1", "rec_2"], [], False))
    assert out is not None and stand_ins["removed"] == [["run_old"]] and reef.told == [("s", {"rec_1"})]
    assert reef.published == [("forget", {"receipts": 2, "scenarios": ["s"], "retention": True})]


def test_the_documented_bounds() -> None:
    """docs/your-data.md: a retention round forgets at most 10,000 exchanges; a forget request names at most
    100,000 receipts and 100,000 runs."""
    assert (forgetting.RETENTION_ROUND, forgetting.MAX_FORGET) == (10_000, 100_000)


def test_retention_with_no_bound_or_nothing_due_does_nothing(tmp_path: Path, stand_ins: Any) -> None:
    reef = Reef(tmp_path)
    assert asyncio.run(forgetting.apply_retention(reef)) is None  # type: ignore[arg-type]
    assert reef.store.user_data.calls == [("due", (None, None, forgetting.RETENTION_ROUND))]
    assert "before" not in stand_ins and reef.published == [] and stand_ins["removed"] == []


def test_retention_of_old_runs_alone_forgets_no_exchange_and_stops_when_none_could_go(
        tmp_path: Path, stand_ins: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    reef = Reef(tmp_path, retention_days=1)
    stand_ins["old_runs"] = ["run_old"]
    out = asyncio.run(forgetting.apply_retention(reef))  # type: ignore[arg-type]
    assert out is not None and [c[0] for c in reef.store.user_data.calls] == ["due"]  # no exchange to forget
    assert out["forgotten"] == [] and stand_ins["removed"] == [["run_old"]] and reef.told == []
    monkeypatch.setattr(copies, "remove_runs", lambda config, runs: {"runs": 0, "agent_files": 0})
    assert asyncio.run(forgetting.apply_retention(reef)) is None  # a file that would not go: no other round


def test_the_retention_loop_runs_rounds_until_none_is_due_then_waits_and_goes_on_after_a_failure(
        tmp_path: Path, stand_ins: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    reef = Reef(tmp_path)
    rounds = [{"x": 1}, {"x": 2}, None, ReefError("the store is away"), None]
    waits: list[float] = []

    async def apply(r: Any) -> Any:
        got = rounds.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    class Done(Exception):
        pass

    async def sleep(s: float) -> None:
        waits.append(s)
        if len(waits) == 3:
            raise Done

    monkeypatch.setattr(forgetting, "apply_retention", apply)
    with pytest.raises(Done):
        asyncio.run(forgetting.retention_loop(reef, sleep=sleep))  # type: ignore[arg-type]
    assert waits == [60.0, 60.0, 60.0] and rounds == []  # 3 rounds, then a wait; a failure, a wait; one more


def test_the_sources_of_a_scenario_are_its_forgotten_exchanges_their_reports_and_their_runs(tmp_path: Path) -> None:
    """Through a real SQLite store: what was forgotten in scenario ``s`` (the exchanges, the reports on them, the
    runs they were in), nothing of another scenario or of what is kept."""
    from daemon.records import ExchangeRecord
    from daemon.records.sqlite import SQLiteStore

    def exchange(rid: str, scenario: str, run: str | None) -> ExchangeRecord:
        return ExchangeRecord(id=rid, scenario=scenario, run=run, status="complete", format="openai-chat", engine="e",
                              model="m", release_id="rel", request={"messages": [{"role": "user", "content": "q"}]},
                              response={"choices": [{"message": {"content": "a"}}]}, headers={})

    async def go() -> None:
        store = SQLiteStore(tmp_path / "records.sqlite3")
        try:
            assert await forgetting.forgotten_sources(store, "s") == (set(), set())
            for rid, scenario, run in (("rec_a", "s", "run_1"), ("rec_b", "s", None), ("rec_c", "s", "run_2"),
                                       ("rec_o", "o", "run_3")):
                await store.exchanges.append(exchange(rid, scenario, run))
            await store.reports.append(scenario=None, score=1.0, feedback="f", references=["rec_a"], metadata=None,
                                       report_id="rep_a")
            await store.reports.append(scenario=None, score=1.0, feedback="f", references=["rec_c"], metadata=None,
                                       report_id="rep_c")
            await store.user_data.forget(receipts=["rec_a", "rec_b", "rec_o"], runs=[])
            ids, runs = await forgetting.forgotten_sources(store, "s")
            assert runs == {"run_1"} and {"rec_a", "rec_b"} <= ids and "rec_c" not in ids and "rec_o" not in ids
            assert len(ids) == 3 and not ids & {"rep_c"}  # and the report on rec_a, by its stored id
        finally:
            store.close()

    asyncio.run(go())
