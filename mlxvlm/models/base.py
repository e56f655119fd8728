"""The contract every model family implements.

A family module (``mlxvlm/models/<model_type>.py``) exposes a ``Model`` class derived from
``VisionLanguageModel``. The shared generate loop only ever talks to a model through the
methods below, so a family knows nothing about sampling, caches or streaming, and the loop
knows nothing about any one family.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlxvlm.errors import MlxvlmError
from mlxvlm.models.feature_cache import FeatureCache
from mlxvlm.models.processor_utils import pil_processor

if TYPE_CHECKING:  # for the annotations only
    from mlxvlm.cpu.ops import FastPathReport
    from mlxvlm.distributed.group import ShardPlan
    from mlxvlm.retrieval.use import RetrievalUse
from mlxvlm.models.weights import is_hf_naming, rename_prefix

# ``args`` fields that name a placeholder token (``placeholder_token_ids``' default).
PLACEHOLDER_TOKEN_FIELDS = ("image_token_id", "video_token_id", "audio_token_id")


class VisionLanguageModel(nn.Module):
    """Base class of every family's ``Model``.

    Subclasses implement:

    ``from_config(config)``
        Build the module tree from the checkpoint's ``config.json`` (either the Hub's older
        layout or the one transformers 5's ``save_pretrained`` writes). The default builds
        ``cls(cls.args_class.from_hf(config))``.
    ``sanitize(weights)``
        Map a Hugging Face checkpoint's tensor names and layouts onto this module's. It is
        called only on Hugging Face checkpoints (``is_hf_checkpoint``), never on ones
        already in MLX layout. ``hf_to_mlx_name`` renames one tensor by ``hf_prefixes``.
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

    and may rely on the defaults, which read the conventions most families share:

    ``layers``
        The language-model decoder blocks (LoRA and sharding walk these):
        ``language_model.layers``, else ``language_model.model.layers``.
    ``max_context``
        ``args.text.max_position_embeddings`` (None where there is none).
    ``placeholder_token_ids``
        ``args``' ``image_token_id``, ``video_token_id`` and ``audio_token_id``, those it has.
    ``is_hf_checkpoint(weight_names)`` (class method)
        Whether a checkpoint's tensors are named as Hugging Face names them (else: as this
        module names them): some name starts with a Hugging Face prefix of
        ``hf_prefixes``; one that also holds names under ``mlx_prefixes`` is refused.
    ``load_processor(model_path, config)`` (class method)
        The transformers processor built without torch/torchvision: by default
        ``processor_class`` over the checkpoint's tokenizer and ``image_processor_class``
        (a PIL image processor), both named as transformers exports them.

    For the batching engine (``mlxvlm.batching``), which decodes many requests together in
    one batched cache (mlx-lm's ``BatchKVCache``: per-row offsets, left padding):

    ``batch_states(states)``
        One decode-time state for requests batched one per row, from their ``embed``
        states. ``__call__`` then gets a batched cache and this state.
    ``prefix_state(state, length)``
        The state for a new prompt that shares the first ``length`` tokens of the one
        ``state`` was made for and goes on with text only (prompt-cache reuse).

    ``stored_state(state)``
        What a prompt-cache entry keeps of a finished request's state: all that
        ``prefix_state`` reads (default: the state itself; Llama 3.2 Vision's drops the
        image states, whose keys its cache holds).

    They have defaults: no state stays None, and a state object may provide
    ``batch(states)`` (static), ``prefix(length)`` and ``stored()`` itself, as
    ``MRopeState`` provides the first two.

    For adapters saved in PEFT's format (``mlxvlm.checkpoint.adapters``):

    ``hf_module_name(name)``
        The transformers module path of our module ``name``: ``sanitize`` for module
        names, inverted. The default reads ``hf_prefixes``.
    ``hf_split_modules(name)``
        For a linear layer of ours that is several in transformers, stacked along the
        output (a fused q/k/v): their module paths and output sizes, in order. None (the
        default) where ``hf_module_name`` names the one transformers module.
    """

    # Names of processor outputs (besides input_ids) that ``embed`` consumes.
    feature_names: tuple[str, ...] = ()
    # Set by loading on the model it returns; these defaults are a model built otherwise's.
    # This rank's shard of the language model under mlx.launch (None: the whole model).
    sharding: ShardPlan | None = None
    # What the CPU fast paths did (None: not applied, ``load(..., cpu_fast_paths=False)``).
    cpu_fast_paths: FastPathReport | None = None
    # What the model does for retrieval (embedding, reranking), found by
    # ``mlxvlm.retrieval.detection`` at load; None: a generative model.
    retrieval: RetrievalUse | None = None
    # The family's parsed config: a class with ``from_hf(config)`` (``from_config``'s default).
    args_class: type | None = None
    # ``(hf_prefix, ours)`` pairs: a Hugging Face tensor name's prefix and ours for it. The
    # longest matching prefix renames a name (``weights.rename_prefix``), so the order is
    # free to put transformers' module tree first, which ``hf_module_name`` names after.
    hf_prefixes: tuple[tuple[str, str], ...] = ()
    # Prefixes only our names have; a checkpoint holding both namings is neither layout.
    mlx_prefixes: tuple[str, ...] = ()
    # Parts of a model some checkpoints carry (in either naming) that this family does
    # not build, such as an omni model's speech output: their tensors are left out.
    unused_weight_prefixes: tuple[str, ...] = ()
    # Module paths of parts a checkpoint may leave out (Qwen3.5's multi-token-prediction
    # head, which mlx-lm's conversions drop): built from the config, removed at load
    # when the weights hold none of their tensors.
    optional_parts: tuple[str, ...] = ()
    # Modules beside the language model that every rank of a sharded model keeps, because
    # embedding a token needs them (Gemma 3n's embedders of its vision and audio tokens);
    # the other ranks drop every other tower (distributed/sharding.py).
    kept_on_every_rank: tuple[str, ...] = ()
    # Embedding tables of which a token reads one row, by module path: loading may leave
    # them in the checkpoint's files and gather the rows each call needs
    # (checkpoint/disk_tables.py); those it did are ``tables_on_disk``.
    gathered_tables: tuple[str, ...] = ()
    tables_on_disk: frozenset[str] = frozenset()
    # transformers' processor and PIL image processor classes, by their exported names
    # (transformers is imported only when a processor is built).
    processor_class: str | None = None
    image_processor_class: str | None = None
    # Whether every prompt token's states depend on all of the prompt's images, not only
    # the tokens from an image on (Llama 3.2 Vision: text before an image still attends
    # to it through cross-attention). The prefix cache then shares a prefix only between
    # prompts with the same images (``batching.prefix_cache.prompt_key``).
    media_condition_every_token: bool = False
    # Special tokens this family's answers carry as markup, which transformers' usage
    # keeps (``decode(..., skip_special_tokens=False)``), e.g. DeepSeek-OCR 2's grounding
    # tags: every entry point keeps their text in the answer (``load`` hands them to the
    # processor's state, ``mlxvlm.text.tokenization``); decode drops every other one.
    answer_markup_tokens: tuple[str, ...] = ()

    def __init__(self, args: Any = None):
        """``args``: the family's parsed config (an ``args_class``), which the defaults
        read. ``feature_cache`` (a ``models.feature_cache.FeatureCache``) holds the features
        of the images (videos, audio) this model has encoded, keyed by their preprocessed
        content, so that a chat's later turns do not run the towers again over earlier
        images. Families reach it through ``feature_cache.cached_features``. Changing the
        weights through ``update`` or ``update_modules`` empties it."""
        super().__init__()
        # Plain objects, not dicts: they stay out of the parameter tree.
        self.args = args
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
        if cls.args_class is None:
            raise NotImplementedError(
                f"{cls.__name__} sets no args_class; it needs one or its own from_config"
            )
        return cls(cls.args_class.from_hf(config))

    # -- checkpoints and processors ---------------------------------------------------

    @classmethod
    def is_hf_checkpoint(cls, weight_names: Iterable[str]) -> bool:
        hf_prefixes = tuple(hf for hf, _ in cls.hf_prefixes)
        return is_hf_naming(weight_names, hf_prefixes, cls.mlx_prefixes)

    @classmethod
    def hf_to_mlx_name(cls, name: str) -> str:
        return rename_prefix(name, cls.hf_prefixes)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return weights

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict):
        if cls.processor_class is None or cls.image_processor_class is None:
            raise NotImplementedError(
                f"{cls.__name__} names no processor_class and image_processor_class; it "
                "needs both or its own load_processor"
            )
        return pil_processor(model_path, cls.processor_class, cls.image_processor_class)

    def embed(self, input_ids: mx.array, **features: Any) -> tuple[mx.array, Any]:
        raise NotImplementedError

    # -- the decoder ------------------------------------------------------------------

    @property
    def layers(self) -> list[nn.Module]:
        # mlx-lm's models and a bare decoder have ``layers``; mlx-community's
        # ``language_model.model.*`` naming puts the blocks one level down otherwise.
        # A pipelined decoder (mlx-lm's PipelineMixin) names its own run of layers.
        language_model = self.language_model
        if hasattr(language_model, "layers"):
            return language_model.layers
        decoder = language_model.model
        return getattr(decoder, "pipeline_layers", decoder.layers)

    @property
    def max_context(self) -> int | None:
        """Longest sequence the text model was trained for (None if unknown)."""
        text = getattr(getattr(self, "args", None), "text", None)
        return getattr(text, "max_position_embeddings", None)

    @property
    def placeholder_token_ids(self) -> set[int]:
        """Token ids that stand for image/video/audio features in the prompt."""
        args = getattr(self, "args", None)
        ids = (getattr(args, name, None) for name in PLACEHOLDER_TOKEN_FIELDS)
        return {i for i in ids if i is not None}

    def hf_module_name(self, name: str) -> str:
        """Default: invert ``hf_prefixes``. Several Hugging Face prefixes may map onto one
        of ours (old checkpoint names and the module tree); the most specific of ours
        wins, then table order, where families list the module tree first. The answer
        must map back onto ``name`` through ``sanitize``."""
        # (``name + "."``: a module that is a prefix's whole, such as a projector that is
        # one linear layer.)
        dotted = name + "."
        matches = [(hf, ours) for hf, ours in self.hf_prefixes if dotted.startswith(ours)]
        matches.sort(key=lambda pair: -len(pair[1]))  # stable: table order among equals
        for hf_prefix, ours in matches:
            candidate = (hf_prefix + dotted[len(ours) :])[:-1]
            probe = {f"{candidate}.weight": mx.zeros((1, 1))}
            if list(self.sanitize(probe)) == [f"{name}.weight"]:
                return candidate
        raise NotImplementedError(
            f"{type(self).__name__} cannot name its module {name!r} as transformers does "
            "(the family needs an hf_prefixes entry for it or its own hf_module_name)"
        )

    def hf_split_modules(self, name: str) -> tuple[tuple[str, int], ...] | None:
        return None

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.layers]

    def multi_token_predictor(self) -> Any:
        """What ``--mtp`` drafts with (``layers.mtp_head.MtpTarget``): the checkpoint's
        multi-token-prediction head beside the target's hidden states. A family without
        one refuses."""
        family = type(self).__module__.rpartition(".")[2]
        raise MlxvlmError(f"--mtp given but the {family} family has no multi-token-prediction "
                          "head (Qwen3.5, Qwen3.5-MoE and MiniCPM-V 4.6 checkpoints ship one)")

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

    def stored_state(self, state: Any) -> Any:
        stored = getattr(state, "stored", None)
        return state if stored is None else stored()


def materialize(model: nn.Module) -> None:
    """Evaluate every array the model holds, parameters or not (e.g. rotary tables kept
    on plain helper objects), in the calling thread.

    MLX streams are per thread, and a lazy array can only be evaluated on the thread
    that built it: a model loaded on one thread and run on another (the server's engine,
    the UI's workers, a user's thread pool) would fail on a table left unevaluated.
    ``load`` calls it; the batching engine calls it again for models built by hand.
    """
    arrays: list[mx.array] = []
    seen: set[int] = set()

    def collect(value: Any, depth: int) -> None:
        if id(value) in seen or depth > 4:
            return
        seen.add(id(value))
        if isinstance(value, mx.array):
            arrays.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item, depth + 1)
        elif isinstance(value, nn.Module):  # (a dict too)
            # Its children and parameters, and what it keeps outside them (e.g. the
            # original layer a CPU fast path replaced, kept as a plain attribute).
            for item in list(value.values()) + list(vars(value).values()):
                collect(item, 0)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            for item in vars(value).values():
                collect(item, depth + 1)

    collect(model, 0)
    mx.eval(model.parameters(), arrays)
