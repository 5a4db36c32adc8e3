"""Routes of the harness side: the rendered harness, evolve, agents' proposals, tasks, a scenario's model."""

from __future__ import annotations

from daemon import web
from daemon.errors import (
    BadRequest,
)
from daemon.names import check_scenario
from daemon.routes.common import existing_scenario, int_param, json_response, object_body


def _adapter_param(request: web.Request, required: bool) -> str | None:
    from adapters import ADAPTERS

    adapter = request.query.get("adapter")
    if adapter is None and not required:
        return None
    if adapter not in ADAPTERS:
        raise BadRequest(f"adapter must be one of {', '.join(ADAPTERS)}, got {adapter!r}", param="adapter")
    return adapter


async def handle_harness(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    return json_response(await harness.harness_view(reef, name, _adapter_param(request, required=False)))


async def handle_evolve(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    return json_response(await harness.evolve(reef, name, await object_body(request)), status=201)


async def handle_proposal(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    status, answer = await harness.propose(reef, name, await object_body(request))
    return json_response(answer, status=status)


async def handle_proposals(request: web.Request) -> web.Response:
    """A scenario's proposals with their verdicts, newest first (``daemon/proposals.py``'s ``listing``), a page at a
    time: ``limit`` of them after the proposal ``after`` (the last of the page before), ``next_after`` naming the
    last of this page while more follow."""
    from daemon.proposals import listing

    reef = request.ctx
    scen = await existing_scenario(reef, request.match_info["name"])
    limit = int_param(request, "limit", 50, 1, 1000) or 50
    after = request.query.get("after")
    history, held, rejected = (await reef.chains.history(scen.name), await reef.chains.pending(scen.name),
                               await reef.chains.rejections(scen.name))
    every = listing(history, held, rejected, reef.learner.undecided(scen.name))
    start = 0
    if after:
        at = next((i for i, e in enumerate(every) if e["id"] == after), None)
        if at is None:
            raise BadRequest(f"after names no proposal of scenario {scen.name!r}: {after!r}", param="after")
        start = at + 1
    page = every[start:start + limit]
    more = start + limit < len(every)
    return json_response({"scenario": scen.name, "proposals": page, "next_after": page[-1]["id"] if more and page else None})


async def handle_move_model(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    return json_response(await harness.move_model(reef, name, await object_body(request)))


async def handle_promote_task(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    name = check_scenario(request.match_info["name"])
    return json_response(await harness.promote_task(reef, name, await object_body(request)), status=201)


async def handle_harness_install(request: web.Request) -> web.Response:
    from daemon import harness

    reef = request.ctx
    adapter = _adapter_param(request, required=True)
    assert adapter is not None
    scenario = check_scenario(request.query.get("scenario") or adapter)
    return web.Response(harness.install_script(reef, adapter, scenario).encode(),
                        content_type="text/x-shellscript; charset=utf-8")
