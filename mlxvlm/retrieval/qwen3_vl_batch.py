"""What Qwen3-VL-Embedding and Qwen3-VL-Reranker share: conversations rendered by the
checkpoint's chat template, images sized as their official scripts size them, and one
forward pass over a padded batch that returns each conversation's last-token hidden
state (the final norm's output, before the head).

Both models are plain ``qwen3_vl`` checkpoints; only the prompt and what is read at the
last token differ (``qwen3_vl_embedding.py``, ``qwen3_vl_reranker.py``).

The batch is padded on the right. Attention is causal, so a row's real tokens never see
its padding and each last real token's state is the one a pass over that conversation
alone gives (transformers pads the embedder on the right and the reranker on the left;
either way the pooled token sees only its own conversation). Each row keeps its own
M-RoPE positions and DeepStack rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from mlxvlm.errors import MlxvlmError, PromptTooLongError
from mlxvlm.prompt_length import check_prompt_length
from mlxvlm.text.tokenization import chat_template_owner, tokenizer_of

# The official scripts (scripts/qwen3_vl_embedding.py, qwen3_vl_reranker.py in the
# model repos) size every image through qwen_vl_utils: a multiple of 32 pixels (16-pixel
# patches merged 2 x 2) between 4 and 1800 merged tokens, whatever the checkpoint's
# preprocessor_config.json says, and then run the processor with do_resize=False.
IMAGE_FACTOR = 32
MIN_PIXELS = 4 * IMAGE_FACTOR * IMAGE_FACTOR
MAX_PIXELS = 1800 * IMAGE_FACTOR * IMAGE_FACTOR


def fit_image(image, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
    """``image`` (PIL, RGB) resized as qwen_vl_utils' ``fetch_image`` does: the size
    transformers' ``smart_resize`` picks, by PIL's bicubic resampling."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    height, width = smart_resize(image.height, image.width, factor=IMAGE_FACTOR,
                                 min_pixels=min_pixels, max_pixels=max_pixels)
    return image.resize((width, height), Image.Resampling.BICUBIC)


@dataclass
class Conversation:
    """One model input: chat messages whose image parts are ``{"type": "image"}`` (in
    prompt order) and the PIL images for them."""

    messages: list[dict]
    images: list


@dataclass
class Prepared:
    input_ids: np.ndarray  # (L,)
    features: dict[str, mx.array]


def prepare(processor: Any, conversation: Conversation, feature_names: Sequence[str],
            context: int | None = None) -> Prepared:
    """The conversation through the chat template (with the generation prompt) and the
    processor with its default special tokens, its images sized by ``fit_image``: as
    both scripts prepare their inputs. Longer than ``context`` (the model's) is a
    ``PromptTooLongError``, the text found too long before it is tokenized."""
    template_owner = chat_template_owner(processor)
    if template_owner is None:
        raise MlxvlmError("this checkpoint has no chat template (chat_template.jinja or in "
                          "tokenizer_config.json), which its prompts are written with")
    text = template_owner.apply_chat_template(conversation.messages, tokenize=False,
                                              add_generation_prompt=True)
    check_prompt_length(tokenizer_of(processor), text, context)
    images = [fit_image(image) for image in conversation.images]
    outputs = processor(text=[text], images=images or None, do_resize=False,
                        return_tensors="np")
    ids = np.asarray(outputs["input_ids"]).reshape(-1)
    if context is not None and len(ids) > context:
        raise PromptTooLongError.of_tokens(len(ids), context)
    features = {name: mx.array(np.asarray(value)) for name, value in outputs.items()
                if name in feature_names and value is not None}
    return Prepared(ids, features)


@dataclass
class PaddedDeepstack:
    """DeepStack rows of a padded batch: each vision token's (row, column) and its rows
    per tapped layer (``DeepstackFeatures``' batched twin, read by the M-RoPE decoder)."""

    rows: np.ndarray  # (V,)
    columns: np.ndarray  # (V,)
    layers: list[mx.array]  # each (V, hidden)

    def window(self, offset: int, n: int):
        keep = (self.columns >= offset) & (self.columns < offset + n)
        if not keep.any():
            return None
        index = np.flatnonzero(keep)
        where = (mx.array(self.rows[index]), mx.array(self.columns[index] - offset))
        return where, [layer[mx.array(index)] for layer in self.layers]


@dataclass
class PaddedState:
    """The M-RoPE state of a padded batch: each row's prompt positions (B, 3, L)."""

    position_ids: mx.array
    deepstack: PaddedDeepstack | None = None

    def positions(self, offset: int, n: int) -> mx.array:
        return self.position_ids[:, :, offset : offset + n]


def last_token_states(model: Any, processor: Any,
                      conversations: Sequence[Conversation]) -> tuple[mx.array, list[int]]:
    """Each conversation's hidden state at its last token, float32 (B, hidden), from one
    decoder pass over the batch, and each conversation's token count."""
    prepared = [prepare(processor, c, model.feature_names, model.max_context)
                for c in conversations]
    lengths = [len(p.input_ids) for p in prepared]
    width = max(lengths)
    embeddings, positions, ids = [], [], []
    rows, columns, layers = [], [], []
    for row, p in enumerate(prepared):
        h, state = model.embed(mx.array(p.input_ids[None], dtype=mx.int32), **p.features)
        pad = width - h.shape[1]
        embeddings.append(mx.pad(h, [(0, 0), (0, pad), (0, 0)]))
        positions.append(mx.pad(state.position_ids, [(0, 0), (0, pad)]))
        ids.append(np.pad(p.input_ids, (0, pad)))
        if state.deepstack is not None:
            rows.append(np.full(len(state.deepstack.positions), row))
            columns.append(state.deepstack.positions)
            layers.append(state.deepstack.layers)
    deepstack = None
    if layers:
        deepstack = PaddedDeepstack(
            np.concatenate(rows), np.concatenate(columns),
            [mx.concatenate(per_layer) for per_layer in zip(*layers)])
    state = PaddedState(mx.stack(positions), deepstack)
    hidden = model.language_model.model(
        mx.array(np.stack(ids), dtype=mx.int32), None, mx.concatenate(embeddings), state)
    last = hidden[mx.arange(len(prepared)), mx.array(lengths) - 1]
    return last.astype(mx.float32), lengths
