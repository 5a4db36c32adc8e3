"""What an engine serves is said once, where it is registered (``daemon/engines/registry.py``), and that decides
what its scenarios' chains hold: a new engine class registered as serving weights gets weights releases, one that
does not gets harness releases. No hand-kept list elsewhere can leave a weights engine out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from daemon.chains import Chains, artifact_kind
from daemon.config import load_config
from daemon.engines import Engine, EngineInfo, build_engine, engine_kind, register
from daemon.engines.base import ReleaseRef
from daemon.engines.registry import unregister
from daemon.errors import BadRequest
from daemon.events import EventBus
from daemon.exchange import EngineEvent, Exchange
from daemon.metrics import Metrics
from daemon.records import Scenario


class _Standin(Engine):
    """An engine that generates nothing: only its registration is under test."""

    def __init__(self, entry, secrets, metrics) -> None:  # type: ignore[no-untyped-def]
        self.entry = entry
        self.info = EngineInfo(name=entry.engine, model=entry.name)

    async def generate(self, exchange: Exchange, release: ReleaseRef | None = None) -> AsyncIterator[EngineEvent]:
        raise NotImplementedError
        yield  # pragma: no cover

    async def count_tokens(self, exchange: Exchange, release: ReleaseRef | None = None) -> int:
        return 0


@pytest.fixture
def new_engines() -> Iterator[None]:
    register("test-weights", weights=True)(_Standin)
    register("test-harness", weights=False)(_Standin)
    try:
        yield
    finally:
        unregister("test-weights")
        unregister("test-harness")


def test_a_registered_engine_decides_what_its_chains_hold(tmp_path: Path, new_engines: None) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text('[models.w]\nengine = "test-weights"\n\n[models.h]\nengine = "test-harness"\n')
    config = load_config(env={"REEF_HOME": str(home), "HOME": str(tmp_path)})  # the config takes registered names
    assert isinstance(build_engine(config.model("w")), _Standin)
    assert engine_kind("test-weights").weights and not engine_kind("test-harness").weights

    async def main() -> dict[str, str]:
        chains = Chains(config, EventBus(), Metrics())
        await chains.start()
        try:
            kinds = {}
            for model in ("w", "h"):
                # the record recipe never trains: its releases hold what its model's engine serves
                scenario = Scenario(name=f"on-{model}", recipe="record", model=model, created_at=time.time(),
                                    settings={})
                assert artifact_kind(config, scenario) == ("weights" if model == "w" else "harness")
                kinds[model] = (await chains.head(scenario)).kind  # the chain's init release
            return kinds
        finally:
            await chains.close()

    assert asyncio.run(main()) == {"w": "weights", "h": "harness"}


def test_unknown_and_doubly_registered_engines_are_refused() -> None:
    with pytest.raises(BadRequest, match="unknown engine 'nope': one of transformers, upstream, vllm, sglang"):
        engine_kind("nope")
    with pytest.raises(ValueError, match="registered already"):
        register("transformers", weights=True)(_Standin)
    assert engine_kind("transformers").weights and not engine_kind("transformers").server
    assert engine_kind("vllm").server and engine_kind("sglang").server and not engine_kind("upstream").weights
