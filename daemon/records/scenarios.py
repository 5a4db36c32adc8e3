"""Scenarios, a part of the record store (``RecordStore.scenarios``): a name bound to a recipe and a model, its
settings and switches (capture, paused, archived) and its early-warning state.

A scenario read once is kept in memory (``cached``): the serve path asks for its scenario on every request, and
every change made through this part updates what is kept. Every change is read and written in one transaction,
so two changes at once never lose one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daemon.errors import NotFound, RecipeConflict
from daemon.records.conn import Conn, Rows
from daemon.records.rows import dumps


@dataclass
class Scenario:
    name: str
    recipe: str
    model: str
    created_at: float
    settings: dict[str, Any]
    capture: bool = True  # False: serve-only, its exchanges are never trained on
    paused: bool = False  # True: its recipe takes no step until resumed (the binding stays)
    archived: bool = False  # True: neither served nor trained; its records and chain stay readable
    # the early warning's state (daemon/gating/warning.py): None, or {state: warned | accepted | cleared, since, ...}
    warning: dict[str, Any] | None = None

    @property
    def warned(self) -> bool:
        """Whether its early warning stands: no step runs, nothing publishes, until the user acts."""
        return self.warning is not None and self.warning.get("state") == "warned"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "recipe": self.recipe,
            "model": self.model,
            "created_at": self.created_at,
            "settings": self.settings,
            "capture": self.capture,
            "paused": self.paused,
            "archived": self.archived,
            "warning": self.warning if self.warned else None,
        }


@dataclass(frozen=True)
class ScenarioSummary:
    """A scenario with what it holds (``GET /reef/scenarios``): its exchanges (``serve_only`` of them not
    captured), its reports and the mean score of its last 50 scored reports (None: none scored)."""

    scenario: Scenario
    records: int
    serve_only: int
    reports: int
    mean_score: float | None

    def to_dict(self) -> dict[str, Any]:
        return {**self.scenario.to_dict(), "records": self.records, "serve_only": self.serve_only,
                "reports": self.reports, "mean_score": self.mean_score}


def _scenario(row: Any) -> Scenario:
    return Scenario(
        name=row["name"],
        recipe=row["recipe"],
        model=row["model"],
        created_at=row["created_at"],
        settings=json.loads(row["settings"] or "{}"),
        capture=bool(row["capture"]),
        paused=bool(row["paused"]),
        archived=bool(row["archived"]),
        warning=json.loads(row["warning"]) if row["warning"] else None,
    )


def _named(conn: Conn, name: str) -> Scenario:
    row = conn.execute("SELECT * FROM scenarios WHERE name=?", (name,)).fetchone()
    if row is None:
        raise NotFound(f"no scenario named {name!r}", scenario=name)
    return _scenario(row)


class Scenarios:
    """The scenarios of one record store, and the ones it has read kept in memory."""

    def __init__(self, store: Rows) -> None:
        self.store = store
        self._cache: dict[str, Scenario] = {}

    def cached(self, name: str) -> bool:
        """Whether this store has read or made the scenario ``name`` already (then it exists)."""
        return name in self._cache

    async def _change(self, name: str, fn: Callable[[Conn], object]) -> Scenario:
        """Run ``fn`` on the scenario's row in a transaction, and keep (and return) the scenario it leaves."""

        def op(conn: Conn) -> Scenario:
            fn(conn)
            return _named(conn, name)

        scenario = await self.store.write(op)
        self._cache[name] = scenario
        return scenario

    async def ensure(self, name: str, *, recipe: str | None, model: str, default_recipe: str,
                     settings: dict[str, Any] | None = None) -> Scenario:
        """Return the scenario, creating it on first use; a different recipe for an existing one is a 409."""
        cached = self._cache.get(name)
        if cached is not None and (recipe is None or recipe == cached.recipe):
            return cached

        def op(conn: Conn) -> Scenario:
            row = conn.execute("SELECT * FROM scenarios WHERE name=?", (name,)).fetchone()
            if row is None:
                conn.execute(
                    "INSERT INTO scenarios(name, recipe, model, created_at, settings) VALUES (?,?,?,?,?)",
                    (name, recipe or default_recipe, model, time.time(), dumps(settings or {})),
                )
                row = conn.execute("SELECT * FROM scenarios WHERE name=?", (name,)).fetchone()
            return _scenario(row)

        scenario = await self.store.write(op)
        if recipe is not None and recipe != scenario.recipe:
            raise RecipeConflict(name, scenario.recipe, recipe)
        self._cache[name] = scenario
        return scenario

    async def change_settings(self, name: str, change: Callable[[Scenario], dict[str, Any]]) -> Scenario:
        """Replace a scenario's settings by ``change(scenario)`` (which may raise to refuse), read and written in one
        transaction, so two changes at once never lose one. The recipe binding never changes."""
        return await self._change(name, lambda conn: conn.execute(
            "UPDATE scenarios SET settings=? WHERE name=?", (dumps(change(_named(conn, name))), name)))

    async def change_model(self, name: str, model: str) -> Scenario:
        """Bind a scenario to another model (the caller checks that its chain holds no weights)."""

        def op(conn: Conn) -> None:
            _named(conn, name)
            conn.execute("UPDATE scenarios SET model=? WHERE name=?", (model, name))

        return await self._change(name, op)

    async def set_switches(self, name: str, *, capture: bool | None = None, paused: bool | None = None,
                           archived: bool | None = None) -> Scenario:
        """Turn a scenario's capture (False: serve-only from now on), its learning (paused) or its being served at
        all (archived) on or off."""

        def op(conn: Conn) -> None:
            _named(conn, name)
            for column, value in (("capture", capture), ("paused", paused), ("archived", archived)):
                if value is not None:
                    conn.execute(f"UPDATE scenarios SET {column}=? WHERE name=?", (int(value), name))

        return await self._change(name, op)

    async def set_warning(self, name: str, warning: dict[str, Any] | None) -> Scenario:
        """Write a scenario's early-warning state (``daemon/gating/warning.py``), durably: it outlives a restart."""

        def op(conn: Conn) -> None:
            if conn.execute("UPDATE scenarios SET warning=? WHERE name=?",
                            (None if warning is None else dumps(warning), name)).rowcount == 0:
                raise NotFound(f"no scenario named {name!r}", scenario=name)

        return await self._change(name, op)

    async def warned(self) -> list[Scenario]:
        """The scenarios with an early-warning state written (standing, accepted or cleared)."""
        rows = await self.store.read(lambda c: c.execute("SELECT * FROM scenarios WHERE warning IS NOT NULL")
                                     .fetchall())
        return [_scenario(row) for row in rows]

    async def get(self, name: str) -> Scenario:
        """The scenario ``name`` as stored now (``NotFound`` when there is none)."""
        return await self.store.read(lambda c: _named(c, name))

    async def all(self) -> list[Scenario]:
        """Every scenario, by name."""
        rows = await self.store.read(lambda c: c.execute("SELECT * FROM scenarios ORDER BY name").fetchall())
        return [_scenario(row) for row in rows]

    async def summaries(self) -> list[ScenarioSummary]:
        """Every scenario, by name, with what it holds."""
        score = self.store.json_number("report", "score")

        def op(conn: Conn) -> list[ScenarioSummary]:
            rows = conn.execute(
                f"""SELECT s.*,
                     (SELECT COUNT(*) FROM records r WHERE r.scenario=s.name AND r.kind='exchange') AS records,
                     (SELECT COUNT(*) FROM records r WHERE r.scenario=s.name AND r.kind='exchange'
                        AND r.capture=0) AS serve_only,
                     (SELECT COUNT(*) FROM records r WHERE r.scenario=s.name AND r.kind='report') AS reports,
                     (SELECT AVG(r.score) FROM
                        (SELECT {score} AS score FROM records WHERE scenario=s.name AND kind='report'
                         AND {score} IS NOT NULL ORDER BY seq DESC LIMIT 50) r) AS mean_score
                   FROM scenarios s ORDER BY s.name"""
            ).fetchall()
            return [ScenarioSummary(_scenario(row), records=row["records"], serve_only=row["serve_only"],
                                    reports=row["reports"], mean_score=row["mean_score"]) for row in rows]

        return await self.store.read(op)
