"""A tiny LFM2-VL checkpoint (see tests/tiny/__init__.py), in two layouts:

``"transformers"``
    Exactly what transformers 5's ``save_pretrained`` writes for the model and processor:
    ``text_config`` with ``rope_parameters``, ``layer_types`` and ``intermediate_size``,
    the image processor's settings in ``processor_config.json``.
``"hub"``
    LiquidAI/LFM2-VL's layout: the text config in LFM2's own spellings (``rope_theta``,
    ``block_ff_dim``, ``block_dim``, ``full_attn_idxs``, ``tie_embedding``, no
    ``layer_types``), ``preprocessor_config.json`` and ``chat_template.jinja``, the
    tower's tensors one level down (``model.vision_tower.vision_model.*``).

The tokenizer prepends ``<|startoftext|>`` as LFM2's does (a ``TemplateProcessing``
post-processor) and the chat template starts with ``{{ bos_token }}``, so a prompt holds
one BOS only because transformers then tokenizes it without special tokens.

The text model alternates convolution and attention layers (4, two of each, with a
kernel of 3); the NaFlex tower has 8-pixel patches over a 4 x 4 position grid; the
processor's tiles are 64 pixels (8 x 8 patches, 16 tokens after the 2 x 2 unshuffle), an
image resized as one has 4 to 16 tokens, and one larger than twice that is cut into 2 to 4
tiles plus a thumbnail.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny.common import INIT_RANGE, TinyModel, build_bpe_tokenizer, perturb_constants, write_safetensors

FAMILIES = ("lfm2_vl",)
LAYOUTS = ("transformers", "hub")

BOS = "<|startoftext|>"
MAX_TILES = 4
ROW_COL_TOKENS = tuple(f"<|img_row_{r}_col_{c}|>" for r in range(1, MAX_TILES + 1)
                       for c in range(1, MAX_TILES + 1))
SPECIAL_TOKENS = (
    "<|pad|>", BOS, "<|im_start|>", "<|im_end|>", "<image>", "<|image_start|>",
    "<|image_end|>", "<|img_thumbnail|>",
) + ROW_COL_TOKENS

# LFM2-VL's template: ChatML after the BOS token, images where the content lists them.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PATCH = 8
TILE = 64
DOWNSAMPLE = 2
ROPE_THETA = 7_000.0  # far from LFM2's default 1e6
LAYER_TYPES = ["conv", "full_attention", "conv", "full_attention"]
IMAGE_SETTINGS = dict(
    encoder_patch_size=PATCH, tile_size=TILE, downsample_factor=DOWNSAMPLE,
    min_image_tokens=4, max_image_tokens=16, min_tiles=2, max_tiles=MAX_TILES,
    use_thumbnail=True, max_pixels_tolerance=2.0, do_image_splitting=True,
    image_mean=[0.5] * 3, image_std=[0.5] * 3,
)


def build_tokenizer():
    from tokenizers import processors

    tokenizer = build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="<|im_end|>",
        pad_token="<|pad|>", bos_token=BOS,
    )
    bos_id = tokenizer.convert_tokens_to_ids(BOS)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def build_image_processor():
    from mlxvlm.models.lfm2_vl_images import Lfm2VlImageProcessorPil

    return Lfm2VlImageProcessorPil(**IMAGE_SETTINGS)


def build_processor(tokenizer, image_processor):
    from transformers import Lfm2VlProcessor

    return Lfm2VlProcessor(image_processor=image_processor, tokenizer=tokenizer,
                           chat_template=CHAT_TEMPLATE)


def reference_processor(tiny: TinyModel):
    """transformers' processor over the tiny model's in-memory parts (its image processor
    is mlxvlm's numpy one: transformers' own needs torchvision, and
    tests/test_lfm2_vl_images.py shows the two give the same outputs)."""
    return build_processor(tiny.tokenizer, tiny.image_processor)


def _config(tokenizer):
    from transformers import Lfm2VlConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        model_type="lfm2", vocab_size=(len(tokenizer) + 15) // 16 * 16, hidden_size=64,
        intermediate_size=192, num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, norm_eps=1e-5,
        conv_bias=True, conv_L_cache=3, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True, layer_types=LAYER_TYPES,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        initializer_range=INIT_RANGE, bos_token_id=ids[BOS], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|pad|>"], tie_word_embeddings=True,
    )
    vision = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2, patch_size=PATCH, num_patches=16,
                  vision_use_head=False, initializer_range=INIT_RANGE)
    return Lfm2VlConfig(text_config=text, vision_config=vision, image_token_id=ids["<image>"],
                        downsample_factor=DOWNSAMPLE, projector_hidden_size=48,
                        projector_hidden_act="gelu", projector_bias=True,
                        projector_use_layernorm=True, tie_word_embeddings=True)


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import Lfm2VlForConditionalGeneration

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Lfm2VlForConditionalGeneration(_config(tokenizer)).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    model.generation_config.bos_token_id = tokenizer.convert_tokens_to_ids(BOS)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|pad|>")
    return TinyModel(family, model, tokenizer, build_image_processor())


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    if layout == "transformers":
        build_processor(tiny.tokenizer, tiny.image_processor).save_pretrained(directory)
        _name_image_processor(directory / "processor_config.json", nested=True)
    elif layout == "hub":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
        _save_hub_weights(tiny, directory)
        _save_hub_processor_files(tiny, directory)
    else:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    return directory


def _name_image_processor(path: Path, nested: bool) -> None:
    """Name transformers' image processor class, as a real checkpoint's files do (ours,
    its numpy stand-in, is what the fixture was built with)."""
    data = json.loads(path.read_text())
    target = data.get("image_processor", data) if nested else data
    target["image_processor_type"] = "Lfm2VlImageProcessor"
    path.write_text(json.dumps(data, indent=2))


# The text config's keys as LiquidAI's checkpoints spell them.
_HUB_TEXT_KEYS = ("hidden_size", "max_position_embeddings", "model_type", "norm_eps",
                  "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                  "vocab_size", "conv_bias", "conv_L_cache", "block_multiple_of",
                  "block_ffn_dim_multiplier", "block_auto_adjust_ff_dim", "initializer_range",
                  "bos_token_id", "eos_token_id", "pad_token_id")


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> LiquidAI/LFM2-VL's."""
    text = config["text_config"]
    hub_text = {k: text[k] for k in _HUB_TEXT_KEYS}
    hub_text.update(
        rope_theta=text["rope_parameters"]["rope_theta"],
        block_ff_dim=text["intermediate_size"], block_dim=text["hidden_size"],
        conv_dim=text["hidden_size"], num_heads=text["num_attention_heads"],
        full_attn_idxs=[i for i, t in enumerate(text["layer_types"]) if t == "full_attention"],
        tie_embedding=True, use_pos_enc=True, architectures=["Lfm2ForCausalLM"],
    )
    vision = {k: v for k, v in config["vision_config"].items()
              if k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_channels", "patch_size", "num_patches",
                       "hidden_act", "layer_norm_eps", "vision_use_head", "model_type",
                       "initializer_range")}
    keys = ("downsample_factor", "image_token_id", "projector_bias", "projector_hidden_act",
            "projector_hidden_size", "projector_use_layernorm")
    return {
        "architectures": ["Lfm2VlForConditionalGeneration"],
        "model_type": "lfm2_vl",
        **{k: config[k] for k in keys},
        **{k: IMAGE_SETTINGS[k] for k in ("do_image_splitting", "encoder_patch_size",
                                          "max_image_tokens", "min_image_tokens", "max_tiles",
                                          "min_tiles", "tile_size", "use_thumbnail")},
        "text_config": hub_text,
        "vision_config": vision,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_image_special_tokens": True,
        "vision_feature_layer": -1,
    }


def _save_hub_weights(tiny: TinyModel, directory: Path) -> None:
    """The Hub's names: the tower nested one level down, no tied head."""
    weights = {}
    for name, value in tiny.model.state_dict().items():
        if name == "lm_head.weight":
            continue
        name = name.replace("model.vision_tower.", "model.vision_tower.vision_model.", 1)
        weights[name] = value.detach().numpy().copy()
    write_safetensors(weights, directory)


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    preprocessor = {
        **IMAGE_SETTINGS, "do_normalize": True, "do_pad": True, "do_rescale": True,
        "do_resize": True, "image_processor_type": "Lfm2VlImageProcessorFast",
        "processor_class": "Lfm2VlProcessor", "resample": 2, "rescale_factor": 1 / 255,
        "size": {"height": 512, "width": 512}, "max_num_patches": (TILE // PATCH) ** 2,
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (directory / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Lfm2VlProcessor"}, indent=2))
    tiny.tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
