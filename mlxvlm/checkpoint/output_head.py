"""An untied output head that a checkpoint does not ship.

Qwen/Qwen3-VL-Embedding-8B's config.json says ``tie_word_embeddings: false`` yet its
weights hold no ``lm_head.weight`` (QwenLM/Qwen3-VL-Embedding#89): an embedding model
reads hidden states and never calls the head. ``build_model`` asks ``absent_head``
whether the family built a head (``language_model.lm_head``, every family's name for it
after ``sanitize``) that the weights lack; where the checkpoint's use does not need one
it puts a ``MissingOutputHead`` in its place; elsewhere the loader's check of missing
weights refuses the checkpoint.
"""

from __future__ import annotations

from typing import Iterable

import mlx.nn as nn

from mlxvlm.errors import MlxvlmError

HEAD_PREFIX = "language_model.lm_head."


class MissingOutputHead(nn.Module):
    """Stands where the absent head would be: no parameters, and a clear error for a
    caller that asks it for logits (``generate`` on an embedding-only checkpoint)."""

    def __call__(self, hidden):
        raise MlxvlmError("this checkpoint has no output head (lm_head.weight): it embeds, "
                          "it does not generate")


def absent_head(model: nn.Module, weight_names: Iterable[str]) -> bool:
    """Whether ``model`` has an untied output head for which ``weight_names`` (after
    ``sanitize``) hold no weight."""
    language_model = getattr(model, "language_model", None)
    if not isinstance(language_model, nn.Module) or "lm_head" not in language_model:
        return False
    if isinstance(language_model["lm_head"], MissingOutputHead):
        return False
    return not any(name.startswith(HEAD_PREFIX) for name in weight_names)


def settle_absent_head(model: nn.Module, weight_names: Iterable[str], head_optional: bool,
                       model_path) -> None:
    """Put a ``MissingOutputHead`` where the weights lack the head and the checkpoint's
    use reads no logits (``head_optional``)."""
    # Only an embedder's checkpoint is looked at: families keep their heads under other
    # names too (Qwen3-Omni's thinker), and a head missing elsewhere is the weight
    # check's to report, as any missing weight is.
    if not head_optional or not absent_head(model, weight_names):
        return
    model.language_model.lm_head = MissingOutputHead()
