"""Provider presets: a real model provider in one flag (``reef serve --provider anthropic``).

A preset is what a user would otherwise write as an ``upstream`` model entry by hand: the provider's base URL, its
wire format, a default model name and the environment variable its key is read from. ``--provider NAME`` (or
``REEF_PROVIDER=NAME``) adds the entry ``NAME`` to the config, in memory only, and makes it the default model;
``--upstream-url`` / ``--upstream-model`` / ``--upstream-format`` / ``--upstream-key-env`` (or ``REEF_UPSTREAM_URL``,
``REEF_UPSTREAM_MODEL``, ``REEF_UPSTREAM_FORMAT``, ``REEF_UPSTREAM_KEY_ENV``) override the preset's.

The key: read from the environment by its variable's name only (``api_key_env``), captured in
``Config.secrets``, sent in the provider's header (``x-api-key`` for Anthropic, ``Authorization: Bearer`` for the
OpenAI formats) and nowhere else: never in ``config.toml``, a log line, a record, a release, a status answer or an
error message (messages name the variable). A missing key stops the daemon at start with one line naming the
variable (``require_provider_key``). Base URLs: http(s) only; credentials in the URL (``user:pass@``) are refused
(they would otherwise be dropped silently, and they would show in argv); a key is never sent over plain http to
anything but loopback (``check_base_url``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from daemon.engines.entry import ModelEntry, check_base_url
from daemon.errors import BadRequest

FORMATS = ("openai-chat", "openai-responses", "anthropic")
KEY_SUFFIXES = ("_API_KEY", "_KEY", "_TOKEN")  # the variables ``load_config`` captures as secrets
FLAG_KEYS = ("provider", "upstream_url", "upstream_model", "upstream_format", "upstream_key_env")
ENV_VARS = {"provider": "REEF_PROVIDER", "upstream_url": "REEF_UPSTREAM_URL", "upstream_model": "REEF_UPSTREAM_MODEL",
            "upstream_format": "REEF_UPSTREAM_FORMAT", "upstream_key_env": "REEF_UPSTREAM_KEY_ENV"}


@dataclass(frozen=True)
class Preset:
    name: str
    url: str | None  # None: the user gives it (--upstream-url)
    formats: tuple[str, ...]  # the first is the default
    model: str | None  # the provider's default model name (None: the client's, or --upstream-model)
    key_env: str | None  # the variable the key is read from (None: no key)
    needs_model: bool = False  # the server serves nothing without a model name (Ollama)
    # chat content given as a list of text parts goes joined into one string (``daemon/engines/upstream.py``): a
    # local server's chat template often takes strings only; OpenAI's own API takes the list as sent
    join_text_parts: bool = True


PRESETS: Mapping[str, Preset] = {p.name: p for p in (
    # Anthropic's Messages API
    Preset("anthropic", "https://api.anthropic.com", ("anthropic",), "claude-sonnet-4-5", "ANTHROPIC_API_KEY"),
    # OpenAI's chat completions (or --upstream-format openai-responses)
    Preset("openai", "https://api.openai.com/v1", ("openai-chat", "openai-responses"), "gpt-4.1-mini",
           "OPENAI_API_KEY", join_text_parts=False),
    # a local Ollama server (its OpenAI-compatible API): it needs a model name
    Preset("ollama", "http://127.0.0.1:11434/v1", ("openai-chat",), None, None, needs_model=True),
    # a local llama.cpp server (llama-server): it serves the model it loaded, whatever the name
    Preset("llamacpp", "http://127.0.0.1:8080/v1", ("openai-chat",), None, None),
    # any OpenAI- (or Anthropic-) compatible server at --upstream-url
    Preset("openai-compatible", None, ("openai-chat", "openai-responses", "anthropic"), None, None),
)}
UNKEYED_DEFAULT_ENV = "REEF_UPSTREAM_API_KEY"  # openai-compatible: the key when this variable is set


def known() -> str:
    return ", ".join(PRESETS)


def check_key_env(name: str, where: str) -> None:
    if not name.endswith(KEY_SUFFIXES) or name == "REEF_TOKEN" or not name.replace("_", "").isalnum():
        raise BadRequest(f"{where}: the key variable must be a name ending in _API_KEY, _KEY or _TOKEN (not "
                         f"REEF_TOKEN), got {name!r}", param="api_key_env")


def provider_entry(name: str, env: Mapping[str, str], *, url: str | None = None, model: str | None = None,
                   format: str | None = None, key_env: str | None = None) -> ModelEntry:
    """The model entry ``name`` of ``--provider NAME`` with the flags' overrides; refused (naming what is wrong)
    when the name is unknown or a setting cannot work."""
    preset = PRESETS.get(name)
    if preset is None:
        raise BadRequest(f"unknown provider {name!r}; known providers: {known()}", param="provider")
    where = f"--provider {name}"
    url = url or preset.url
    if url is None:
        raise BadRequest(f"{where} needs --upstream-url URL (the server's base URL, e.g. http://127.0.0.1:8000/v1)",
                         param="url")
    fmt = format or preset.formats[0]
    if fmt not in preset.formats:
        raise BadRequest(f"{where} speaks {', '.join(preset.formats)}, not {fmt!r}", param="format")
    model = model or preset.model
    if preset.needs_model and not model:
        raise BadRequest(f"{where} needs --upstream-model NAME (the model the server should run, e.g. "
                         "qwen2.5-coder)", param="upstream_model")
    if key_env is None:
        key_env = preset.key_env or (UNKEYED_DEFAULT_ENV if preset.url is None and env.get(UNKEYED_DEFAULT_ENV)
                                     else None)
    if key_env is not None:
        check_key_env(key_env, where)
    check_base_url(url, where, keyed=key_env is not None)
    return ModelEntry(name=name, engine="upstream", url=url, format=fmt, upstream_model=model or None,
                      api_key_env=key_env, join_text_parts=preset.join_text_parts)


def from_settings(values: Mapping[str, Any], env: Mapping[str, str]) -> ModelEntry | None:
    """The provider entry of the flags (``values``, by ``FLAG_KEYS``) over the environment (``ENV_VARS``): None when
    neither names a provider. ``--upstream-url`` alone is the older ``reef serve --upstream-url`` (the entry
    ``upstream``, key from ``REEF_UPSTREAM_API_KEY`` when set)."""
    got = {k: values.get(k) or env.get(ENV_VARS[k]) or None for k in FLAG_KEYS}
    if got["provider"] is None:
        if got["upstream_url"] is None:
            extra = [f"--{k.replace('_', '-')}" for k in FLAG_KEYS[2:] if got[k]]
            if extra:
                raise BadRequest(f"{', '.join(extra)} need{'s' if len(extra) == 1 else ''} --provider NAME or "
                                 "--upstream-url URL "
                                 f"(known providers: {known()})")
            return None
        got["provider"] = "openai-compatible"
        entry = provider_entry("openai-compatible", env, url=got["upstream_url"], model=got["upstream_model"],
                               format=got["upstream_format"], key_env=got["upstream_key_env"])
        return ModelEntry(**{**entry.__dict__, "name": "upstream"})
    return provider_entry(got["provider"], env, url=got["upstream_url"], model=got["upstream_model"],
                          format=got["upstream_format"], key_env=got["upstream_key_env"])


def require_provider_key(entry: ModelEntry | None, secrets: Mapping[str, str]) -> None:
    """At start: the provider's key variable must be set (one line naming it, never its value)."""
    if entry is None or entry.api_key_env is None or secrets.get(entry.api_key_env):
        return
    raise BadRequest(f"provider {entry.name}: {entry.api_key_env} is not set; export it in the environment that "
                     f"starts the daemon (Reef reads the key from it and never stores it)", param="api_key_env")


def shown_url(url: str) -> str:
    """A base URL for messages and status: no query string (it may carry a token); credentials are refused."""
    parts = urlsplit(url)
    return parts._replace(query="", fragment="").geturl()


def describe(entry: ModelEntry) -> str:
    """One line: where a provider entry's answers come from (the key's variable by name only)."""
    model = entry.upstream_model or "the client's model name"
    key = f"key from ${entry.api_key_env}" if entry.api_key_env else "no key"
    return f"{model} at {shown_url(entry.url or '')} ({entry.format}, {key})"


def shown(entry: ModelEntry) -> dict[str, Any]:
    """What ``/reef/status`` says of an upstream entry: the key's variable by name, never its value."""
    return {"url": shown_url(entry.url or ""), "format": entry.format, "model": entry.upstream_model,
            "api_key_env": entry.api_key_env}


def serves(status: Mapping[str, Any], entry: ModelEntry) -> bool:
    """Whether a running daemon (its ``/reef/status``) serves ``entry`` as its default model, as configured here."""
    model = (status.get("models") or {}).get(entry.name) or {}
    return status.get("default_model") == entry.name and model.get("upstream") == shown(entry)


def provider_env(flags: Mapping[str, str | None]) -> dict[str, str]:
    """The flags as the environment variables a daemon started in the background reads (``ENV_VARS``)."""
    return {ENV_VARS[key]: value for key, value in flags.items() if value}
