"""ColQwen2 and ColPali (the ColVision models): multi-vector retrieval uses.

A text is a query and an image a document page, each prompted exactly as transformers'
``ColQwen2Processor`` / ``ColPaliProcessor`` prompt them (the prefixes their
``processor_config.json`` names, else the processors' defaults; ten pad tokens of
"query augmentation" after a query). Neither processor takes a text and an image
together, so neither does this use. A batch may mix texts and images: each row is
tokenized alone, right-padded, and trimmed back to its own tokens (the family's pass is
causal, or bidirectional within a row only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from mlxvlm.retrieval.use import Encoded, RetrievalInput, RetrievalUse

COLQWEN2_VISUAL_PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image."
    "<|im_end|><|endoftext|>"
)
COLQWEN2_QUERY_PREFIX = "Query: "
# How many pad tokens follow a query (transformers' default suffix).
QUERY_AUGMENTATION = 10


def processor_prefixes(model_path: Path) -> dict:
    """The prompt prefixes the checkpoint's processor_config.json sets (empty: defaults)."""
    path = Path(model_path) / "processor_config.json"
    if not path.exists():
        return {}
    config = json.loads(path.read_text())
    return {key: config[key] for key in ("visual_prompt_prefix", "query_prefix")
            if config.get(key)}


class ColQwen2Use(RetrievalUse):
    kind = "multi_vector"
    takes_text_with_image = False

    def __init__(self, visual_prompt_prefix: str = COLQWEN2_VISUAL_PROMPT,
                 query_prefix: str = COLQWEN2_QUERY_PREFIX):
        self.visual_prompt_prefix = visual_prompt_prefix
        self.query_prefix = query_prefix

    def query_text(self, text: str, tokenizer: Any) -> str:
        return f"{self.query_prefix}{text}{tokenizer.pad_token * QUERY_AUGMENTATION}\n"

    def rows(self, processor: Any, items: Sequence[RetrievalInput]):
        """Each item's token ids, and the batch's image features in row order."""
        tokenizer = processor.tokenizer
        ids, pixels, grids = [], [], []
        for item in items:
            if item.image is None:
                ids.append(np.asarray(tokenizer(self.query_text(item.text, tokenizer))["input_ids"]))
                continue
            features = processor(text=[self.visual_prompt_prefix], images=[item.image],
                                 return_tensors="np")
            ids.append(features["input_ids"][0])
            pixels.append(features["pixel_values"])
            grids.append(features["image_grid_thw"])
        vision = {}
        if pixels:
            vision = {"pixel_values": mx.array(np.concatenate(pixels)),
                      "image_grid_thw": np.concatenate(grids)}
        return ids, vision

    def embed(self, model, processor, items, instruction=None) -> Encoded:
        ids, vision = self.rows(processor, items)
        vectors = model.retrieval_vectors(right_padded(ids, processor.tokenizer), **vision)
        vectors = np.array(vectors.astype(mx.float32))
        return Encoded([vectors[i, :len(row)] for i, row in enumerate(ids)],
                       [len(row) for row in ids])


def right_padded(rows: list[np.ndarray], tokenizer: Any) -> mx.array:
    """One (B, L) batch: each row's ids followed by the pad id (any id would do: a row's
    vectors are read up to its own length)."""
    length = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id or 0
    batch = np.full((len(rows), length), pad, dtype=np.int32)
    for i, row in enumerate(rows):
        batch[i, :len(row)] = row
    return mx.array(batch)


def detect(config: dict, model_path: Path) -> RetrievalUse | None:
    """The use of a ColQwen2 checkpoint (model_type ``colqwen2``)."""
    if config.get("model_type") == "colqwen2":
        return ColQwen2Use(**processor_prefixes(model_path))
    return None
