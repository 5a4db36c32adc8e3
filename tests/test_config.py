"""The config's model entries: a key the entry's engine does not read is refused at load (naming the key and the
engines that take it), never accepted and ignored; and what ``./install.sh --vllm`` tells the user to write is
an entry this config accepts and the vLLM engine starts with."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from daemon.config import ENGINE_KEYS, ENGINES, ModelEntry, load_config
from daemon.errors import BadRequest

ROOT = Path(__file__).resolve().parent.parent
VALUES = {"path": '"m"', "device": '"cpu"', "threads": "2", "max_batch": "4", "memory_budget_mb": "64",
          "prefix_cache_mb": "0", "url": '"http://127.0.0.1:9"', "format": '"anthropic"', "upstream_model": '"x"',
          "api_key_env": '"X_API_KEY"', "join_text_parts": "false", "timeout_s": "5", "connect_timeout_s": "1", "server": '"/usr/bin/python3"',
          "server_port": "9999", "server_args": '["--x"]', "server_log": '"/tmp/x.log"', "startup_timeout_s": "9",
          "retry_after_s": "2", "max_model_len": "512", "max_lora_rank": "8", "max_loras": "2",
          "weight_update": '"restart"', "kv_cache_gb": "2", "enforce_eager": "false",
          "fast_path": "false", "pack_int4": "false"}


def _load(tmp_path: Path, entry: str) -> ModelEntry:
    (tmp_path / "config.toml").write_text('default_model = "tiny"\n\n[models.m]\n' + entry)
    return load_config({"REEF_HOME": str(tmp_path)}).models["m"]


@pytest.mark.parametrize("engine,key", [
    ("transformers", "kv_cache_gb"), ("transformers", "max_loras"), ("transformers", "weight_update"),
    ("transformers", "server_args"), ("upstream", "max_batch"), ("upstream", "prefix_cache_mb"),
    ("upstream", "threads"), ("sglang", "kv_cache_gb"), ("sglang", "max_batch"), ("vllm", "format"),
])
def test_a_key_the_engine_does_not_read_is_refused_naming_who_takes_it(tmp_path: Path, engine: str,
                                                                      key: str) -> None:
    url = 'url = "http://127.0.0.1:9"\n' if engine == "upstream" else ""
    with pytest.raises(BadRequest) as e:
        _load(tmp_path, f'engine = "{engine}"\n{url}{key} = {VALUES[key]}\n')
    message = e.value.message
    assert f"models.m.{key}" in message and repr(engine) in message, message
    assert all(taker in message for taker in ENGINE_KEYS[key]), message


def test_every_engine_takes_the_keys_it_reads(tmp_path: Path) -> None:
    """The table of who takes what covers every entry key but the shared ones, and each engine loads with
    every key the table gives it (so the refusal above cannot refuse a key an engine reads)."""
    shared = {"name", "engine", "max_new_tokens", "max_tokens_limit"}
    assert set(ENGINE_KEYS) | shared == set(ModelEntry.__dataclass_fields__)
    for engine in ENGINES:
        keys = [k for k, takers in ENGINE_KEYS.items() if engine in takers]
        entry = _load(tmp_path, f'engine = "{engine}"\n' + "".join(f"{k} = {VALUES[k]}\n" for k in keys)
                      + "max_new_tokens = 7\n")
        assert entry.engine == engine and entry.max_new_tokens == 7
        for k in keys:
            assert getattr(entry, k) != ModelEntry.__dataclass_fields__[k].default, (engine, k)


def test_an_unknown_engine_is_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(BadRequest, match="models.m.engine must be one of transformers, upstream, vllm, sglang"):
        _load(tmp_path, 'engine = "llamacpp"\n')


def test_what_install_vllm_says_to_write_is_an_entry_the_config_takes(tmp_path: Path) -> None:
    """``./install.sh --vllm`` ends with a config entry to add (its ``vllm_entry``): loaded as Reef's config, it is
    a vllm entry whose ``server`` is the venv's interpreter, and the vLLM engine starts that interpreter."""
    from daemon.engines.vllm import VLLM

    script = (ROOT / "install.sh").read_text()
    assert "REEF_VLLM" not in script and "bin/vllm" not in script  # neither exists
    advice = re.search(r"^  vllm_entry \"\$VLLM_VENV\"", script, re.M)
    assert advice is not None, "install.sh --vllm no longer prints the entry"
    define = re.search(r"^vllm_entry\(\) \{.*\}$", script, re.M)
    assert define is not None
    venv = tmp_path / "venv-vllm"
    snippet = subprocess.run(["bash", "-c", f'{define.group(0)}\nvllm_entry "$1"', "-", str(venv)],
                             capture_output=True, text=True, check=True).stdout
    (tmp_path / "config.toml").write_text('default_model = "tiny"\n\n' + snippet)
    entry = next(e for e in load_config({"REEF_HOME": str(tmp_path)}).models.values() if e.engine == "vllm")
    assert entry.server == f"{venv}/bin/python"
    argv, _ = VLLM().command(entry, Path("/m"), 8000)
    assert argv[0] == entry.server and "vllm.entrypoints.openai.api_server" in argv
