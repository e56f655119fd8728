"""What a chat template does with what the server may give it, found by rendering it
(its text alone does not say: a template may name ``tools`` and never render them, or
drop a system turn without a word): whether it renders tool definitions, and whether a
system turn reaches the prompt. Each template is probed once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxvlm.prompt import render_chat

_PROBE_NAME = "mlxvlm_probe_function"
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_NAME, "description": "A function the server probes the template with.",
    "parameters": {"type": "object", "properties": {}, "required": []}}}
_PROBE_SYSTEM = "mlxvlm-probe-system-turn"
_USER = {"role": "user", "content": "Hello."}


@dataclass(frozen=True)
class TemplateTraits:
    renders_tools: bool  # the tools given to the template reach the prompt
    takes_system: bool  # a system turn reaches the prompt (no error, not dropped)


# By the template's text: the same template behaves alike whatever processor carries it.
_TRAITS: dict[str, TemplateTraits] = {}


def template_traits(processor: Any, template: str) -> TemplateTraits:
    """``processor``'s chat template (whose text is ``template``), probed once."""
    traits = _TRAITS.get(template)
    if traits is None:
        with_tools = _rendered(processor, [_USER], {"tools": [_PROBE_TOOL]})
        with_system = _rendered(processor, [{"role": "system", "content": _PROBE_SYSTEM},
                                            _USER])
        traits = _TRAITS[template] = TemplateTraits(
            renders_tools=_PROBE_NAME in with_tools,
            takes_system=_PROBE_SYSTEM in with_system)
    return traits


def _rendered(processor: Any, messages: list[dict], options: dict | None = None) -> str:
    """The template's text for ``messages``; "" where the template refuses them (any
    error a template raises means the same: it does not take this)."""
    try:
        return render_chat(processor, messages, options)
    except Exception:  # noqa: BLE001
        return ""
