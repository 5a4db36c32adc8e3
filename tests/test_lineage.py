"""Where a weights step starts (``daemon/lineage.py``): the lineage a step continues, when it restarts from the head,
what a canary's end does to it, and training ahead of a canary. Pure state, in milliseconds; the same through a
running daemon is in tests/test_canary_learning.py and test_learning.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from daemon import lineage
from daemon.learning import ScenarioLearning
from recipes.base import Candidate, GateSettings


def state(*, train_ahead: bool = True, restart_after: int = 3) -> ScenarioLearning:
    st = ScenarioLearning("s")
    settings = GateSettings(canary_train_ahead=train_ahead)
    settings.restart_after = restart_after  # type: ignore[attr-defined]
    st.recipe = SimpleNamespace(kind="weights", settings=settings)  # type: ignore[assignment]
    return st


def made(tmp_path: Path, job: str) -> Candidate:
    path = tmp_path / job
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"w")
    return Candidate(path=str(path))


def test_a_lineage_goes_on_from_its_candidate_published_or_not_and_removes_the_one_it_leaves(tmp_path: Path) -> None:
    st = state()
    one, two = made(tmp_path, "job_1"), made(tmp_path, "job_2")
    lineage.follow(st, "rel_head", one, "job_1", published=False)
    assert st.lineage == ("rel_head", "candidate:job_1", one.path) and st.rejected_run == 1
    assert lineage.base(st, SimpleNamespace(release_id="rel_head")) == ("candidate:job_1", one.path)
    assert lineage.base(st, SimpleNamespace(release_id="rel_other")) is None  # the head moved: from the head
    lineage.follow(st, "rel_new", two, "job_2", published=True)
    assert st.lineage == ("rel_new", "candidate:job_2", two.path) and st.rejected_run == 0
    assert not Path(str(one.path)).exists() and Path(str(two.path)).exists()


def test_a_lineage_restarts_after_restart_after_rejections_in_a_row(tmp_path: Path) -> None:
    st = state(restart_after=2)
    head = SimpleNamespace(release_id="rel_head")
    lineage.follow(st, "rel_head", made(tmp_path, "job_1"), "job_1", published=False)
    assert lineage.base(st, head) is not None  # 1 of 2
    lineage.follow(st, "rel_head", made(tmp_path, "job_2"), "job_2", published=False)
    assert lineage.base(st, head) is None and st.rejected_run == 0  # 2 of 2: from the head, the count reset


def test_a_candidate_held_for_harm_restarts_the_lineage_from_the_head_and_its_weights_are_gone(
        tmp_path: Path) -> None:
    """A candidate the drift bound, the held-out check or the early warning held (it drifted, forgot or stopped
    answering): the next step starts from the head, not from the held weights nor the candidate before them. Bug
    caught: going on from harmful weights (the next candidate inherits the harm, as a lineage past a bad step did)."""
    st = state()
    one, two = made(tmp_path, "job_1"), made(tmp_path, "job_2")
    lineage.follow(st, "rel_head", one, "job_1", published=False)
    lineage.follow(st, "rel_head", two, "job_2", published=False, restart=True)
    assert st.lineage is None and st.rejected_run == 0
    assert lineage.base(st, SimpleNamespace(release_id="rel_head")) is None
    assert not Path(str(one.path)).exists() and not Path(str(two.path)).exists()


def test_a_promoted_canary_of_the_lineages_candidate_goes_on_from_the_new_head(tmp_path: Path) -> None:
    """The canary's candidate promoted: the lineage follows the promoted head (its content is the candidate's), so
    the next step keeps the optimizer. Bug caught: every step after a promotion starting from the head with a fresh
    optimizer (at a quarter of its rate under the warm-up)."""
    st = state()
    one = made(tmp_path, "job_1")
    lineage.follow(st, "rel_head", one, "job_1", published=False)
    lineage.canary_started(st, SimpleNamespace(release_id="rel_held", content_id="c_held"))
    assert st.canary_of == ("rel_held", "c_held", one.path) and not st.canary_done.is_set()
    st.rejected_run = 2
    lineage.canary_ended(st, True, "rel_promoted")
    assert st.lineage == ("rel_promoted", "candidate:job_1", one.path) and st.rejected_run == 0
    assert st.canary_of is None and st.canary_done.is_set()
    assert lineage.base(st, SimpleNamespace(release_id="rel_promoted")) == ("candidate:job_1", one.path)


def test_an_ended_canary_drops_the_lineage_and_a_promoted_one_not_of_it_leaves_it_as_it_is(tmp_path: Path) -> None:
    st = state()
    one = made(tmp_path, "job_1")
    lineage.follow(st, "rel_head", one, "job_1", published=False)
    lineage.canary_ended(st, True, "rel_promoted")  # a canary started by hand, of another release
    assert st.lineage == ("rel_head", "candidate:job_1", one.path)
    lineage.canary_started(st, SimpleNamespace(release_id="rel_held", content_id="c_held"))
    lineage.canary_ended(st, False, None)
    assert st.lineage is None and not Path(str(one.path)).exists() and st.canary_done.is_set()


def test_a_step_trains_ahead_only_of_the_canary_of_the_lineages_candidate(tmp_path: Path) -> None:
    st = state()
    assert lineage.ahead_of(st) is None  # no canary of ours
    one = made(tmp_path, "job_1")
    lineage.follow(st, "rel_head", one, "job_1", published=False)
    lineage.canary_started(st, SimpleNamespace(release_id="rel_held", content_id="c_held"))
    assert lineage.ahead_of(st) == ("rel_held", "c_held", one.path)
    st.ahead = st.canary_of
    assert lineage.ahead_of(st) is None  # a step already trains ahead of it
    st.ahead = None
    st.lineage = ("rel_head", "candidate:job_9", str(tmp_path / "job_9"))
    assert lineage.ahead_of(st) is None  # the lineage is no longer the canary's candidate
    off = state(train_ahead=False)
    off.lineage, off.canary_of = ("rel_head", "candidate:job_1", one.path), ("rel_held", "c_held", one.path)
    assert lineage.ahead_of(off) is None  # canary_train_ahead = false: the step waits for the verdict


@pytest.mark.asyncio
async def test_waiting_for_a_canary_lets_the_step_lock_go_until_its_end(tmp_path: Path) -> None:
    """While a step that trained ahead waits, the scenario's lock is free (archiving it is not refused for the
    whole canary), and the step has it again once the canary ends. Bugs caught: the lock kept (``no_step`` refused
    for hours), not taken back (the step's own release fails), the wait not ending at the canary's end."""
    st = state()
    running = True
    await st.lock.acquire()
    waiting = asyncio.ensure_future(lineage.wait_for_canary(st, lambda: running))
    await asyncio.sleep(0)
    assert not st.lock.locked() and st.state == "canary"
    async with st.lock:  # what archiving does meanwhile
        pass
    assert not waiting.done()
    running = False
    st.canary_done.set()
    await asyncio.wait_for(waiting, 5)
    assert st.lock.locked()
    st.lock.release()


@pytest.mark.asyncio
async def test_a_step_waiting_for_a_canary_cancelled_gives_the_lock_back_held(tmp_path: Path) -> None:
    st = state()
    await st.lock.acquire()
    waiting = asyncio.ensure_future(lineage.wait_for_canary(st, lambda: True))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert st.lock.locked()  # the step's ``async with`` releases it
