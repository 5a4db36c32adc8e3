"""SGLang as an inference-server engine: where its API differs from vLLM's (``daemon/engines/server.py`` does
the rest).

SGLang cannot be installed on the CPU machines this project is tested on (its wheels need CUDA and another
torch), so this dialect is written against SGLang's source (``python/sglang/srt/entrypoints/http_server.py``,
``python/sglang/srt/managers/io_struct.py``, ``tokenizer_manager.py``) and tested against answers recorded from
those shapes (``tests/fixtures/sglang/``); it runs for real only where a GPU is lent (``bench/gpu_server.py``).

- Started as ``python -m sglang.launch_server --model-path DIR --host 127.0.0.1 --port P --enable-lora
  --max-lora-rank R --max-loras-per-batch N --lora-target-modules all --weight-version V``.
- Generation: ``POST /generate`` (``GenerateReqInput``) with ``input_ids``, ``sampling_params``
  (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k`` with -1 for off, ``stop_token_ids``),
  ``return_logprob: true``, ``stream: true`` and ``lora_path`` naming a loaded adapter. Each SSE chunk holds
  ``output_ids`` and ``meta_info`` (``finish_reason`` ``{"type": "stop" | "length" | "abort", ...}`` or null,
  ``completion_tokens``, ``weight_version``, ``output_token_logprobs`` as ``[logprob, token_id, text]``); by
  default a stream's ``output_ids`` and log-probs are cumulative, with ``--incremental-streaming-output`` only
  the new ones: ``completion_tokens`` says which (cumulative lists are that long). The stream ends with
  ``data: [DONE]``.
- Full weights: ``POST /update_weights_from_disk {"model_path", "weight_version", "abort_all_requests":
  false}``; SGLang takes its model-update lock as a writer, so running requests finish first (Reef drains them
  itself too). It answers ``{"success", "message", "num_paused_requests"}``: ``success: false`` is a failure
  even with a 200.
- LoRA: ``POST /load_lora_adapter {"lora_name", "lora_path"}`` and ``/unload_lora_adapter {"lora_name"}``
  (``{"success", "error_message", "loaded_adapters"}``). SGLang reports only the base's ``weight_version``
  per response, not the adapter used: the adapter is checked by name when it is selected (an unknown
  ``lora_path`` is refused by the server).
- Version: ``GET /get_server_info`` (``version``); weight version set with ``/update_weight_version``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from daemon.engines.dialect import Dialect, Params, Step
from daemon.engines.entry import ModelEntry
from daemon.errors import EngineError


class SGLang(Dialect):
    name = "sglang"
    generate_path = "/generate"
    health_path = "/health"
    version_path = "/get_server_info"

    def command(self, entry: ModelEntry, model_path: Path, port: int) -> tuple[list[str], dict[str, str]]:
        python = entry.server or "python3"
        argv = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", entry.name, "--enable-lora",
                "--max-lora-rank", str(entry.max_lora_rank), "--max-loras-per-batch", str(entry.max_loras),
                "--lora-target-modules", "all", "--skip-server-warmup"]
        if entry.max_model_len:
            argv += ["--context-length", str(entry.max_model_len)]
        argv += list(entry.server_args)
        return argv, {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def generate_body(self, prompt: list[int], params: Params, adapter: str | None) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k or -1, "stop_token_ids": list(params.stop_token_ids), "skip_special_tokens": False,
        }
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
        body: dict[str, Any] = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True,
                                "stream": True}
        if adapter is not None:
            body["lora_path"] = adapter
        return body

    def parser(self) -> _Parser:
        return _Parser()

    def load_adapter(self, name: str, path: Path) -> tuple[str, dict[str, Any]]:
        return "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}

    def unload_adapter(self, name: str) -> tuple[str, dict[str, Any]]:
        return "/unload_lora_adapter", {"lora_name": name}

    def update_weights(self, path: Path, version: str) -> list[tuple[str, dict[str, Any]]]:
        return [("/update_weights_from_disk",
                 {"model_path": str(path), "weight_version": version, "abort_all_requests": False})]

    def set_version(self, version: str) -> tuple[str, dict[str, Any]] | None:
        return "/update_weight_version", {"new_version": version, "abort_all_requests": False}

    def parse_version(self, body: Any) -> str | None:
        return str(body["version"]) if isinstance(body, dict) and body.get("version") else None

    def check_update(self, path: str, body: Any) -> None:
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineError(f"sglang {path} failed: {body.get('message') or body.get('error_message') or body}")


class _Parser:
    """Reads ``/generate`` stream chunks, cumulative or incremental."""

    def __init__(self) -> None:
        self.seen = 0

    def feed(self, obj: Any) -> Step:
        if "error" in obj and "meta_info" not in obj:
            err = obj["error"]
            return Step(error=err.get("message", str(err)) if isinstance(err, dict) else str(err))
        meta = obj["meta_info"]
        ids = [int(t) for t in obj.get("output_ids") or []]
        lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
        total = meta.get("completion_tokens")
        if isinstance(total, int) and len(ids) == total and total >= self.seen:  # cumulative: the new tail
            new = ids[self.seen:]
            lps = lps[self.seen:] if len(lps) == total else lps[-len(new):] if new else []
        else:
            new = ids
            lps = lps[-len(new):] if new else []
        if lps and len(lps) != len(new):
            raise ValueError(f"{len(new)} new token ids but {len(lps)} log-probs")
        self.seen += len(new)
        finish = meta.get("finish_reason")
        reason = None
        if isinstance(finish, dict):
            reason = str(finish.get("type"))
            if reason == "abort":
                return Step(new, lps, reason, None, error=str(finish.get("message") or "the request was aborted"))
        elif isinstance(finish, str):
            reason = finish
        version = meta.get("weight_version")
        return Step(new, lps, reason, [str(version)] if version is not None else None)
