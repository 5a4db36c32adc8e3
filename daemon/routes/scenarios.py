"""Routes of scenarios: list, create, show, switch (pause, resume, capture, archive), settings and the
early warning, and a wrapper's run start."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from daemon import web
from daemon.errors import (
    BadRequest,
    NotFound,
    ReefError,
)
from daemon.gating import warning
from daemon.names import check_scenario
from daemon.records import RecordStore, Scenario
from daemon.routes.common import Handler, json_response, object_body, plain
from daemon.serving import Reef
from recipes import check_api_recipe, load_recipe
from recipes.base import off_policy_sampling


async def handle_start_run(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    return json_response(await harness.start_run(reef, await object_body(request)), status=201)


async def handle_scenarios(request: web.Request) -> web.Response:
    reef = request.ctx
    return json_response({"scenarios": [s.to_dict() for s in await reef.store.scenarios.summaries()]})


async def handle_create_scenario(request: web.Request) -> web.Response:
    reef = request.ctx
    body = await object_body(request)
    name = body.get("name")
    if not isinstance(name, str):
        raise BadRequest("name is required (a string)", param="name")
    check_scenario(name)
    recipe = body.get("recipe")
    if recipe is not None:
        if not isinstance(recipe, str):
            raise BadRequest("recipe must be a recipe name (a string)", param="recipe")
        cfg = reef.config
        check_api_recipe(recipe, paths=cfg.recipe_paths,
                         allowed=(*cfg.allowed_recipes, cfg.default_recipe, cfg.harness_recipe))
        load_recipe(recipe)  # unknown, fails to import, not a recipe: 400 saying which
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", param="model")
    base = body.get("base_release")
    if base is not None and not isinstance(base, str):
        raise BadRequest("base_release must be a release id (a string)", param="base_release")
    if base is not None:
        await reef.chains.release(base)  # unknown: 404 before the scenario exists
    settings = body.get("settings")
    if settings is not None and not isinstance(settings, dict):
        raise BadRequest("settings must be a JSON object of recipe settings", param="settings")
    reef.learner.check_settings(recipe or reef.config.default_recipe, settings or {})
    switches = {key: _switch(body, key) for key in ("capture", "paused") if key in body}
    scenario = await reef.scenario(name, recipe=recipe, model=model, settings=settings)
    if switches:
        scenario = await reef.store.scenarios.set_switches(name, **switches)
    head = await reef.chains.head(scenario, base=base)
    return json_response({**scenario.to_dict(), "head": head.release_id}, status=201)


def _switch(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false", param=key)
    return value


def switch_handler(**fixed: bool) -> Handler:
    """Pause or resume a scenario's learning (``paused``), archive it or bring it back (``archived``: neither
    served nor trained), or turn its capture on or off (the body's ``capture``): the binding, its chain and its
    records stay as they are."""

    async def handle(request: web.Request) -> web.Response:
        reef = request.ctx
        name = check_scenario(request.match_info["name"])
        switches = fixed or {"capture": _switch(await object_body(request), "capture")}
        if switches.get("archived"):  # refused while a step is out; no step starts while it is written
            async with reef.learner.no_step(name):
                scenario = await reef.store.scenarios.set_switches(name, **switches)
        else:
            scenario = await reef.store.scenarios.set_switches(name, **switches)
        if switches.get("paused") is False:  # resuming is acting on an early warning too
            scenario = await warning.clear(reef.store, reef.events, name, "resumed")
        reef.events.publish("scenario", scenario=scenario.to_dict())
        if switches.get("paused") is False or switches.get("archived") is False:
            reef.learner.notify(name)  # what came while it was paused is learned from now
        return json_response(scenario.to_dict())

    return handle


async def handle_accept_warning(request: web.Request) -> web.Response:
    """``POST /reef/scenarios/{s}/accept-warning``: the user accepts the early warning's trend: learning goes on,
    and the scenario is not warned again until its settings change (``daemon/gating/warning.py``)."""
    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    scenario = await warning.clear(reef.store, reef.events, name, "accepted")
    reef.learner.notify(name)
    return json_response(scenario.to_dict())


async def handle_update_settings(request: web.Request) -> web.Response:
    """``POST /reef/scenarios/{s}/settings {"settings": {...}}``: change a scenario's recipe settings (a key set to
    null goes back to the recipe's default), checked as at creation; it clears an early warning."""
    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    given = (await object_body(request)).get("settings")
    if not isinstance(given, dict) or not given:
        raise BadRequest("settings must be a non-empty JSON object of recipe settings", param="settings")

    def change(scenario: Any) -> dict[str, Any]:
        new = {k: v for k, v in {**scenario.settings, **given}.items() if v is not None}
        reef.learner.check_settings(scenario.recipe, new)
        return new

    scenario = await reef.store.scenarios.change_settings(name, change)
    scenario = await warning.clear(reef.store, reef.events, name, "updated")
    reef.events.publish("scenario", scenario=scenario.to_dict())
    reef.learner.notify(name)
    return json_response(scenario.to_dict())


async def handle_scenario(request: web.Request) -> web.Response:
    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    for s in await reef.store.scenarios.summaries():
        if s.scenario.name == name:
            return json_response({**s.to_dict(), **await _recipe_status(reef, s.scenario)})
    raise NotFound(f"no scenario named {name!r}", scenario=name)


async def _recipe_status(reef: Reef, scenario: Scenario) -> dict[str, Any]:
    """The recipe's own summary of its progress (``Recipe.status``), for recipes that have one."""
    from recipes.base import Recipe

    try:
        recipe = reef.learner.make_recipe(scenario.recipe, scenario.settings)
    except ReefError:  # a recipe that no longer loads: the view still shows the scenario
        return {}
    settings = recipe.settings
    out: dict[str, Any] = {"effective_settings": plain(dataclasses.asdict(settings)) if dataclasses.is_dataclass(
        settings) and not isinstance(settings, type) else {}}
    skipped = await left_out(reef.store, recipe, scenario.name)
    if skipped is not None:
        out["left_out"] = skipped
    if type(recipe).status is Recipe.status:
        return out
    releases = [r.to_dict() for r in await reef.chains.history(scenario.name)]
    rejected = [r.to_dict() for r in await reef.chains.rejections(scenario.name)]
    return {**out, "recipe_status": recipe.status(releases, rejected)}


async def left_out(store: RecordStore, recipe: Any, scenario: str) -> dict[str, Any] | None:
    """For a recipe trained on behaviour log-probs: how many of the scenario's scored exchanges it cannot use
    because of how they were sampled (``recipes.base.off_policy_sampling``), by setting, and why."""
    if not recipe.behaviour_logprobs:
        return None
    counts: Counter[str] = Counter()
    for sampling, n in await store.reports.scored_sampling(scenario):
        reason = off_policy_sampling(sampling)
        if reason is not None:
            counts[reason] += n
    return {"sampling": dict(counts), "total": sum(counts.values()),
            "why": "trained only on answers sampled at temperature 1 without top_p or top_k: the engine records "
                   "each token's log-prob under the raw logits, so the importance ratio of any other sampling "
                   "would be wrong"}
