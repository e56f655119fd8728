"""Tiny Qwen3-VL-Embedding and Qwen3-VL-Reranker checkpoints in the Hub's layout.

Both are plain Qwen3-VL checkpoints (``tiny/qwen.py``'s) whose tokenizer also holds the
words "yes" and "no" (the reranker reads their logits), with the sentence-transformers
files the Hub repos carry beside them. Qwen/Qwen3-VL-Embedding-2B's config.json is
transformers 5's (``rope_parameters`` in ``text_config``), so the embedding checkpoint is
written in ``tiny/qwen.py``'s "transformers" layout; the reranker in its "hub" layout
(transformers 4.57's, as Qwen3-VL's first checkpoints).

- embedding: ``modules.json`` of Transformer, Pooling (``1_Pooling``, last token) and
  Normalize (``2_Normalize``);
- reranker: ``modules.json`` of Transformer and LogitScore (``1_LogitScore``, the ids of
  "yes" and "no").

``save_plain`` writes the same weights without those files (a folder carrying the Hub's
repository name is how such a download is still recognized).
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny.common import TinyModel, perturb_constants
from tiny.qwen import _config, build_image_processor, build_tokenizer, save_checkpoint

FAMILY = "qwen3_vl"
ANSWER_WORDS = ("yes", "no")

# sentence-transformers 5's class paths, as its save() writes them into modules.json.
TRANSFORMER = {"idx": 0, "name": "0", "path": "",
               "type": "sentence_transformers.base.modules.transformer.Transformer"}


def build_retrieval_model(seed: int = 0) -> TinyModel:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    tokenizer = build_tokenizer()
    tokenizer.add_tokens(list(ANSWER_WORDS))
    config = _config(FAMILY, tokenizer)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    return TinyModel(FAMILY, model, tokenizer, build_image_processor(FAMILY))


def _write_module(directory: Path, folder: str, config: dict) -> None:
    (directory / folder).mkdir(exist_ok=True)
    (directory / folder / "config.json").write_text(json.dumps(config, indent=2))


def save_embedding(tiny: TinyModel, directory: Path) -> Path:
    directory = save_checkpoint(tiny, directory, "transformers")
    hidden = tiny.model.config.text_config.hidden_size
    _write_module(directory, "1_Pooling", {"embedding_dimension": hidden,
                                           "pooling_mode": "lasttoken", "include_prompt": True})
    _write_module(directory, "2_Normalize", {})
    modules = [TRANSFORMER,
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize",
                "type": "sentence_transformers.base.modules.normalize.Normalize"}]
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    return directory


def save_reranker(tiny: TinyModel, directory: Path) -> Path:
    directory = save_checkpoint(tiny, directory, "hub")
    yes, no = (tiny.tokenizer.convert_tokens_to_ids(word) for word in ANSWER_WORDS)
    _write_module(directory, "1_LogitScore", {"true_token_id": yes, "false_token_id": no,
                                              "module_input_name": "causal_logits"})
    modules = [TRANSFORMER,
               {"idx": 1, "name": "1", "path": "1_LogitScore",
                "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"}]
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    return directory


def save_plain(tiny: TinyModel, directory: Path) -> Path:
    return save_checkpoint(tiny, directory, "hub")
