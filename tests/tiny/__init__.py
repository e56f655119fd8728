"""Tiny Hugging Face checkpoints built offline, for parity tests against transformers.

One builder module per family group (``tiny/qwen.py`` ...). Each exposes ``FAMILIES``,
``LAYOUTS``, ``build_tiny_model(family, seed) -> TinyModel`` and
``save_checkpoint(tiny, directory, layout) -> Path``; ``TinyCheckpoints`` dispatches to
them and builds every model and directory once per test session.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from tiny.common import TinyModel, make_image  # noqa: F401  (re-exported for tests)

# family -> builder module
BUILDERS = {
    "qwen2_vl": "tiny.qwen",
    "qwen2_5_vl": "tiny.qwen",
    "gemma3": "tiny.gemma3",
    "gemma3n": "tiny.gemma3n",
    "idefics3": "tiny.idefics3",
    "smolvlm": "tiny.idefics3",
    "llava": "tiny.llava",
    "llava_next": "tiny.llava",
    "llava_onevision": "tiny.llava",
    "qwen3_vl": "tiny.qwen",
    "qwen3_vl_moe": "tiny.qwen",
    "qwen3_5": "tiny.qwen3_5",
    "qwen3_5_moe": "tiny.qwen3_5",
    "mistral3": "tiny.pixtral",
    "pixtral": "tiny.pixtral",
    "paligemma": "tiny.paligemma",
    "qwen2_5_omni": "tiny.omni",
    "paddleocr_vl": "tiny.paddleocr",
    "lfm2_vl": "tiny.lfm2_vl",
    "qwen3_omni_moe": "tiny.qwen3_omni",
    "gemma4": "tiny.gemma4",
    "gemma4_moe": "tiny.gemma4",
    "colqwen2": "tiny.colvision",
    "colpali": "tiny.colvision",
    "glm4v": "tiny.glm4v",
    "glm4v_moe": "tiny.glm4v",
    "mllama": "tiny.mllama",
    "internvl": "tiny.internvl",
    "internvl_rms": "tiny.internvl",
    "internvl3": "tiny.internvl",
    "internvl_moe": "tiny.internvl",
    "minicpmv4_6": "tiny.minicpmv4_6",
    "minicpm_ocr": "tiny.minicpm_ocr",
    "glm_ocr": "tiny.glm_ocr",
    "deepseek_ocr2": "tiny.deepseek_ocr2",
    "granite_docling": "tiny.granite_docling",
    "phi4_multimodal": "tiny.phi4_multimodal",
}
# Families that embed or rank rather than generate (mlxvlm.retrieval): the family-wide
# generation tests (text, BOS, threads, PEFT names) run over GENERATIVE.
RETRIEVAL = {"colqwen2", "colpali"}
GENERATIVE = [family for family in BUILDERS if family not in RETRIEVAL]


def builder(family: str):
    return importlib.import_module(BUILDERS[family])


class TinyCheckpoints:
    """Builds each family's model once and each (family, layout) directory once, on demand."""

    # Seed 2 gives every parity prompt 24 greedy tokens before <|im_end|>, each chosen by
    # a top-1/top-2 logit margin above 3e-3 (the MLX/torch difference is ~1e-5).
    def __init__(self, root: str | Path, seed: int = 2):
        self.root = Path(root)
        self.seed = seed
        self._models: dict[str, TinyModel] = {}
        self._paths: dict[tuple[str, str], Path] = {}

    def model(self, family: str) -> TinyModel:
        if family not in self._models:
            self._models[family] = builder(family).build_tiny_model(family, self.seed)
        return self._models[family]

    def path(self, family: str, layout: str) -> Path:
        key = (family, layout)
        if key not in self._paths:
            self._paths[key] = builder(family).save_checkpoint(
                self.model(family), self.root / f"{family}-{layout}", layout
            )
        return self._paths[key]

    def bos_variant(self, family: str, kind: str) -> Path:
        """The family's "transformers" checkpoint with a tokenizer that adds BOS (see
        tiny/bos.py for the kinds), written once."""
        from tiny.bos import save_variant

        key = (family, f"bos-{kind}")
        if key not in self._paths:
            self._paths[key] = save_variant(
                self.path(family, "transformers"), self.root / f"{family}-bos-{kind}", kind
            )
        return self._paths[key]
