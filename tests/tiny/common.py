"""Pieces every tiny-checkpoint builder shares (see tests/tiny/__init__.py).

Tiny random models can lie: with transformers' default ``initializer_range`` (0.02) their
output ignores both image and prompt. So builders use a large range and move biases and
norm weights off their constant init.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

INIT_RANGE = 0.2

# Text the BPE merges are learned from (any English prose would do).
_CORPUS = [
    "You are a helpful assistant.",
    "Describe this image in detail. What is in the picture?",
    "A red cat sits on a blue mat next to a green plant and a yellow lamp.",
    "Compare the two images and tell me what changed between them.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Here is a photo of my garden. What flowers are these, and when do they bloom?",
    "Sure! The image shows a small house with a garden, trees and a road.",
]


def build_bpe_tokenizer(
    special_tokens, *, chat_template, eos_token, pad_token, bos_token=None, vocab_size=360,
    extra_special_tokens=None,
):
    """A byte-level BPE tokenizer trained on a few sentences, with the family's special
    tokens and chat template, as a transformers tokenizer. ``extra_special_tokens``
    (name -> token) become attributes such as ``tokenizer.audio_token``, as processors
    of omni models expect."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special_tokens]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=pad_token,
        errors="replace",
        **({"extra_special_tokens": extra_special_tokens} if extra_special_tokens else {}),
    )
    wrapped.chat_template = chat_template
    return wrapped


@dataclass
class TinyModel:
    """A reference model and the pieces saved with it."""

    family: str
    model: object  # transformers *ForConditionalGeneration, float32, eval mode
    tokenizer: object
    image_processor: object


def perturb_constants(model, generator) -> None:
    """Move biases and norm weights off their constant init (0 and 1)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = "norm" in name or "ln_q" in name
            if name.endswith(".bias") and not is_norm:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
            elif is_norm:  # weights (and LayerNorm biases)
                param.add_(0.3 * torch.randn(param.shape, generator=generator))


def write_safetensors(weights: dict[str, np.ndarray], directory: Path) -> None:
    from safetensors.numpy import save_file

    for old in directory.glob("*.safetensors"):
        old.unlink()
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth random colour field plus noise: distinct per seed, stable per seed."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width] / max(width, height)
    channels = []
    for _ in range(3):
        fx, fy, phase = rng.uniform(1, 6), rng.uniform(1, 6), rng.uniform(0, 2 * np.pi)
        channels.append(np.sin(2 * np.pi * (fx * xs + fy * ys) + phase))
    field = np.stack(channels, axis=-1) * 0.4 + 0.5 + rng.normal(0, 0.08, (height, width, 3))
    return Image.fromarray((np.clip(field, 0, 1) * 255).astype(np.uint8))


def one_tensor_per_expert(weights: dict) -> dict:
    """transformers 5's fused ``mlp.experts.gate_up_proj`` (experts, 2 * width, hidden) and
    ``down_proj`` as the Hub's one ``mlp.experts.E.{gate,up,down}_proj.weight`` each
    (the Hub's MoE checkpoints, written by transformers 4.5x); other tensors as they are."""
    out = {}
    for name, value in weights.items():
        prefix, _, kind = name.rpartition(".mlp.experts.")
        if not prefix or kind not in ("gate_up_proj", "down_proj"):
            out[name] = value
            continue
        for expert, matrix in enumerate(value):
            if kind == "gate_up_proj":
                gate, up = np.split(matrix, 2, axis=0)
                out[f"{prefix}.mlp.experts.{expert}.gate_proj.weight"] = np.ascontiguousarray(gate)
                out[f"{prefix}.mlp.experts.{expert}.up_proj.weight"] = np.ascontiguousarray(up)
            else:
                out[f"{prefix}.mlp.experts.{expert}.down_proj.weight"] = np.ascontiguousarray(matrix)
    return out
