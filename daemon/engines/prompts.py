"""What a local engine (``transformers``, and the inference servers Reef tokenises for) makes of an exchange before
it samples: the prompt text its chat template renders, the sampling values it refuses, and how many new tokens the
answer may take (the output cap). No torch here: ``reef doctor`` and the wrapper's checks read it too.

Design choices:

- **The model sees what its template renders.** An agent's request is counted as the template renders it, never
  as its JSON: SmolLM2's template drops tool schemas, so Claude Code's first request (21,319 SmolLM2 tokens as JSON,
  17,753 of them its 24 tool schemas; measured with 2.1.197) is 3,041 tokens to it.
  ``chat_template.carries_tools`` says whether a template carries tools at all (a probe tool rendered, or not).
- **The output cap.** A slow engine asked for Claude Code's ``max_tokens`` of 32,000 decodes for the rest of its
  context (SmolLM2 at 6.6 tokens/s under load: 12 minutes with no word to the user). Every request gets at most
  ``output_cap`` new tokens: the model entry's ``max_tokens_limit`` when set, else, on a local engine, an eighth
  of the model's context within [256, 4096] (SmolLM2's 8,192: 1,024 tokens, 25 s alone at 41 tokens/s and about
  2.5 minutes at 6.6). An upstream provider has no cap unless set: it bounds its own answers. A client that asks
  for no limit (Codex) gets the model entry's ``max_new_tokens``, else the cap. Where the cap (or that default)
  and not the client's own ``max_tokens`` or the context ends the answer, the end is reported as a normal stop
  (``capped``): agents take a length stop below their own limit as an error (Codex exits 1 on ``incomplete``,
  reason ``max_output_tokens``); the answer's ``x-reef-output-cap`` header says the cap applied. The cap fits the
  model, not the machine's measured decode speed: that swings six-fold with the load (SmolLM2: 41 tokens/s alone, 6.6
  at load 8), and a cap that moved with it would cut the same request at different lengths while reporting it
  complete (docs/serving.md says why; ``max_tokens_limit`` sets a slow machine's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.errors import BadRequest

if TYPE_CHECKING:
    from daemon.engines.entry import ModelEntry
    from daemon.exchange import Exchange

CAP_CONTEXT_SHARE = 8  # the default output cap: an eighth of the model's context ...
CAP_MIN, CAP_MAX = 256, 4096  # ... within these bounds (tokens)


def output_cap(entry: ModelEntry, context_length: int | None) -> int | None:
    """The most new tokens any request to ``entry`` may take (None: no cap of Reef's)."""
    if entry.engine == "upstream":  # the provider bounds its own answers
        return None
    if entry.max_tokens_limit is not None:
        return entry.max_tokens_limit
    if not context_length:
        return None
    return min(CAP_MAX, max(CAP_MIN, context_length // CAP_CONTEXT_SHARE))


def budget(asked: int | None, default: int | None, cap: int | None, room: int) -> tuple[int, bool]:
    """New tokens for one answer, and whether Reef's bound (not the client's ``asked`` nor the ``room`` left in the
    context) is what ends it there: ``(max_tokens, capped)``. ``default``: the entry's ``max_new_tokens`` for a
    client that asks for no limit (None: the cap)."""
    want = asked or default or cap or room
    n = min(want, cap or want, room)
    return n, n < room and (asked is None or n < asked)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: tuple[str, ...] = ()
    # Reef's bound (the output cap, or the entry's default for a client that gave none), not the client's
    # max_tokens, ends the answer: that end is reported as a normal one (see the module's docstring)
    capped: bool = False


def sampling_params(s: Any, entry: ModelEntry, context_length: int, prompt_tokens: int) -> SamplingParams:
    """The sampling of a request whose prompt is ``prompt_tokens`` long (checked with ``check_sampling`` first)."""
    n, capped = budget(s.max_tokens, entry.max_new_tokens, output_cap(entry, context_length),
                       context_length - prompt_tokens)
    return SamplingParams(
        max_tokens=n,
        capped=capped,
        temperature=1.0 if s.temperature is None else s.temperature,
        top_p=1.0 if s.top_p is None else s.top_p,
        top_k=s.top_k or 0,
        stop=tuple(x for x in s.stop if x),
    )


def check_sampling(s: Any) -> None:
    """The sampling values every engine refuses (400 naming the field), whatever it serves with."""
    if s.max_tokens is not None and s.max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {s.max_tokens}", param="max_tokens")
    if s.temperature is not None and s.temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {s.temperature}", param="temperature")
    if s.top_p is not None and not 0 < s.top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {s.top_p}", param="top_p")
    if s.top_k is not None and s.top_k < 0:
        raise BadRequest(f"top_k must be >= 0, got {s.top_k}", param="top_k")


def render_chat(tokenizer: Any, exchange: Exchange) -> str:
    """The prompt text of an exchange: the tokenizer's chat template over its messages and tools (also used by the
    inference-server engines, which tokenise on Reef's side)."""
    from jinja2 import TemplateError

    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in exchange.tools
    ]
    try:
        return str(tokenizer.apply_chat_template(
            chat_messages(exchange), tools=tools or None, add_generation_prompt=True, tokenize=False
        ))
    except TemplateError as e:
        raise BadRequest(f"the model's chat template rejected the messages: {e}", param="messages") from None


_PROBE_TOOL = "reef_probe_tool_7f3a"


def _probe() -> Exchange:
    from daemon.exchange import Exchange, Message, Part, Tool

    return Exchange(format="openai-chat", model="", messages=[Message(role="user", parts=[Part(type="text", text="hi")])],
                    tools=[Tool(name=_PROBE_TOOL, description="probe", parameters={"type": "object"})])


def dir_renders_tools(path: Path | None) -> bool | None:
    """``chat_template.carries_tools`` for a model directory, without loading transformers (``reef doctor``): its chat template
    (``chat_template.jinja`` or ``tokenizer_config.json``) rendered over the probe with Jinja's sandbox, as
    transformers renders it; None when there is no template or it cannot be rendered here."""
    import json

    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if path is None:
        return None
    try:
        jinja = Path(path) / "chat_template.jinja"
        template = jinja.read_text() if jinja.exists() else json.loads(
            (Path(path) / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(template, str):
        return None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(TemplateError(message))
    tools = [{"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe",
                                               "parameters": {"type": "object"}}}]
    try:
        text = env.from_string(template).render(messages=chat_messages(_probe()), tools=tools,
                                                add_generation_prompt=True, bos_token="", eos_token="")
    except Exception:  # a template using what only transformers provides: unknown here
        return None
    return _PROBE_TOOL in text


def chat_messages(exchange: Exchange) -> list[dict[str, Any]]:
    """Neutral messages as chat-template dicts: tool results become ``tool`` messages, tool calls ``tool_calls``."""
    out: list[dict[str, Any]] = []
    for m in exchange.messages:
        text = "".join(p.text for p in m.parts if p.type == "text")
        calls = [
            {"id": p.id, "type": "function", "function": {"name": p.name, "arguments": p.arguments or "{}"}}
            for p in m.parts
            if p.type == "tool_call"
        ]
        results = [p for p in m.parts if p.type == "tool_result"]
        out += [{"role": "tool", "content": p.text, "tool_call_id": p.tool_call_id} for p in results]
        if text or calls or not results:
            out.append({"role": m.role, "content": text, **({"tool_calls": calls} if calls else {})})
    return out
