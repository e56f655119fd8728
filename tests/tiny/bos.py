"""BOS variants of the tiny checkpoints: the same model with a tokenizer whose
post-processor adds special tokens, as real Hub tokenizers do.

Llama's, Mistral's and Gemma's ``tokenizer.json`` carry a ``TemplateProcessing``
post-processor that prepends BOS (``<s> $A``); the fixtures' own tokenizers add nothing.
A variant is a copy of a family's ``"transformers"`` checkpoint with such a
post-processor written into ``tokenizer.json`` (nothing in ``tokenizer_config.json``
asks for it, so transformers keeps it as it loads) and the chat template with or without
a leading ``{{ bos_token }}``:

``"tokenizer_bos"``
    The tokenizer prepends BOS and the template writes none (LLaVA 1.5 with a Llama
    tokenizer, LLaVA-NeXT's ``[INST]`` template with Mistral's).
``"template_bos"``
    The tokenizer prepends BOS and the template starts with it: ``{{ bos_token }}``
    (Gemma 3, Mistral 3), or the token as text where the family's template starts so
    (SmolVLM's ``<|im_start|>``, its BOS token).
``"tokenizer_bos_eos"``, ``"template_bos_eos"``
    As those, with a tokenizer that also appends EOS.
``"unnamed_bos"``
    The tokenizer prepends the BOS token but does not name it (``bos_token`` null), and
    the template starts with that token as text.

The BOS token is the family's own, or ``<|endoftext|>`` where it has none (Qwen) or,
but for ``"template_bos"``, where its template starts with it as text (SmolVLM's).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

KINDS = ("tokenizer_bos", "template_bos", "tokenizer_bos_eos", "template_bos_eos", "unnamed_bos")
TEMPLATE_BOS = "{{ bos_token }}"
FALLBACK_BOS = "<|endoftext|>"


@dataclass(frozen=True)
class BosVariant:
    """What a variant's tokenizer adds and what its template starts with."""

    kind: str
    bos_token: str | None  # the tokenizer's bos_token (None: it names none)
    prepended: str  # the token its post-processor puts before the text
    appended: str | None  # the token it puts after (EOS), if any
    chat_template: str


def chat_template(directory: Path) -> str:
    """The checkpoint's chat template, or the one mlxvlm gives a checkpoint without one
    (PaliGemma)."""
    jinja = directory / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    from mlxvlm.models import paligemma

    return paligemma.CHAT_TEMPLATE


def plan(directory: Path, kind: str) -> BosVariant:
    """The variant ``kind`` of the checkpoint in ``directory``."""
    if kind not in KINDS:
        raise ValueError(f"unknown BOS variant {kind!r} (choose from {KINDS})")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    template = chat_template(directory)
    if template.startswith(TEMPLATE_BOS):
        template = template[len(TEMPLATE_BOS):]
    bos = config.get("bos_token")
    appended = config["eos_token"] if kind.endswith("_eos") else None
    if kind.startswith("template_bos") and bos is not None and template.startswith(bos):
        return BosVariant(kind, bos, bos, appended, template)  # written as text
    if bos is None or template.startswith(bos):
        bos = FALLBACK_BOS
    if kind == "unnamed_bos":
        return BosVariant(kind, None, bos, None, bos + template)
    if kind.startswith("template_bos"):
        template = TEMPLATE_BOS + template
    return BosVariant(kind, bos, bos, appended, template)


def save_variant(source: Path, target: Path, kind: str) -> Path:
    """A copy of the checkpoint ``source`` with the tokenizer and template of ``kind``."""
    from tokenizers import Tokenizer, processors

    variant = plan(source, kind)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    added = [(t, tokenizer.token_to_id(t)) for t in (variant.prepended, variant.appended) if t]
    assert all(i is not None for _, i in added), f"{added} not all in the vocabulary"
    single = f"{variant.prepended}:0 $A:0" + (f" {variant.appended}:0" if variant.appended else "")
    pair = single + f" {variant.prepended}:1 $B:1" + (f" {variant.appended}:1" if variant.appended else "")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=added
    )
    tokenizer.save(str(target / "tokenizer.json"))
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["bos_token"] = variant.bos_token
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config, indent=2))
    (target / "chat_template.jinja").write_text(variant.chat_template)
    return target
