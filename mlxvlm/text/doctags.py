"""Answers in DocTags, Docling's page markup (what SmolDocling and Granite-Docling write:
``<doctag><title><loc_..>...</title><otsl>...</otsl></doctag>``), turned into Markdown,
HTML or Docling's JSON by docling-core, the library made for that format.

A model answers in DocTags when its tokenizer has ``<doctag>`` as one token. Its tags are
special tokens there, which a plain answer's text leaves out: a DocTags answer keeps them
(``doctags_token_ids``, the sampling options' ``kept_token_ids``).

docling-core is optional (``pip install 'mlxvlm[docs]'``); only a DocTags output needs it.
"""

from __future__ import annotations

import json
from typing import Any

from mlxvlm.errors import MlxvlmError
from mlxvlm.text.tokenization import tokenizer_of

# What an answer can be given as: the raw markup, or docling-core's exports of it.
OUTPUT_FORMATS = ("doctags", "markdown", "html", "json")
DOCTAG = "<doctag>"
INSTALL_HINT = "pip install 'mlxvlm[docs]' (docling-core)"


class DocTagsError(MlxvlmError):
    """A DocTags output asked of a model that does not answer in DocTags, or without
    docling-core."""


def token_ids(tokenizer: Any, tokens: list[str]) -> dict[str, int]:
    """The ids of those ``tokens`` that are one token of ``tokenizer`` (looked up one by
    one: a vocabulary of 100k entries is not copied per request)."""
    ids = tokenizer.convert_tokens_to_ids(tokens)
    return {token: i for token, i in zip(tokens, ids)
            if i is not None and tokenizer.convert_ids_to_tokens(i) == token}


def answers_in_doctags(processor: Any) -> bool:
    return bool(token_ids(tokenizer_of(processor), [DOCTAG]))


def check_answers_in_doctags(processor: Any, output_format: str, what: str) -> None:
    """Refuse ``output_format`` (``what``: how the entry point names the option) for a
    model whose tokenizer has no ``<doctag>`` token, and without docling-core (which
    knows DocTags' tags, and converts them)."""
    if output_format not in OUTPUT_FORMATS:
        raise DocTagsError(f"{what} {output_format!r} is not one of {', '.join(OUTPUT_FORMATS)}")
    if not answers_in_doctags(processor):
        raise DocTagsError(
            f"{what} {output_format} needs a model that answers in DocTags (SmolDocling, "
            f"Granite-Docling); this model's tokenizer has no {DOCTAG} token")
    docling_core()


def doctags_token_ids(processor: Any) -> frozenset[int]:
    """The ids of the tokenizer's DocTags tags (every tag docling-core knows, locations
    included), its end-of-sequence tokens left out."""
    from docling_core.types.doc.tokens import DocumentToken

    tokenizer = tokenizer_of(processor)
    ids = set(token_ids(tokenizer, DocumentToken.get_special_tokens()).values())
    ends = {tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id}
    return frozenset(ids - ends)


def docling_core():
    """docling-core's document types (``DoclingDocument``, ``DocTagsDocument``)."""
    try:
        import docling_core.types.doc as document
    except ImportError:
        raise DocTagsError(f"DocTags output needs docling-core: {INSTALL_HINT}") from None
    return document


def convert(doctags: str, output_format: str, image: Any = None, name: str = "page") -> str:
    """One page's DocTags as ``output_format`` (``doctags``: as it is). ``image``: the page
    (a PIL image), from which docling-core crops its pictures and reads its size."""
    if output_format == "doctags":
        return doctags
    document = docling_core()
    pages = document.DocTagsDocument.from_doctags_and_image_pairs(
        [doctags], None if image is None else [image])
    doc = document.DoclingDocument.load_from_doctags(pages, document_name=name)
    if output_format == "markdown":
        return doc.export_to_markdown()
    if output_format == "html":
        return doc.export_to_html()
    if output_format == "json":
        return json.dumps(doc.export_to_dict(), ensure_ascii=False)
    raise DocTagsError(f"unknown output format {output_format!r} (one of {', '.join(OUTPUT_FORMATS)})")
