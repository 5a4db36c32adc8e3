"""The daemon's side of wrapped coding agents: starting a run, serving a scenario's harness in an agent's layout,
direct instructions (``evolve``), a recorded run's prompt promoted into a task (``promote_task``), and the shell
installer behind ``GET /reef/harness/install``.

A wrapper (``reef-pi`` ...) asks ``POST /reef/runs`` once before it starts the agent: that creates the
scenario on first use (recipe ``lessons``, the daemon's default model), mints the run id, and answers the
harness release to install, with the rendered files only when the wrapper's installed release differs.
"""

from __future__ import annotations

import shlex
import sys
from typing import TYPE_CHECKING, Any

from daemon.errors import BadRequest, NotFound
from daemon.gating.heldout import user_prompt
from daemon.model_dirs import is_test_model
from daemon.names import check_scenario
from daemon.records import new_id
from daemon.reports import SHOWN_FEEDBACK_CHARS, accept_report
from recipes import load_recipe

if TYPE_CHECKING:
    from daemon.records import Scenario
    from daemon.releases import Release
    from daemon.serving import Reef

async def scenario_for_agent(reef: Reef, name: str) -> Scenario:
    """The scenario, created with the ``harness_recipe`` of the config (``lessons``) when it does not exist."""
    try:
        return await reef.store.scenarios.get(name)
    except NotFound:
        return await reef.scenario(name, recipe=reef.config.harness_recipe)


async def rendered(reef: Reef, scenario: Scenario, rel: Release, adapter_name: str | None) -> dict[str, str]:
    """The harness files of ``rel`` as text, rendered for an adapter (or in the neutral layout)."""
    from daemon.harness_policy import check_served
    from daemon.layout import check_tree

    await reef.chains.check_needs(rel)  # a harness whose needs this machine lacks is not handed to an agent
    tree = await reef.chains.harness_tree(rel)
    check_tree(tree)  # a tree that was written around the daemon (a tampered chain) is refused here too
    check_served(tree, release=rel.release_id)  # and one that grants what no automatic path may (a hook, say)
    if adapter_name is not None:
        from adapters import get_adapter

        # a harness recipe's agent is told how to propose a change to it (daemon/proposals.py)
        tree = get_adapter(adapter_name).render(tree, proposals=load_recipe(scenario.recipe).kind == "harness")
    return {path: data.decode("utf-8") for path, data in tree.items()}


async def harness_view(reef: Reef, name: str, adapter_name: str | None) -> dict[str, Any]:
    scenario = await reef.store.scenarios.get(name)
    head = await reef.chains.head(scenario)
    if not head.carries_harness:
        raise BadRequest(f"scenario {name!r} releases weights, not a harness", param="scenario")
    files = await rendered(reef, scenario, head, adapter_name)
    return {"scenario": name, "release_id": head.release_id, "step": head.step, "adapter": adapter_name,
            "files": files}


async def start_run(reef: Reef, body: dict[str, Any]) -> dict[str, Any]:
    from adapters import get_adapter

    adapter_name = body.get("adapter")
    if not isinstance(adapter_name, str):
        raise BadRequest("adapter is required (pi, claude, opencode or codex)", param="adapter")
    adapter = get_adapter(adapter_name)
    name = check_scenario(body.get("scenario") or adapter.name)
    installed = body.get("installed_release")
    if installed is not None and not isinstance(installed, str):
        raise BadRequest("installed_release must be a release id", param="installed_release")
    scenario = await scenario_for_agent(reef, name)
    run = new_id("run_")
    head = await reef.chains.head(scenario)
    if reef.canaries.active:  # a run in a canary's share gets the canary's harness, for the whole run
        head = await reef.canaries.arm(scenario, f"run={run}") or head
    await reef.chains.check_needs(head)  # refused here, before the agent starts, naming the item and an offer
    engine = await reef.engine(scenario.model)
    out: dict[str, Any] = {
        "run": run,
        "scenario": scenario.name,
        "recipe": scenario.recipe,
        "model": scenario.model,
        "kind": head.kind,
        "release_id": head.release_id if head.carries_harness else None,
        "step": head.step,
        "context_length": getattr(engine.info, "context_length", None) or 32768,
        # False: the model's chat template drops an agent's tools (the wrapper says so, with the way out)
        "carries_tools": getattr(engine.info, "carries_tools", None),
        "test_model": is_test_model(scenario.model),
        "default_model": reef.config.default_model,
        "url": f"http://{reef.config.host}:{reef.config.port}",
    }
    if scenario.warned:  # the early warning: the wrapper says it on stderr
        out["warning"] = (scenario.warning or {}).get("reason")
    if head.carries_harness and installed != head.release_id:
        out["files"] = await rendered(reef, scenario, head, adapter.name)
    return out


async def move_model(reef: Reef, name: str, body: dict[str, Any]) -> dict[str, Any]:
    """Bind a scenario whose chain holds no weights (a harness, or records only) to another configured model: a
    wrapped agent's scenario made on one model moves to another without losing its harness. A weights chain was
    trained on its base model and cannot move (409): a new scenario on the other model starts its own chain."""
    from daemon.errors import Conflict

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required (a configured model's name)", param="model")
    reef.config.model(model)  # unknown: 400 naming the configured ones
    scenario = await reef.store.scenarios.get(name)
    head = await reef.chains.head(scenario)
    if head.serves_weights or load_recipe(scenario.recipe).kind == "weights":
        raise Conflict(f"scenario {name!r} learns weights on model {scenario.model!r}; they cannot move to another "
                       f"model. Create a new scenario on {model!r} instead", scenario=name)
    moved = await reef.store.scenarios.change_model(name, model)
    reef.events.publish("scenario", scenario=moved.to_dict())
    return {**moved.to_dict(), "previous_model": scenario.model}


async def evolve(reef: Reef, name: str, body: dict[str, Any]) -> dict[str, Any]:
    """A direct instruction: stored as a report (kind ``instruction``) and learned from at once."""
    from daemon.layout import SKILL_NAME

    instruction = body.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise BadRequest("instruction is required (text)", param="instruction")
    if len(instruction) > 10_000:
        raise BadRequest(f"instruction is {len(instruction)} characters; the limit is 10000", param="instruction")
    skill = body.get("skill")
    if skill is not None and (not isinstance(skill, str) or not SKILL_NAME.fullmatch(skill)):
        raise BadRequest("skill must be a name of a-z, 0-9 and - (at most 63 characters)", param="skill")
    scenario = await scenario_for_agent(reef, name)
    if load_recipe(scenario.recipe).kind != "harness":
        raise BadRequest(f"scenario {name!r} uses recipe {scenario.recipe!r}, which does not learn a harness; "
                         "evolve needs a harness recipe (such as lessons)", param="scenario")
    stored = await accept_report(
        reef.store, reef.metrics, reef.events, scenario=name, score=None, feedback=instruction, references=[],
        metadata={"kind": "instruction", **({"skill": skill} if skill else {})}, shown=instruction[:SHOWN_FEEDBACK_CHARS],
    )
    if not await reef.learner.inline(name):  # a searching recipe runs episodes: it learns in the background
        reef.learner.notify(name)
        return {"report_id": stored["id"], "verdict": "queued",
                "summary": f"recipe {scenario.recipe} learns from it in the background"}
    outcome = await reef.learner.step(name)
    if outcome is None:
        return {"report_id": stored["id"], "verdict": "unchanged", "summary": "nothing to learn"}
    return {"report_id": stored["id"], **outcome.to_dict()}


async def _run_receipt(reef: Reef, scenario: str, run: str | None) -> str | None:
    """The newest exchange of ``run`` (the one whose tool call proposed it): None for no run or a run without
    records yet; a ``BadRequest`` when the run's records are another scenario's."""
    if run is None:
        return None
    rows = await reef.store.exchanges.listing(run=run, kind="exchange", limit=1, newest_first=True)
    if not rows:
        return None
    if rows[0]["scenario"] != scenario:
        raise BadRequest(f"run {run} is a run of scenario {rows[0]['scenario']!r}, not of {scenario!r}: an agent "
                         "proposes changes to its own harness only", param="run")
    return str(rows[0]["id"])


async def propose(reef: Reef, name: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """An agent's proposed harness change (``daemon/proposals.py``): (status, answer). The verdict (201) for a recipe
    that steps inline, else 202 ``queued``."""
    from daemon.proposals import check_open, mutation, parse

    p = parse(body)
    scenario = await reef.store.scenarios.get(name)
    if load_recipe(scenario.recipe).kind != "harness":
        raise BadRequest(f"scenario {name!r} uses recipe {scenario.recipe!r}, which does not learn a harness; a "
                         "proposal needs a harness recipe (lessons, harness-search)", param="scenario")
    check_open(scenario)
    receipt = await _run_receipt(reef, name, p.run)
    head = await reef.chains.head(scenario)
    mutation(await reef.chains.harness_tree(head), p)  # at the door: a missing or present target, before queueing
    view = {"proposal": p.id, "scenario": name, "op": p.op, "kind": p.kind, "target": p.name, "run": p.run,
            "receipt": receipt}
    if not await reef.learner.inline(name):
        reef.learner.propose_later(name, p, receipt)
        return 202, {**view, "verdict": "queued",
                     "summary": f"recipe {scenario.recipe} judges it in the background; reef releases list --all "
                                f"{name} shows the verdict"}
    outcome = await reef.learner.propose(name, p, receipt)
    return 201, {**view, **outcome.to_dict()}


async def promote_task(reef: Reef, name: str, body: dict[str, Any]) -> dict[str, Any]:
    """A run that went badly becomes one of the scenario's tasks: the user prompt of the recorded exchange
    ``receipt``, scored by the user's ``check`` in a copy of ``workspace``. The gate runs it from the next step on.
    Refused: a receipt that does not exist (404), of another scenario (404), without a user prompt (400); a
    recipe that runs no episodes (400); a task id taken (409)."""
    import re
    from pathlib import Path

    from daemon.errors import Conflict

    extra = sorted(set(body) - {"receipt", "check", "workspace", "id", "time_limit_s", "check_timeout_s"})
    if extra:
        raise BadRequest(f"unknown keys {', '.join(extra)} (known: receipt, check, workspace, id, time_limit_s, "
                         "check_timeout_s)", param=extra[0])
    receipt = body.get("receipt")
    if not isinstance(receipt, str) or not receipt:
        raise BadRequest("receipt is required (the receipt of the exchange whose prompt becomes a task)",
                         param="receipt")
    check = body.get("check")
    if not isinstance(check, str) or not check.strip():
        raise BadRequest("check is required: a shell command run in the workspace after the agent (exit status 0 "
                         "passes)", param="check")
    scenario = await reef.store.scenarios.get(name)
    recipe = reef.learner.make_recipe(scenario.recipe, scenario.settings)
    if not recipe.episode_tasks:
        raise BadRequest(f"scenario {name!r} uses recipe {scenario.recipe!r}, which runs no episodes of the agent; "
                         "promoting a run into a task needs one that does (harness-search)", param="scenario")
    record = await reef.store.exchanges.get(receipt)
    if record["scenario"] != name:
        raise NotFound(f"receipt {receipt} is a record of scenario {record['scenario']!r}, not of {name!r}",
                       receipt=receipt)
    prompt = user_prompt(record) if record.get("kind") == "exchange" else None
    if prompt is None:
        what = "an exchange" if record.get("kind") == "exchange" else f"a {record.get('kind')}"
        raise BadRequest(f"receipt {receipt} is {what} without a user prompt; there is nothing to make a task of",
                         param="receipt")
    task: dict[str, Any] = {"id": body.get("id") or "run-" + re.sub(r"[^a-z0-9]", "", receipt.lower())[-12:],
                            "prompt": prompt, "check": check}
    workspace = body.get("workspace")
    if workspace is not None:
        where = Path(workspace) if isinstance(workspace, str) else None
        if where is not None and not where.is_absolute():
            where = reef.config.home / where
        if where is None or not where.is_dir():
            raise BadRequest(f"workspace {workspace!r} is not a directory (absolute, or relative to the daemon's "
                             "home)", param="workspace")
        task["workspace"] = str(where)
    for key in ("time_limit_s", "check_timeout_s"):
        if body.get(key) is not None:
            task[key] = body[key]

    def change(current: Scenario) -> dict[str, Any]:
        made = reef.learner.make_recipe(current.recipe, current.settings)
        tasks = list(made.settings.tasks)  # with the config's, if they came from there
        if any(t.get("id") == task["id"] for t in tasks if isinstance(t, dict)):
            raise Conflict(f"scenario {name!r} has a task {task['id']!r} already", task=task["id"])
        settings = {**current.settings, "tasks": [*tasks, task]}
        reef.learner.check_settings(current.recipe, settings)  # a bad time limit, too many tasks for the budget
        return settings

    changed = await reef.store.scenarios.change_settings(name, change)
    reef.events.publish("scenario.task", scenario=name, task=task["id"], receipt=receipt)
    return {"scenario": name, "task": task, "tasks": [t["id"] for t in changed.settings["tasks"]]}


def _q(value: str) -> str:
    return shlex.quote(value)


def install_script(reef: Reef, adapter_name: str, scenario: str) -> str:
    """A POSIX shell script that installs the agent if missing and writes the ``reef-<adapter>`` wrapper for
    this daemon and scenario into ``~/.local/bin`` (or ``--prefix DIR``/bin). It holds no token: the wrapper
    reads the token file of the daemon's home when it runs."""
    from adapters import get_adapter

    adapter = get_adapter(adapter_name)
    cfg = reef.config
    py = sys.executable
    env_lines = [f"export REEF_HOME={_q(str(cfg.home))}",
                 f'export REEF_SCENARIO="${{REEF_SCENARIO:-{scenario}}}"']
    if cfg.agents_dir is not None:
        env_lines.append(f'export REEF_AGENTS_DIR="${{REEF_AGENTS_DIR:-{cfg.agents_dir}}}"')
    wrapper = "\n".join([
        "#!/bin/sh",
        f"# {adapter.command}: the {adapter.name} coding agent through Reef (scenario {scenario},",
        f"# daemon home {cfg.home}). Written by Reef's harness installer; run it again to update.",
        *env_lines,
        f"exec {_q(py)} -m reef_cli.wrapper {adapter.name} \"$@\"",
        "",
    ])
    agents_env = f"REEF_AGENTS_DIR={_q(str(cfg.agents_path))}"
    return f"""#!/bin/sh
# Reef harness installer for {adapter.name} (scenario {scenario}).
# Installs the agent if it is missing, writes the {adapter.command} wrapper, and says what it did.
# Usage: curl -fsS -H "Authorization: Bearer $REEF_TOKEN" '<daemon>/reef/harness/install?adapter={adapter.name}' | bash
#        ... | bash -s -- --prefix DIR      (wrapper in DIR/bin instead of ~/.local/bin)
set -eu
prefix="${{HOME}}/.local"
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) [ $# -ge 2 ] || {{ echo "reef installer: --prefix needs a directory" >&2; exit 2; }}; prefix="$2"; shift 2 ;;
    --prefix=*) prefix="${{1#--prefix=}}"; shift ;;
    *) echo "reef installer: unknown option $1 (known: --prefix DIR)" >&2; exit 2 ;;
  esac
done
bin="$prefix/bin"
if [ ! -x {_q(py)} ]; then
  echo "reef installer: Reef's Python ({py}) is not on this machine; run this where the daemon runs" >&2
  exit 1
fi
REEF_HOME={_q(str(cfg.home))} {agents_env} {_q(py)} -m reef_cli.main agents install {adapter.name}
mkdir -p "$bin"
target="$bin/{adapter.command}"
tmp="$bin/.{adapter.command}.tmp.$$"
cat > "$tmp" <<'REEF_WRAPPER_EOF'
{wrapper}REEF_WRAPPER_EOF
chmod 755 "$tmp"
if [ -f "$target" ] && cmp -s "$tmp" "$target"; then
  rm -f "$tmp"
  echo "{adapter.command}: $target is up to date (unchanged)"
else
  mv -f "$tmp" "$target"
  echo "{adapter.command}: wrote $target (scenario {scenario})"
fi
case ":$PATH:" in
  *":$bin:"*) ;;
  *) echo "note: $bin is not on your PATH; add it, e.g. export PATH=\\"$bin:\\$PATH\\"" ;;
esac
echo "done: run {adapter.command} exactly as you would run {adapter.binary}"
"""
