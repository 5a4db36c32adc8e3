"""The gate's steps, in the order a candidate meets them (``STEPS``). Each ends the run with a ``StepOutcome`` or
lets the next step have it (None):

- ``skipped``: a candidate the recipe skipped, or whose content equals its parent's, is written down as skipped.
- ``canary_verdict``: weights, trained ahead of a canary (``daemon/lineage.py``): waits (parked) while it runs;
  promoted, the candidate goes on against the promoted head; ended, it is discarded (skipped, its receipts learned
  again).
- ``gate_kind``: the recipe's gate (``Recipe.judge``, ``daemon/gate.py``): ``pending`` holds it for review, a
  verdict that does not publish writes it down as rejected; a publishing one goes on, unless the harness policy
  put something only a person may admit in ``details["review"]`` (``daemon/harness_policy.py``): held for review.
- ``drift_bound``: weights: the reward-hacking watchdog (``daemon/watchdog.py``: ``max_kl``, a training reward
  rising while the held-out score falls) holds it for review.
- ``heldout_check``: weights: the held-out check (``daemon/gating/heldout.py``) holds a candidate that stops
  answering, forgets or drifts; ``heldout_check = false`` marks it ``unchecked``; a check that cannot run fails
  the step (``CheckFailed``, written down as failed by the loop).
- ``early_warning``: weights: the scored reward rising while the answers collapse over the recent candidates
  (``daemon/gating/warning.py``) holds it and warns the scenario: its learning pauses until the user acts. A
  candidate the drift bound or the held-out check holds is read for the warning too.
- ``canary``: with ``canary_share`` (weights recipes: 0.5 by default), held and served to that share of new runs as
  a canary (``daemon/canary.py``), ended by its bounds ``canary_answers`` and ``canary_hours`` if nothing else
  decides; the next step trains ahead of it (``canary_verdict``).
- ``publish``: compare-and-swap on the head (a weights candidate whose head moved is rejected, saying so).
- ``rejected``: what no step published or held is written down as rejected.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

from daemon import lineage
from daemon.errors import CheckFailed, HeadMoved, ReefError, Unchanged
from daemon.gating import heldout, warning
from daemon.gating.outcome import GateRun, Host, Step, StepOutcome
from daemon.layout import rules_of


async def _hold(host: Host, run: GateRun, reason: str, *, harm: bool = False, **extra: Any) -> StepOutcome:
    """Keep the candidate as a pending release (never served until promoted) with its figures; ``harm``: held for
    drifting, forgetting or not answering, so the next step starts again from the head (``daemon/lineage.py``)."""
    rel = await host.chains.hold(run.manifest(host, **extra), run.artifact, base=run.head.release_id)
    host.follow(run.st, run.head.release_id, run.candidate, run.job_id, published=False, restart=harm)
    return run.outcome("pending", release_id=rel.release_id, step=rel.step, reason=reason)


async def skipped(host: Host, run: GateRun) -> StepOutcome | None:
    if run.candidate.skipped is None:
        return None
    kept = run.receipts if run.candidate.consume else []
    await host.write_down(run.manifest(host, receipts=kept), run.head, "skipped", run.candidate.skipped)
    host.follow(run.st, run.head.release_id, run.candidate, run.job_id, published=False)
    return run.outcome("skipped", reason=run.candidate.skipped, kept=kept)


async def canary_verdict(host: Host, run: GateRun) -> StepOutcome | None:
    """A weights candidate trained ahead of a canary (``daemon/lineage.py``). While the canary runs it waits
    (parked: nothing written down, the next batch trains on top of it). Once the canary is promoted it goes through
    the rest of the gate against the promoted head; ended (the head is not the canary's), it is discarded, written
    down as skipped without its receipts, which are learned from again."""
    ahead = run.ahead
    if ahead is None:
        return None
    name = run.scenario.name
    if host.canary_running is not None and host.canary_running(name):
        lineage.park(run.st, run)
        reason = (f"trained ahead of canary {ahead[0]} ({run.metrics['steps_ahead']} batches): waits for its "
                  "verdict")
        return run.outcome("ahead", reason=reason, kept=[])
    head = await host.chains.head(run.scenario)
    if head.content_id == ahead[1]:
        run.head = head
        run.metrics["trained_ahead_of"] = ahead[0]
        return None
    reason = (f"trained ahead of canary {ahead[0]}, which was not promoted (the head is {head.release_id}): "
              "discarded; its batches are learned from again from the head")
    await host.write_down(run.manifest(host, receipts=[]), run.head, "skipped", reason)
    if run.candidate.path is not None:
        shutil.rmtree(str(run.candidate.path), ignore_errors=True)
    return run.outcome("skipped", reason=reason, kept=[])


async def gate_kind(host: Host, run: GateRun) -> StepOutcome | None:
    run.st.state = "judging"
    best = None
    if run.recipe.gate == "regression":  # reads the whole chain: only the gate that reports it pays for it
        best = max((float(r.metrics["eval_reward"]) for r in await host.chains.history(run.scenario.name)
                    if isinstance(r.metrics.get("eval_reward"), (int, float))), default=None)
    verdict = run.recipe.judge(run.candidate, best=best)
    review = run.candidate.details.get("review")
    if verdict.publish and review:  # the harness policy: only a person may admit it, whatever the gate
        verdict = dataclasses.replace(verdict, publish=False, verdict="pending", reason=(
            f"{verdict.reason}; held for review, since only a person may admit {review[0]}"
            + (f" (and {len(review) - 1} more)" if len(review) > 1 else "") + ": reef releases promote ID "  # pragma: no mutate (review is never empty here: != 1 is > 1)
            "publishes it"))
    run.metrics.update({k: v for k, v in verdict.metrics.items() if v is not None})
    run.verdict, run.reason = verdict, verdict.reason
    if verdict.verdict == "pending":
        return await _hold(host, run, verdict.reason)
    if not verdict.publish:
        return await rejected(host, run)
    return None


async def drift_bound(host: Host, run: GateRun) -> StepOutcome | None:
    if not run.weights:
        return None
    from daemon import watchdog

    published = []  # the train steps since the last rollback or promote, newest first
    for r in await host.chains.history(run.scenario.name, watchdog.WINDOW + 1):  # pragma: no mutate (the watchdog reads WINDOW: a row more or less read changes nothing)
        if r.operation != "train":  # pragma: no mutate (init, promote and rollback sort before train: < is !=)
            break
        published.append(r.metrics)
    alarm = watchdog.check(published, run.metrics, getattr(run.recipe.settings, "max_kl", None),
                           held_out=run.recipe.held_out_eval)
    if alarm is None:
        return None
    out = await _hold(host, run, alarm["reason"], harm=True, watchdog=alarm["reason"])
    host.events.publish("watchdog", scenario=run.scenario.name, release_id=out.release_id, **alarm)
    await warning.after_hold(host, run, out)
    return out


async def heldout_check(host: Host, run: GateRun) -> StepOutcome | None:
    harness = not run.weights and run.candidate.tree is not None
    if not harness and (not run.weights or run.candidate.path is None):
        return None
    settings = heldout.CheckSettings.of(run.recipe.settings)
    if not settings.on:
        run.metrics["heldout"] = "unchecked"
        host.metrics.heldout_checks.labels("unchecked").inc()
        return None
    name = run.scenario.name
    if await host.chains.head_id(name) != run.head.release_id:
        return None  # the head moved during training: ``publish`` turns it away, saying so; nothing to check
    try:
        fig = await (_harness_check if harness else _check)(host, run, settings)
    except CheckFailed as e:
        host.metrics.heldout_checks.labels("failed").inc()
        host.events.publish("heldout", scenario=name, job=run.job_id, verdict="failed", reason=e.message)
        raise
    run.metrics.update(fig.metrics())
    host.metrics.heldout_checks.labels("held" if fig.hold else "passed").inc()
    if fig.hold is None:
        host.events.publish("heldout", scenario=name, job=run.job_id, verdict="passed", metrics=fig.metrics())
        return None
    out = await _hold(host, run, fig.hold, harm=True)
    host.events.publish("heldout", scenario=name, job=run.job_id, verdict="held", release_id=out.release_id,
                        reason=fig.hold, metrics=fig.metrics())
    await warning.after_hold(host, run, out)
    return out


async def first_release(host: Host, st: Any, scenario: Any, head: Any) -> Any:
    """The chain's first release, whose probe answers the held-out check compares a candidate's with too (kept on
    ``st``: a chain only grows at its head); None where the head is it (the same content)."""
    first = getattr(st, "first_release", None)
    if first is None:
        chain = await host.chains.history(scenario.name)
        first = st.first_release = chain[-1] if chain else None
    return None if first is None or first.content_id == head.content_id else first


async def prefetch_head(host: Host, st: Any, scenario: Any, head: Any) -> float:
    """The serving head's answers that the next held-out check compares with (the reserved recorded prompts and
    every probe), and the chain's first release's answers to the probes where not kept yet, asked while the
    trainer trains, so that the check asks the candidate alone (the loop starts it beside a weights step's
    training: the trainer is another process, the engine's thread has room). Returns the seconds it took. Never
    raises: the check asks what is still missing, and fails properly if it cannot."""
    t0 = time.perf_counter()
    try:
        settings = heldout.CheckSettings.of(st.recipe.settings)
        if not settings.on:
            return 0.0
        engine = await host.engine(scenario.model)
        ref = await host.chains.ref(scenario, head)
        key = (head.content_id, *settings.lengths)
        known = host.heldout_head(st, key) or {}
        recorded = await host.heldout_prompts(st)
        prompts = [*recorded, *(p.prompt for p in settings.probes)]
        missing = [p for p in dict.fromkeys(prompts) if p not in known]
        if missing:
            got = await heldout.answers(engine, scenario.model, missing, ref, *settings.asking(recorded))
            host.heldout_head(st, key, {**(host.heldout_head(st, key) or {}), **dict(zip(missing, got, strict=True))})  # pragma: no mutate (an answer per prompt by construction)
        first = await first_release(host, st, scenario, head)
        if first is not None:
            key = (first.content_id, *settings.lengths)
            known = host.heldout_head(st, key) or {}
            missing = [p.prompt for p in settings.probes if p.prompt not in known]
            if missing:
                got = await heldout.answers(engine, scenario.model, missing, await host.chains.ref(scenario, first),
                                            settings.max_tokens)
                host.heldout_head(st, key, {**known, **dict(zip(missing, got, strict=True))})  # pragma: no mutate (an answer per prompt by construction)
    except Exception:  # noqa: BLE001 - the check itself asks, and says why it could not
        pass
    return time.perf_counter() - t0


async def _check(host: Host, run: GateRun, settings: heldout.CheckSettings) -> heldout.Figures:
    """The held-out check of a weights candidate against the head, through the scenario's engine. The head's
    answers asked during training (``prefetch_head``) are awaited first, within ``heldout_timeout_s`` too; that
    wait counts in the check's seconds."""
    from daemon import lora
    from daemon.engines.base import ReleaseRef

    t0 = time.perf_counter()
    prefetch, run.st.heldout_prefetch = getattr(run.st, "heldout_prefetch", None), None
    try:
        prefetched = await asyncio.wait_for(prefetch, settings.timeout_s) if prefetch is not None else None
    except TimeoutError:
        raise CheckFailed(f"it took longer than heldout_timeout_s {settings.timeout_s:g}") from None
    waited = time.perf_counter() - t0
    try:
        engine = await host.engine(run.scenario.model)
        head = await host.chains.ref(run.scenario, run.head)
        first = await first_release(host, run.st, run.scenario, run.head)
        first_ref = None if first is None else await host.chains.ref(run.scenario, first)
    except ReefError as e:
        raise CheckFailed(e.message) from None
    model = head.base or head  # the whole model: what an adapter applies to
    path = Path(str(run.candidate.path))
    adapter = await asyncio.to_thread(lora.read_dir, path) is not None
    key = f"candidate:{run.job_id}"  # loaded under its own key: no request names it, so none is served from it
    candidate = ReleaseRef(key, key, path, model if adapter else None)
    recorded = await host.heldout_prompts(run.st)
    head_key = (run.head.content_id, *settings.lengths)
    first_key = None if first is None else (first.content_id, *settings.lengths)
    firsts = None if first_key is None else dict(host.heldout_head(run.st, first_key) or {})
    try:
        fig, cands, heads = await heldout.run(engine, run.scenario.model, candidate, head, model, recorded, settings,
                                              host.heldout_head(run.st, head_key), first_release=first_ref,
                                              first_known=firsts)
    finally:
        if first_key is not None and firsts:  # pragma: no mutate (or: firsts is None exactly when first_key is)
            host.heldout_head(run.st, first_key, firsts)  # asked once, even when the check then failed
    host.heldout_head(run.st, head_key, heads)
    run.heldout_answers = (settings.lengths, cands)  # the head's answers once published: not asked again
    fig.seconds += waited
    fig.prefetch_seconds = prefetched
    return fig


async def _harness_check(host: Host, run: GateRun, settings: heldout.CheckSettings) -> heldout.Figures:
    """The held-out check of a harness candidate: the scenario's model answers the probes under the candidate's
    rules (its ``AGENTS.md`` as the system prompt, as an agent loads it), under the head's and under the chain's
    first release's; the same figures and bounds as a weights candidate's (silence, degenerate answers, probes
    lost against the head and against the first release), without KL (the weights are the same) or reserved
    recorded prompts (a harness recipe learns from feedback, not from the prompts). Rules equal to the head's give
    the head's answers: what the head answered is not asked again."""
    candidate = rules_of(run.candidate.tree)
    try:
        engine = await host.engine(run.scenario.model)
        head_rules = rules_of(await host.chains.harness_tree(run.head))
        first = await first_release(host, run.st, run.scenario, run.head)
        first_rules = None if first is None else rules_of(await host.chains.harness_tree(first))
    except ReefError as e:
        raise CheckFailed(e.message) from None
    head_key = (run.head.content_id, *settings.lengths)
    first_key = None if first is None else (first.content_id, *settings.lengths)
    firsts = None if first_key is None else dict(host.heldout_head(run.st, first_key) or {})
    known = host.heldout_head(run.st, head_key)
    try:
        fig, cands, heads = await heldout.run(
            engine, run.scenario.model, None, None, None, [], settings, known, first_release=None, first_known=firsts,
            rules=heldout.Rules(candidate, head_rules, first_rules),
            candidate_known=known if candidate == head_rules else None)  # the same rules: the head's answers
    finally:
        if first_key is not None and firsts:  # pragma: no mutate (or: firsts is None exactly when first_key is)
            host.heldout_head(run.st, first_key, firsts)
    host.heldout_head(run.st, head_key, heads)
    run.heldout_answers = (settings.lengths, cands)  # the head's answers once published: not asked again
    return fig


async def early_warning(host: Host, run: GateRun) -> StepOutcome | None:
    found = await warning.read(host, run)
    if found is None:
        return None
    out = await _hold(host, run, warning.text(run.scenario.name, found), harm=True, warning=found["says"])
    await warning.raise_warning(host, run, found, out.release_id, out.step)
    return out


async def canary(host: Host, run: GateRun) -> StepOutcome | None:
    share = float(getattr(run.recipe.settings, "canary_share", 0) or 0)  # pragma: no mutate (a missing share and -1 both mean none)
    if share <= 0 or host.start_canary is None:  # live scores decide, not the gate
        return None
    settings = run.recipe.settings
    rel = await host.chains.hold(run.manifest(host), run.artifact, base=run.head.release_id)
    try:
        await host.start_canary(run.scenario, {
            "release_id": rel.release_id, "share": share, "max_answers": getattr(settings, "canary_answers", None),
            "max_hours": getattr(settings, "canary_hours", None)})
        why = f"{run.reason}; serving {share:.0%} of new runs as a canary (reef releases list shows it)"
        started = True
    except ReefError as e:  # one canary at a time: this one waits for review
        why = f"{run.reason}; held for review: no canary could start ({e.message})"
        started = False
    host.follow(run.st, run.head.release_id, run.candidate, run.job_id, published=False)
    if started:
        lineage.canary_started(run.st, rel)  # the next step may train ahead of it
        if run.heldout_answers is not None:  # the head's answers once promoted: not asked again
            lengths, answers = run.heldout_answers
            host.heldout_head(run.st, (rel.content_id, *lengths), answers)
    return run.outcome("pending", release_id=rel.release_id, step=rel.step, reason=why)


async def publish(host: Host, run: GateRun) -> StepOutcome | None:
    record = run.manifest(host)
    try:
        engine = await host.engine(run.scenario.model) if run.weights else None
        rel = await host.chains.publish_candidate(run.scenario, record, run.artifact,
                                                  expected_head=run.head.release_id, engine=engine)
    except Unchanged as e:
        await host.write_down(record, run.head, "skipped", e.message)
        host.follow(run.st, run.head.release_id, run.candidate, run.job_id, published=False)
        return run.outcome("skipped", reason=e.message)
    except HeadMoved as e:
        if not run.weights:
            raise
        run.reason = f"the head moved during training (now {e.actual}); not published"
        return None
    if run.candidate.eval is not None:
        run.st.head_eval = (rel.release_id, run.candidate.eval.candidate)
    if run.heldout_answers is not None:
        lengths, answers = run.heldout_answers
        host.heldout_head(run.st, (rel.content_id, *lengths), answers)
    host.follow(run.st, rel.release_id, run.candidate, run.job_id, published=True)
    return run.outcome("accepted", release_id=rel.release_id, step=rel.step, reason=run.reason)


async def rejected(host: Host, run: GateRun) -> StepOutcome:
    reason = run.reason or "rejected"
    await host.write_down(run.manifest(host), run.head, "rejected", reason)
    host.follow(run.st, run.head.release_id, run.candidate, run.job_id, published=False)
    return run.outcome("rejected", reason=run.reason)


STEPS: tuple[Step, ...] = (skipped, canary_verdict, gate_kind, drift_bound, heldout_check, early_warning, canary, publish,
                           rejected)


async def run(host: Host, gate_run: GateRun, steps: tuple[Step, ...] = STEPS) -> StepOutcome:
    """The candidate through ``steps`` until one ends its run (the last, ``rejected``, always does)."""
    for step in steps:
        out = await step(host, gate_run)
        if out is not None:
            return out
    raise AssertionError(f"no step of {[s.__name__ for s in steps]} ended the gate's run")
