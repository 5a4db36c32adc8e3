"""What one model entry says (``[models.NAME]`` in ``config.toml``): which engine serves it and with what settings.

It lives beside the engines rather than in ``daemon/config.py`` because the engines read it and the config, which
checks an entry's engine against the registry (``daemon/engines/registry.py``), builds it: both import it from here,
and no engine imports the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from daemon.errors import BadRequest
from daemon.listening import is_loopback


@dataclass(frozen=True)
class ModelEntry:
    """One model the daemon can serve: an engine and where the model lives."""

    name: str
    engine: str = "transformers"  # transformers | upstream | vllm | sglang
    path: Path | None = None  # transformers, vllm, sglang: a Hugging Face model directory
    device: str = "auto"  # transformers: cpu | cuda | auto
    threads: int = 1  # transformers: torch CPU threads used for generation
    max_batch: int = 8  # transformers: concurrent sequences decoded together
    # new tokens for a client that asks for no limit (Codex); None: the output cap (upstream: Anthropic's 4096)
    max_new_tokens: int | None = None
    # the output cap: the most new tokens any request gets, whatever it asks (daemon/engines/prompts.py); None: an
    # eighth of the model's context within [256, 4096] on a local engine (SmolLM2: 1,024), no cap upstream
    max_tokens_limit: int | None = None
    memory_budget_mb: int = 4096  # transformers: resident loads beyond this are dropped when idle (LRU)
    prefix_cache_mb: int = 256  # transformers: KV caches of finished sequences kept for reuse (0: off)
    # transformers, Llama-family models on the CPU (daemon/engines/decode.py): a hand-written forward and KV cache,
    # and linear layers whose weights lie on a 4-bit grid (SmolLM2's) served by an int4 kernel
    fast_path: bool = True
    pack_int4: bool = True
    url: str | None = None  # upstream: base URL; vllm, sglang: attach to this running server instead of starting one
    format: str = "openai-chat"  # upstream: openai-chat | openai-responses | anthropic
    upstream_model: str | None = None  # upstream: the provider's model name
    api_key_env: str | None = None  # upstream: environment variable holding the key
    join_text_parts: bool = True  # upstream openai-chat: content given as text parts only goes as one string
    timeout_s: float = 600.0  # upstream: total timeout
    connect_timeout_s: float = 10.0
    # vllm, sglang (``daemon/engines/server.py``): the server Reef starts and supervises
    server: str | None = None  # the Python interpreter that has the server installed (its own venv)
    server_port: int | None = None  # its loopback port (default: a free one)
    server_args: tuple[str, ...] = ()  # extra command-line flags
    server_log: str | None = None  # where its output goes (default: /tmp/reef-<engine>-<model>-<port>.log)
    startup_timeout_s: float = 600.0  # from start to healthy, else it is killed and started again
    retry_after_s: int = 5  # Retry-After of the 503 while the server is not ready
    max_model_len: int | None = None  # context the server allocates (default: the model's)
    max_lora_rank: int = 16
    max_loras: int = 4  # adapters resident at once (least recently used ones are unloaded)
    kv_cache_gb: int = 1  # vllm on the CPU: VLLM_CPU_KVCACHE_SPACE
    enforce_eager: bool = True  # vllm: no graph capture (the CPU build)
    weight_update: str = "auto"  # full-weights releases: reload (the server's update call) | restart | auto


def check_base_url(url: str, where: str, *, keyed: bool) -> None:
    """An upstream base URL Reef may use: http(s), a host, no credentials in it (the key goes in a header, read
    from a variable), and https unless the host is loopback when a key is sent. Messages never echo a URL that
    holds credentials."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        raise BadRequest(f"{where}: the URL carries credentials (user:password@); Reef refuses it: give the key in "
                         "an environment variable named by api_key_env (--upstream-key-env) instead", param="url")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequest(f"{where}: the URL must be an http(s) URL with a host, got {url!r}", param="url")
    if keyed and parts.scheme == "http" and not is_loopback(parts.hostname):
        raise BadRequest(f"{where}: the key would travel in clear text to {parts.hostname}: use https (plain http "
                         "is for loopback servers only when a key is sent)", param="url")
