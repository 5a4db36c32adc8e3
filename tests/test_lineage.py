"""Where a weights step starts (``daemon/lineage.py``): the lineage a step continues, when it restarts from the head,
what a canary's end does to it, and training ahead of a canary. Pure state, in milliseconds; the same through a
running daemon is in tests/test_canary_learning.py and test_learning.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

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
    assert st.canary_of == ("rel_held", "c_held", one.path)
    st.rejected_run = 2
    lineage.canary_ended(st, True, "rel_promoted")
    assert st.lineage == ("rel_promoted", "candidate:job_1", one.path) and st.rejected_run == 0
    assert st.canary_of is None
    assert lineage.base(st, SimpleNamespace(release_id="rel_promoted")) == ("candidate:job_1", one.path)


def test_an_ended_canary_drops_the_lineage_and_a_promoted_one_not_of_it_leaves_it_as_it_is(tmp_path: Path) -> None:
    st = state()
    one = made(tmp_path, "job_1")
    lineage.follow(st, "rel_head", one, "job_1", published=False)
    lineage.canary_ended(st, True, "rel_promoted")  # a canary started by hand, of another release
    assert st.lineage == ("rel_head", "candidate:job_1", one.path)
    lineage.canary_started(st, SimpleNamespace(release_id="rel_held", content_id="c_held"))
    lineage.canary_ended(st, False, None)
    assert st.lineage is None and not Path(str(one.path)).exists()


def test_a_step_trains_ahead_only_of_the_canary_of_the_lineages_candidate_or_of_one_waiting_for_it(
        tmp_path: Path) -> None:
    """Bugs caught: training on top of a canary that is not the lineage's (one started by hand), not chaining onto
    the candidate that waits (every batch but one idles while the canary runs), training ahead with the setting off
    or on a shared store (whose claims are settled per step)."""
    st = state()
    assert lineage.ahead_of(st) is None  # no canary of ours
    one = made(tmp_path, "job_1")
    lineage.follow(st, "rel_head", one, "job_1", published=False)
    lineage.canary_started(st, SimpleNamespace(release_id="rel_held", content_id="c_held"))
    ours = ("rel_held", "c_held", one.path)
    assert lineage.ahead_of(st) == ours and lineage.ahead_of(st, shared=True) is None
    two = made(tmp_path, "job_2")
    run = SimpleNamespace(receipts=["a", "b"], metrics={}, head=SimpleNamespace(release_id="rel_head"), job_id="job_2",
                          candidate=two)
    lineage.park(st, run)
    assert st.waiting is run and lineage.waiting_receipts(st) == {"a", "b"}
    assert st.lineage == ("rel_head", "candidate:job_2", two.path) and not Path(str(one.path)).exists()
    assert lineage.ahead_of(st) == ours  # the next batch trains on top of the one that waits
    st.lineage = ("rel_head", "candidate:job_9", str(tmp_path / "job_9"))
    assert lineage.ahead_of(st) is None  # the lineage is neither the canary's nor the waiting one's
    off = state(train_ahead=False)
    off.lineage, off.canary_of = ("rel_head", "candidate:job_1", one.path), ours
    assert lineage.ahead_of(off) is None  # canary_train_ahead = false: the step waits for the verdict
