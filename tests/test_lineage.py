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


def fresh(text: str) -> str:
    """The same text as a new object (not the interned literal): ``is`` for ``==`` shows."""
    return "".join(list(text))


def test_only_a_weights_recipe_has_a_lineage(tmp_path: Path) -> None:
    """Bugs caught: a harness (or no recipe) given a lineage whose directory is then removed; ``or`` for ``and``."""
    one = made(tmp_path, "job_1")
    for recipe in (None, SimpleNamespace(kind="harness", settings=GateSettings())):
        st = state()
        st.recipe = recipe  # type: ignore[assignment]
        lineage.follow(st, "rel_head", one, "job_1", published=False)
        lineage.follow(st, "rel_head", one, "job_1", published=False, restart=True)
        assert st.lineage is None and st.rejected_run == 0 and Path(str(one.path)).exists()


def test_a_restart_or_an_ended_canary_whose_weights_are_already_gone_does_not_raise(tmp_path: Path) -> None:
    st = state()
    gone = Candidate(path=str(tmp_path / "never_made"))
    lineage.follow(st, "rel_head", gone, "job_1", published=False)
    lineage.follow(st, "rel_head", gone, "job_1", published=False, restart=True)
    assert st.lineage is None
    lineage.follow(st, "rel_head", gone, "job_1", published=False)
    lineage.canary_started(st, SimpleNamespace(release_id="rel_held", content_id="c_held"))
    lineage.canary_ended(st, False, None)
    assert st.lineage is None
    one = made(tmp_path, "job_2")  # the one it leaves already removed: following another does not raise
    lineage.follow(st, "rel_head", gone, "job_1", published=False)
    lineage.follow(st, "rel_head", one, "job_2", published=True)
    assert st.lineage == ("rel_head", "candidate:job_2", one.path)


def test_a_skipped_step_keeps_the_lineages_weights_and_follows_the_head_and_is_not_a_rejection(
        tmp_path: Path) -> None:
    """A step with nothing to train (skipped: no weights made) leaves the lineage's candidate where it was, under the
    head it was judged against. Bugs caught: the lineage's key or directory replaced, a skip counted as a
    rejection (restart_after would restart a lineage for having no data), a skip with no lineage inventing one."""
    st = state()
    skipped = Candidate(path=None, skipped="no new scored records")
    lineage.follow(st, "rel_head", skipped, "job_0", published=False)
    assert st.lineage is None and st.rejected_run == 0
    one = made(tmp_path, "job_1")
    lineage.follow(st, "rel_head", one, "job_1", published=False)
    lineage.follow(st, "rel_new", skipped, "job_2", published=False)
    assert st.lineage == ("rel_new", "candidate:job_1", one.path) and st.rejected_run == 1
    assert Path(str(one.path)).exists()


def test_following_the_same_weights_again_keeps_them_and_another_removes_them(tmp_path: Path) -> None:
    """Bugs caught: the directory removed when the lineage goes on from the same weights (a promotion's re-follow),
    compared by identity, by order or by the wrong field."""
    st = state()
    one, two = made(tmp_path, "job_1"), made(tmp_path, "job_2")
    lineage.follow(st, "rel_head", two, "job_2", published=False)
    lineage.follow(st, "rel_head", Candidate(path=fresh(str(two.path))), "job_2", published=True)
    assert Path(str(two.path)).exists() and st.lineage == ("rel_head", "candidate:job_2", two.path)
    lineage.follow(st, "rel_head", one, "job_1", published=True)  # job_1 sorts before job_2: removed all the same
    assert not Path(str(two.path)).exists() and Path(str(one.path)).exists()


def test_the_lineage_continues_only_under_its_own_head_and_restart_after_counts_from_its_setting(
        tmp_path: Path) -> None:
    """Bugs caught: a head compared by identity or order (``rel_a`` sorts before ``rel_head``), a count above the
    setting not restarting, ``restart_after`` 0 (never) restarting, a recipe without the setting restarting."""
    st = state(restart_after=2)
    one = made(tmp_path, "job_1")
    lineage.follow(st, "rel_head", one, "job_1", published=False)
    assert lineage.base(st, SimpleNamespace(release_id=fresh("rel_head"))) == ("candidate:job_1", one.path)
    assert lineage.base(st, SimpleNamespace(release_id="rel_a")) is None
    lineage.follow(st, "rel_head", one, "job_1", published=False)
    st.rejected_run = 5  # past the setting
    assert lineage.base(st, SimpleNamespace(release_id="rel_head")) is None and st.rejected_run == 0
    never = state(restart_after=0)
    lineage.follow(never, "rel_head", one, "job_1", published=False)
    never.rejected_run = 50
    assert lineage.base(never, SimpleNamespace(release_id="rel_head")) == ("candidate:job_1", one.path)
    bare = state()
    bare.recipe = SimpleNamespace(kind="weights", settings=SimpleNamespace())  # type: ignore[assignment]
    lineage.follow(bare, "rel_head", one, "job_1", published=False)
    assert lineage.base(bare, SimpleNamespace(release_id="rel_head")) == ("candidate:job_1", one.path)


def test_a_promoted_canary_of_other_weights_does_not_move_the_lineage(tmp_path: Path) -> None:
    """The canary's weights are not the lineage's last candidate (which sorts before or after them): a promotion
    leaves the lineage under its head. Bugs caught: ``<=``/``>=``/``is`` for ``==`` on the directories."""
    for mine, theirs in (("job_1", "job_2"), ("job_2", "job_1")):
        st = state()
        (tmp_path / mine).mkdir()
        path = made(tmp_path / mine, "w")
        lineage.follow(st, "rel_head", path, mine, published=False)
        st.canary_of = ("rel_held", "c_held", str(tmp_path / theirs / "w"))
        lineage.canary_ended(st, True, "rel_promoted")
        assert st.lineage == ("rel_head", f"candidate:{mine}", path.path)
    st = state()
    one = made(tmp_path, "job_3")
    lineage.follow(st, "rel_head", one, "job_3", published=False)
    st.canary_of = ("rel_held", "c_held", fresh(str(one.path)))
    lineage.canary_ended(st, True, "rel_promoted")
    assert st.lineage == ("rel_promoted", "candidate:job_3", one.path)


def test_training_ahead_needs_the_lineage_to_be_the_canarys_or_the_waiting_ones(tmp_path: Path) -> None:
    """Bugs caught: directories compared by order or identity, a recipe without the setting not training ahead."""
    for mine, theirs in (("a", "b"), ("b", "a")):
        st = state()
        st.lineage, st.canary_of = ("rel_head", "candidate:j", str(tmp_path / mine)), ("rel_held", "c", str(tmp_path / theirs))
        assert lineage.ahead_of(st) is None
        st.waiting = SimpleNamespace(candidate=SimpleNamespace(path=str(tmp_path / theirs)))
        assert lineage.ahead_of(st) is None
    st = state()
    st.lineage, st.canary_of = ("rel_head", "candidate:j", str(tmp_path / "a")), ("rel_held", "c", fresh(str(tmp_path / "a")))
    assert lineage.ahead_of(st) == st.canary_of
    st.canary_of = ("rel_held", "c", str(tmp_path / "z"))
    st.waiting = SimpleNamespace(candidate=SimpleNamespace(path=fresh(str(tmp_path / "a"))))
    assert lineage.ahead_of(st) == st.canary_of
    st.recipe = SimpleNamespace(kind="weights", settings=SimpleNamespace())  # type: ignore[assignment]
    assert lineage.ahead_of(st) == st.canary_of  # a recipe without the setting trains ahead (its default)


def test_parking_counts_batches_sums_trainer_seconds_and_keeps_the_weights_it_goes_on_from(tmp_path: Path) -> None:
    """Bugs caught: a first waiting candidate without a count read as 0 or 2, trainer seconds not summed or not
    rounded to the millisecond, the directory removed when the same weights are parked again."""
    from daemon import spend

    st = state()
    one = made(tmp_path, "job_1")

    def run(job: str, path: str, seconds: float | None, **metrics: object) -> SimpleNamespace:
        m = {**metrics, **({spend.KEY: seconds} if seconds is not None else {})}
        return SimpleNamespace(receipts=[job], metrics=m, head=SimpleNamespace(release_id="rel_head"), job_id=job,
                               candidate=SimpleNamespace(path=path))

    st.waiting = run("job_0", str(tmp_path / "job_0"), None)  # waiting, with no count and no seconds
    first = run("job_1", str(one.path), 0.0004)
    lineage.park(st, first)
    assert first.metrics["steps_ahead"] == 2 and first.metrics[spend.KEY] == 0.0
    second = run("job_2", fresh(str(one.path)), 0.0004)
    st.waiting.metrics[spend.KEY] = 0.0004
    lineage.park(st, second)
    assert second.metrics["steps_ahead"] == 3 and second.metrics[spend.KEY] == 0.001
    assert second.receipts == ["job_0", "job_1", "job_2"] and Path(str(one.path)).exists()
    # a run without trainer seconds adds none; the weights it leaves are removed, whichever way their names sort,
    # and weights already gone do not make parking raise
    later = made(tmp_path, "job_0_later")  # sorts before job_1
    third = run("job_3", str(later.path), None)
    lineage.park(st, third)
    assert third.metrics[spend.KEY] == 0.001 and not Path(str(one.path)).exists()
    st.lineage = ("rel_head", "candidate:gone", str(tmp_path / "gone"))
    lineage.park(st, run("job_4", str(later.path), 1.0))
    assert Path(str(later.path)).exists()
