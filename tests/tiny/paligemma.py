"""Tiny PaliGemma 2 checkpoints (SigLIP + Gemma 2) for parity tests.

A randomly initialised ``PaliGemmaForConditionalGeneration`` (float32), a byte-level BPE
tokenizer with Gemma's special tokens and ``<image>``, and the PIL SigLIP image processor
(32 x 32 images in 8-pixel patches: 16 image tokens each), saved in one of two layouts:

``"transformers"``
    config.json as transformers 5's ``save_pretrained`` writes it (complete sub-configs,
    ``rope_parameters``, ``layer_types``), tensors named by the module tree
    (``model.vision_tower.*`` without SigLIP's ``vision_model.`` level,
    ``model.multi_modal_projector.*``, ``model.language_model.*``, a tied ``lm_head``).
``"hub"``
    The layout of google/paligemma2-3b-pt-224 (transformers 4.47): sparse sub-configs that
    name only what differs from the defaults (no rope, no layer types), tensors named
    ``vision_tower.vision_model.*``, ``multi_modal_projector.*``, ``language_model.model.*``
    and no head, preprocessor_config.json with ``image_seq_length``.

Neither carries a chat template, as PaliGemma's checkpoints do not. The text model's rope
θ, ``query_pre_attn_scalar`` and sliding window are non-default, so that a loader reading
a default instead fails parity; the window is shorter than the prompts plus the answer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny.common import (
    INIT_RANGE,
    TinyModel,
    build_bpe_tokenizer,
    perturb_constants,
    write_safetensors,
)

FAMILIES = ("paligemma",)
LAYOUTS = ("transformers", "hub")

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<image>")
IMAGE_SIZE = 32
PATCH_SIZE = 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2
TEXT_ROPE_THETA = 5000.0
QUERY_PRE_ATTN_SCALAR = 48
SLIDING_WINDOW = 12
EMBED_RANGE = 0.05
SEED_OFFSET = 1


def build_tokenizer():
    return build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=None, eos_token="<eos>", pad_token="<pad>",
        bos_token="<bos>",
    )


def build_image_processor():
    from transformers import SiglipImageProcessorPil

    return SiglipImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_seq_length=IMAGE_TOKENS,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], resample=3,
    )


def _config(tokenizer):
    from transformers import PaliGemmaConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        model_type="gemma2", vocab_size=(len(tokenizer) + 15) // 16 * 16, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": TEXT_ROPE_THETA},
        query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR, sliding_window=SLIDING_WINDOW,
        initializer_range=INIT_RANGE, bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"],
    )
    vision = dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE, vision_use_head=False,
    )
    return PaliGemmaConfig(text_config=text, vision_config=vision, projection_dim=64,
                           image_token_index=ids["<image>"], tie_word_embeddings=True)


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import PaliGemmaForConditionalGeneration

    tokenizer = build_tokenizer()
    config = _config(tokenizer)
    seed += SEED_OFFSET  # clear top-1/top-2 margins on every parity prompt
    torch.manual_seed(seed)
    model = PaliGemmaForConditionalGeneration(config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # SigLIP's own init is small whatever initializer_range says.
        for name, param in model.named_parameters():
            if "vision_tower" in name and name.endswith("weight") and param.ndim > 1:
                param.normal_(0.0, INIT_RANGE, generator=generator)
        # Embeddings scaled by sqrt(hidden) at the large range swamp the residual stream
        # and the tied head: the model would only repeat the prompt's last token.
        model.model.language_model.embed_tokens.weight.normal_(0.0, EMBED_RANGE, generator=generator)
    perturb_constants(model, generator)
    text = config.text_config
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, getattr(text, key))
    return TinyModel(family, model, tokenizer, build_image_processor())


def build_processor(tiny: TinyModel):
    from transformers import PaliGemmaProcessor

    return PaliGemmaProcessor(image_processor=tiny.image_processor, tokenizer=tiny.tokenizer)


def reference_processor(tiny: TinyModel):
    """transformers' processor over the tiny model's in-memory parts, with the chat
    template mlxvlm gives checkpoints that have none (as this one)."""
    from mlxvlm.models.paligemma import CHAT_TEMPLATE

    processor = build_processor(tiny)
    processor.chat_template = CHAT_TEMPLATE
    return processor


# ---------------------------------------------------------------------------------- saving


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    state = tiny.model.state_dict()
    weights = {name: value.detach().cpu().numpy() for name, value in state.items()}
    if layout == "transformers":
        build_processor(tiny).save_pretrained(directory)
    elif layout == "hub":
        weights = {_legacy_name(n): v for n, v in weights.items() if not n.startswith("lm_head.")}
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
        _save_hub_processor_files(tiny, directory)
    else:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    write_safetensors(weights, directory)
    return directory


def _legacy_name(name: str) -> str:
    for prefix, legacy in (("model.language_model.", "language_model.model."),
                           ("model.vision_tower.", "vision_tower.vision_model."),
                           ("model.multi_modal_projector.", "multi_modal_projector.")):
        if name.startswith(prefix):
            return legacy + name[len(prefix):]
    return name


# What google/paligemma2-3b-pt-224's config.json names in its sub-configs.
_HUB_TEXT_KEYS = ("hidden_activation", "hidden_size", "intermediate_size", "model_type",
                  "num_attention_heads", "num_hidden_layers", "num_image_tokens",
                  "num_key_value_heads", "vocab_size")
_HUB_VISION_KEYS = ("hidden_size", "intermediate_size", "model_type", "num_attention_heads",
                    "num_hidden_layers", "patch_size", "projection_dim", "vision_use_head")


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> the Hub's sparse 4.47 layout. Keys this tiny model
    sets away from the defaults stay (the Hub's 3B uses the defaults for them)."""
    text = config["text_config"]
    hub_text = {k: text[k] for k in _HUB_TEXT_KEYS if k in text}
    hub_text.update(head_dim=text["head_dim"], max_position_embeddings=text["max_position_embeddings"],
                    query_pre_attn_scalar=text["query_pre_attn_scalar"],
                    sliding_window=text["sliding_window"], rms_norm_eps=text["rms_norm_eps"],
                    rope_theta=text["rope_parameters"]["rope_theta"])
    vision = config["vision_config"]
    hub_vision = {k: vision[k] for k in _HUB_VISION_KEYS if k in vision}
    hub_vision.update(image_size=vision["image_size"], num_image_tokens=IMAGE_TOKENS,
                      num_positions=IMAGE_TOKENS)
    return {
        "_vocab_size": text["vocab_size"],
        "architectures": ["PaliGemmaForConditionalGeneration"],
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "hidden_size": 2048,
        "image_token_index": config["image_token_index"],
        "model_type": "paligemma",
        "num_hidden_layers": text["num_hidden_layers"],
        "pad_token_id": text["pad_token_id"],
        "projection_dim": config["projection_dim"],
        "text_config": hub_text,
        "torch_dtype": "float32",
        "transformers_version": "4.47.0.dev0",
        "vision_config": hub_vision,
    }


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    ip = tiny.image_processor
    preprocessor = {
        "do_convert_rgb": None, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": list(ip.image_mean), "image_std": list(ip.image_std),
        "image_processor_type": "SiglipImageProcessor", "image_seq_length": IMAGE_TOKENS,
        "processor_class": "PaliGemmaProcessor", "resample": 3, "rescale_factor": 1 / 255,
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    build_processor(tiny).tokenizer.save_pretrained(directory)
