"""What one inference server's API looks like to ``daemon/engines/server.py``: a ``Dialect`` (the command line, the
generate body and its stream, the update calls), the sampling ``Params`` sent to it and the ``Step`` each chunk of its
generate stream adds. ``daemon/engines/vllm.py`` and ``daemon/engines/sglang.py`` implement it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.engines.entry import ModelEntry


@dataclass
class Step:
    """What one chunk of a server's generate stream adds: new tokens, their log-probs, and at the end the finish
    reason and the weight versions the server reports for the answer."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None  # the server's finish reason ("stop", "length", "abort", ...); None while going on
    versions: list[str] | None = None  # weight versions reported (None: none in this chunk)
    error: str | None = None  # an error the server put in the stream


@dataclass(frozen=True)
class Params:
    """Sampling as sent to the server (stop strings stay with Reef)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_token_ids: tuple[int, ...]
    # tokens the server may gather into one stream chunk (1: each token as it is sampled; the first and the last
    # chunk always come at once). Servers without a per-request setting (SGLang) send every token.
    chunk_tokens: int = 1


class Dialect:
    """What one inference server's API looks like. Subclasses: ``VLLM`` and ``SGLang``."""

    name = "server"
    generate_path = "/generate"
    health_path = "/health"

    def command(self, entry: ModelEntry, model_path: Path, port: int) -> tuple[list[str], dict[str, str]]:
        """The command line and extra environment that start a server for ``model_path`` on ``port``."""
        raise NotImplementedError

    def generate_body(self, prompt: list[int], params: Params, adapter: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def parser(self) -> Any:
        """A fresh per-request reader of generate stream chunks: ``feed(obj) -> Step``."""
        raise NotImplementedError

    def load_adapter(self, name: str, path: Path) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def unload_adapter(self, name: str) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def update_weights(self, path: Path, version: str) -> list[tuple[str, dict[str, Any]]]:
        """The calls that load full weights from ``path`` and set the weight version to ``version``."""
        raise NotImplementedError

    def set_version(self, version: str) -> tuple[str, dict[str, Any]] | None:
        """The call that sets the weight version of the weights loaded now (None: not needed)."""
        return None

    # how a full-weights release is loaded by default: "reload" (the weight-update call) or "restart" (the server
    # started again on the release's directory)
    weight_update = "reload"

    version_path = "/version"

    def parse_version(self, body: Any) -> str | None:
        return body.get("version") if isinstance(body, dict) else None

    def check_update(self, path: str, body: Any) -> None:
        """Raise ``EngineError`` when a successful status still carries a failure (SGLang's ``success: false``)."""
