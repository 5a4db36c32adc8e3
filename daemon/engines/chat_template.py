"""What a model's chat template does with an agent's tools: carry them into the prompt, or drop them.

A coding agent sends its tools (read, edit, run...) as JSON schemas beside the messages; an engine that renders the
prompt itself (the embedded one: ``render_chat``) hands them to the model's chat template, and a template written
without tools (SmolLM2-135M-Instruct's, for one) renders the same text with or without them. The agent then talks
but never acts, and nothing says why. ``carries_tools`` finds out once per load, by rendering one short
conversation with a probe tool whose name appears nowhere else: the template carries tools when that name reaches
the prompt. A template that refuses tools outright (raises) does not carry them either.

Engines put the answer in ``EngineInfo.carries_tools`` (None: the engine does not know, e.g. an upstream provider);
the serving path records how many tools an exchange's model never saw (``usage.tools_dropped``), and a wrapped run
says it once on the wrapper's stderr with the way out (``reef_cli/wrapper.py``).
"""

from __future__ import annotations

from typing import Any

PROBE = "reef_template_probe_tool"  # a name no template writes by itself
_PROBE_TOOL = {"type": "function", "function": {"name": PROBE, "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_MESSAGES = [{"role": "user", "content": "hi"}]


def carries_tools(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template puts tool definitions into the prompt (cached on the tokenizer)."""
    known = getattr(tokenizer, "_reef_carries_tools", None)
    if known is not None:
        return bool(known)
    try:
        with_tools = tokenizer.apply_chat_template(_MESSAGES, tools=[_PROBE_TOOL], add_generation_prompt=True,
                                                   tokenize=False)
        carried = isinstance(with_tools, str) and PROBE in with_tools
    except Exception:  # noqa: BLE001 - a template that raises on tools (jinja, or its own raise_exception) has none
        carried = False
    try:
        tokenizer._reef_carries_tools = carried
    except AttributeError:
        pass
    return carried
