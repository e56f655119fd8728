"""Float32 torch references for Qwen3-VL-Embedding and Qwen3-VL-Reranker, written from
their official scripts (``scripts/qwen3_vl_embedding.py``, ``scripts/qwen3_vl_reranker.py``
in the Hub repos) over transformers' Qwen3-VL: conversations as the scripts build them,
images sized as qwen_vl_utils sizes them, a padded batch through transformers'
processor (right padding for the embedder, left for the reranker), then

- embedding: ``Qwen3VLModel``'s last hidden state at each row's last attended token,
  L2-normalized;
- reranker: the last position's hidden state times ``lm_head[yes] - lm_head[no]``,
  through a sigmoid.

An input is ``{"text": str}``, ``{"image": PIL}`` or both.
"""

from __future__ import annotations

import math
import unicodedata

import numpy as np

from tiny.qwen import reference_processor

FACTOR, MIN_PIXELS, MAX_PIXELS = 32, 4 * 32 * 32, 1800 * 32 * 32
EMBEDDING_INSTRUCTION = "Represent the user's input."
RERANKER_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and '
                   'the Instruct provided. Note that the answer can only be "yes" or "no".')
RERANKER_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."


def qwen_vl_utils_size(height: int, width: int) -> tuple[int, int]:
    """qwen_vl_utils' smart_resize: multiples of 32, area within [MIN_PIXELS, MAX_PIXELS]."""
    h = max(FACTOR, round(height / FACTOR) * FACTOR)
    w = max(FACTOR, round(width / FACTOR) * FACTOR)
    if h * w > MAX_PIXELS:
        beta = math.sqrt(height * width / MAX_PIXELS)
        h, w = (math.floor(x / beta / FACTOR) * FACTOR for x in (height, width))
    elif h * w < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (height * width))
        h, w = (math.ceil(x * beta / FACTOR) * FACTOR for x in (height, width))
    return h, w


def _sized(image):
    height, width = qwen_vl_utils_size(image.height, image.width)
    return image.convert("RGB").resize((width, height))  # PIL's default: bicubic


def _content(item: dict) -> list[dict]:
    """The scripts' order: images, then text."""
    content = []
    if "image" in item:
        content.append({"type": "image", "image": item["image"]})
    if "text" in item:
        content.append({"type": "text", "text": item["text"]})
    return content


def _images(conversations) -> list:
    return [_sized(part["image"]) for conversation in conversations for message in conversation
            if isinstance(message["content"], list)
            for part in message["content"] if part["type"] == "image"]


def _inputs(tiny, conversations, padding_side: str):
    processor = reference_processor(tiny)
    processor.tokenizer.padding_side = padding_side
    texts = [processor.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
             for c in conversations]
    images = _images(conversations)
    return processor(text=texts, images=images or None, padding=True, do_resize=False,
                     return_tensors="pt")


def embedding_instruction(instruction: str | None) -> str:
    if instruction:
        instruction = instruction.strip()
        if instruction and not unicodedata.category(instruction[-1]).startswith("P"):
            instruction += "."
    return instruction or EMBEDDING_INSTRUCTION


def reference_embeddings(tiny, items: list[dict], instruction: str | None = None) -> np.ndarray:
    import torch
    import torch.nn.functional as F

    conversations = [[
        {"role": "system", "content": [{"type": "text", "text": embedding_instruction(instruction)}]},
        {"role": "user", "content": _content(item)},
    ] for item in items]
    inputs = _inputs(tiny, conversations, "right")
    with torch.no_grad():
        hidden = tiny.model.model(**inputs).last_hidden_state
    mask = inputs["attention_mask"]
    last = mask.shape[1] - 1 - mask.flip(dims=[1]).argmax(dim=1)
    pooled = hidden[torch.arange(hidden.shape[0]), last]
    return F.normalize(pooled, p=2, dim=-1).numpy()


def reference_scores(tiny, query: dict, documents: list[dict],
                     instruction: str | None = None) -> np.ndarray:
    import torch

    conversations = [[
        {"role": "system", "content": [{"type": "text", "text": RERANKER_SYSTEM}]},
        {"role": "user", "content": [
            {"type": "text", "text": "<Instruct>: " + (instruction or RERANKER_INSTRUCTION)},
            {"type": "text", "text": "<Query>:"}, *_content(query),
            {"type": "text", "text": "\n<Document>:"}, *_content(document),
        ]},
    ] for document in documents]
    inputs = _inputs(tiny, conversations, "left")
    vocabulary = tiny.tokenizer.get_vocab()
    head = tiny.model.lm_head.weight
    direction = head[vocabulary["yes"]] - head[vocabulary["no"]]
    with torch.no_grad():
        last = tiny.model.model(**inputs).last_hidden_state[:, -1]
        return torch.sigmoid(last @ direction).numpy()
