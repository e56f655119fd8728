"""ColQwen2 and ColPali (the ColVision models): multi-vector retrieval uses.

A text is a query and an image a document page, each prompted exactly as transformers'
``ColQwen2Processor`` / ``ColPaliProcessor`` prompt them (the prefixes their
``processor_config.json`` names, else the processors' defaults; ten pad tokens of
"query augmentation" after a query). Neither processor takes a text and an image
together, so neither does this use. A batch may mix texts and images: each row is
tokenized alone, right-padded, and read back up to its own length (the family's
``retrieval_vectors`` keeps rows from seeing each other's padding).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Sequence

import mlx.core as mx
import numpy as np

from mlxvlm.errors import PromptTooLongError
from mlxvlm.retrieval.use import Encoded, RetrievalInput, RetrievalUse

# How many pad tokens follow a query (the processors' default suffix).
QUERY_AUGMENTATION = 10


def processor_prefixes(model_path: Path) -> dict:
    """The prompt prefixes the checkpoint's processor_config.json sets (empty: defaults)."""
    path = Path(model_path) / "processor_config.json"
    if not path.exists():
        return {}
    config = json.loads(path.read_text())
    return {key: config[key] for key in ("visual_prompt_prefix", "query_prefix")
            if config.get(key)}


class ColVisionUse(RetrievalUse):
    """Rows of token ids (and the batch's image features) -> the family's
    ``retrieval_vectors``, each row's vectors up to its length."""

    kind = "multi_vector"
    takes_text_with_image = False
    default_visual_prompt_prefix: ClassVar[str]
    default_query_prefix: ClassVar[str]

    def __init__(self, visual_prompt_prefix: str | None = None,
                 query_prefix: str | None = None):
        self.visual_prompt_prefix = visual_prompt_prefix or self.default_visual_prompt_prefix
        self.query_prefix = query_prefix or self.default_query_prefix

    def query_ids(self, processor: Any, text: str) -> np.ndarray:
        raise NotImplementedError

    def page(self, processor: Any, image) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A page's token ids and its image features (arrays to join along axis 0)."""
        raise NotImplementedError

    def rows(self, processor: Any, items: Sequence[RetrievalInput]):
        ids, features = [], {}
        for item in items:
            if item.image is None:
                ids.append(self.query_ids(processor, item.text))
                continue
            row, image = self.page(processor, item.image)
            ids.append(row)
            for name, value in image.items():
                features.setdefault(name, []).append(value)
        return ids, {name: np.concatenate(values) for name, values in features.items()}

    def embed(self, model, processor, items, instruction=None) -> Encoded:
        ids, features = self.rows(processor, items)
        lengths = [len(row) for row in ids]
        context = model.max_context
        if context is not None and max(lengths) > context:
            raise PromptTooLongError.of_tokens(max(lengths), context)
        vectors = model.retrieval_vectors(
            right_padded(ids, processor.tokenizer), mx.array(lengths),
            **{name: mx.array(value) if name == "pixel_values" else value
               for name, value in features.items()})
        vectors = np.array(vectors.astype(mx.float32))
        return Encoded([vectors[i, :n] for i, n in enumerate(lengths)], lengths)


class ColQwen2Use(ColVisionUse):
    default_visual_prompt_prefix = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image."
        "<|im_end|><|endoftext|>"
    )
    default_query_prefix = "Query: "

    def query_ids(self, processor, text):
        tokenizer = processor.tokenizer
        augmentation = tokenizer.pad_token * QUERY_AUGMENTATION
        return np.asarray(tokenizer(f"{self.query_prefix}{text}{augmentation}\n")["input_ids"])

    def page(self, processor, image):
        # Qwen2-VL's processor expands the prefix's one <|image_pad|> to the image's tokens.
        features = processor(text=[self.visual_prompt_prefix], images=[image],
                             return_tensors="np")
        return features["input_ids"][0], {"pixel_values": features["pixel_values"],
                                          "image_grid_thw": features["image_grid_thw"]}


class ColPaliUse(ColVisionUse):
    default_visual_prompt_prefix = "Describe the image."
    default_query_prefix = "Question: "

    def text_ids(self, processor, text: str) -> np.ndarray:
        # ColPaliProcessor turns the tokenizer's BOS off and writes it in the text.
        return np.asarray(processor.tokenizer(text, add_special_tokens=False)["input_ids"])

    def query_ids(self, processor, text):
        tokenizer = processor.tokenizer
        augmentation = tokenizer.pad_token * QUERY_AUGMENTATION
        return self.text_ids(
            processor, f"{tokenizer.bos_token}{self.query_prefix}{text}{augmentation}\n")

    def page(self, processor, image):
        tokenizer = processor.tokenizer
        images = processor.image_processor.image_seq_length * processor.image_token
        ids = self.text_ids(
            processor, f"{images}{tokenizer.bos_token}{self.visual_prompt_prefix}\n")
        pixels = processor.image_processor(images=[image], return_tensors="np")["pixel_values"]
        return ids, {"pixel_values": pixels}


def right_padded(rows: list[np.ndarray], tokenizer: Any) -> mx.array:
    """One (B, L) batch: each row's ids followed by the pad id (any id would do: a row's
    vectors are read up to its own length)."""
    length = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id or 0
    batch = np.full((len(rows), length), pad, dtype=np.int32)
    for i, row in enumerate(rows):
        batch[i, :len(row)] = row
    return mx.array(batch)


USES = {"colqwen2": ColQwen2Use, "colpali": ColPaliUse}


def detect(config: dict, model_path: Path) -> RetrievalUse | None:
    """The use of a ColQwen2 or ColPali checkpoint (model_type ``colqwen2``, ``colpali``)."""
    use = USES.get(config.get("model_type"))
    return None if use is None else use(**processor_prefixes(model_path))
