"""The contract every model family implements.

A family module (``mlxvlm/models/<model_type>.py``) exposes a ``Model`` class derived from
``VisionLanguageModel``. The shared generate loop only ever talks to a model through the
methods below, so a family knows nothing about sampling, caches or streaming, and the loop
knows nothing about any one family.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlxvlm.models.feature_cache import FeatureCache


class VisionLanguageModel(nn.Module):
    """Base class of every family's ``Model``.

    Subclasses implement:

    ``from_config(config)``
        Build the module tree from the checkpoint's ``config.json`` (either the Hub's older
        layout or the one transformers 5's ``save_pretrained`` writes).
    ``sanitize(weights)``
        Map a Hugging Face checkpoint's tensor names and layouts onto this module's. It is
        called only on Hugging Face checkpoints, never on ones already in MLX layout.
    ``embed(input_ids, **features)``
        Run the vision/audio towers on the processor's features, merge them at the
        placeholder tokens and return ``(embeddings, state)``. ``state`` is whatever the
        decoder needs per request besides the cache (e.g. M-RoPE position ids), or None.
    ``__call__(input_ids, cache, *, embeddings=None, state=None, last_only=False)``
        Logits for ``input_ids`` (or for ``embeddings`` when given): (B, L, vocab), or with
        ``last_only`` (B, 1, vocab) for the last position alone, the output head applied
        to that position only (the generate loop's last prefill chunk gives the first
        token this way, in the same pass). The decoder reads its absolute position from
        the cache offset.
    ``layers``
        The language-model decoder blocks (LoRA and sharding walk these).

    For the batching engine (``mlxvlm.batching``), which decodes many requests together in
    one batched cache (mlx-lm's ``BatchKVCache``: per-row offsets, left padding):

    ``batch_states(states)``
        One decode-time state for requests batched one per row, from their ``embed``
        states. ``__call__`` then gets a batched cache and this state.
    ``prefix_state(state, length)``
        The state for a new prompt that shares the first ``length`` tokens of the one
        ``state`` was made for and goes on with text only (prompt-cache reuse).

    Both have defaults: no state stays None, and a state object may provide
    ``batch(states)`` (static) and ``prefix(length)`` itself, as ``MRopeState`` does.

    For adapters saved in PEFT's format (``mlxvlm.adapters``):

    ``hf_module_name(name)``
        The transformers module path of our module ``name``: ``sanitize`` for module
        names, inverted. The default reads the family module's ``HF_PREFIXES`` table.
    ``hf_split_modules(name)``
        For a linear layer of ours that is several in transformers, stacked along the
        output (a fused q/k/v): their module paths and output sizes, in order. None (the
        default) where ``hf_module_name`` names the one transformers module.
    """

    # Names of processor outputs (besides input_ids) that ``embed`` consumes.
    feature_names: tuple[str, ...] = ()

    def __init__(self):
        """``feature_cache`` (a ``models.feature_cache.FeatureCache``) holds the features
        of the images (videos, audio) this model has encoded, keyed by their preprocessed
        content, so that a chat's later turns do not run the towers again over earlier
        images. Families reach it through ``feature_cache.cached_features``. Changing the
        weights through ``update`` or ``update_modules`` empties it."""
        super().__init__()
        # A plain object, not a dict: it stays out of the parameter tree.
        self.feature_cache = FeatureCache()

    def update(self, parameters: dict, strict: bool = True) -> "VisionLanguageModel":
        self._forget_features()
        return super().update(parameters, strict=strict)

    def update_modules(self, modules: dict, strict: bool = True) -> "VisionLanguageModel":
        self._forget_features()
        return super().update_modules(modules, strict=strict)

    def _forget_features(self) -> None:
        """New weights make every cached feature stale."""
        cache = getattr(self, "feature_cache", None)
        if cache is not None:
            cache.clear()

    @classmethod
    def from_config(cls, config: dict) -> "VisionLanguageModel":
        raise NotImplementedError

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return weights

    def embed(self, input_ids: mx.array, **features: Any) -> tuple[mx.array, Any]:
        raise NotImplementedError

    @property
    def layers(self) -> list[nn.Module]:
        raise NotImplementedError

    @property
    def max_context(self) -> int | None:
        """Longest sequence the text model was trained for (None if unknown)."""
        return None

    @property
    def placeholder_token_ids(self) -> set[int]:
        """Token ids that stand for image/video/audio features in the prompt."""
        return set()

    def hf_module_name(self, name: str) -> str:
        """Default: invert the ``HF_PREFIXES`` table, ``((hf_prefix, our_prefix), ...)``,
        of the module that defines this class (or a base class). Several Hugging Face
        prefixes may map onto one of ours (old checkpoint names and the module tree); the
        most specific of ours wins, then table order, where families list the module tree
        first. The answer must map back onto ``name`` through ``sanitize``."""
        table = next(
            (
                getattr(sys.modules[cls.__module__], "HF_PREFIXES")
                for cls in type(self).__mro__
                if hasattr(sys.modules.get(cls.__module__), "HF_PREFIXES")
            ),
            (),
        )
        matches = [(hf, ours) for hf, ours in table if name.startswith(ours)]
        matches.sort(key=lambda pair: -len(pair[1]))  # stable: table order among equals
        for hf_prefix, ours in matches:
            candidate = hf_prefix + name[len(ours) :]
            probe = {f"{candidate}.weight": mx.zeros((1, 1))}
            if list(self.sanitize(probe)) == [f"{name}.weight"]:
                return candidate
        raise NotImplementedError(
            f"{type(self).__name__} cannot name its module {name!r} as transformers does "
            "(the family needs an HF_PREFIXES entry for it or its own hf_module_name)"
        )

    def hf_split_modules(self, name: str) -> tuple[tuple[str, int], ...] | None:
        return None

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.layers]

    def bidirectional_spans(self, state: Any) -> list[tuple[int, int]]:
        """Prompt ranges ``[start, end)`` (from ``embed``'s ``state``) whose tokens attend
        to each other in both directions, such as Gemma 3's image tokens. The generate loop
        never ends a prefill chunk inside one: its first tokens would miss the later ones."""
        return []

    def batch_states(self, states: Sequence[Any]) -> Any:
        present = [s for s in states if s is not None]
        if not present:
            return None
        batch = getattr(type(present[0]), "batch", None)
        if batch is None:
            raise NotImplementedError(
                f"{type(self).__name__} cannot decode requests in a batch: its "
                f"{type(present[0]).__name__} state has no batch(states)"
            )
        return batch(states)

    def prefix_state(self, state: Any, length: int) -> Any:
        """Raises NotImplementedError when the family cannot say (reuse is then off)."""
        if state is None:
            return None
        prefix = getattr(state, "prefix", None)
        if prefix is None:
            raise NotImplementedError(
                f"{type(state).__name__} has no prefix(length) for prompt-cache reuse"
            )
        return prefix(length)
