"""A tiny MiniCPM-V 4.6 checkpoint (see tests/tiny/__init__.py), in two layouts:

``"transformers"``
    What transformers 5's ``save_pretrained`` writes for the model, with the tokenizer,
    the image processor's ``preprocessor_config.json`` and ``chat_template.jinja``.
``"hub"``
    As openbmb/MiniCPM-V-4.6's files are laid out: the text config with
    ``full_attention_interval`` instead of ``layer_types``, ``torch_dtype``, a
    multi-token-prediction head (``mtp.*``) beside the model's tensors, the image
    processor's name as the fast one, and ``chat_template.json``.

The tower: 4-pixel patches over an 8 x 8 position table, 4 blocks, the window-attention
merger after block 1 (2 x 2 windows), then the 2 x 2 merger to the text width; the
processor's slices are about 32 pixels (8 x 8 patches: 4 tokens each after both merges),
at most 4 slices besides the whole picture. The text model is Qwen3.5's hybrid (linear,
full, linear, full). The tokenizer names the processor's tokens
(``extra_special_tokens``) and adds no BOS.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny.common import INIT_RANGE, TinyModel, build_bpe_tokenizer, perturb_constants, write_safetensors

FAMILIES = ("minicpmv4_6",)
LAYOUTS = ("transformers", "hub")

PROCESSOR_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *PROCESSOR_TOKENS.values())

# ChatML with an image part as the image token (the processor expands it to the picture
# and its slices), a video part as the video token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<|image_pad|>' }}"
    "{% elif content['type'] == 'video' %}{{ '<|video_pad|>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)

PATCH = 4
SLICE = 32
TEXT_ROPE_THETA = 7_000.0
TEXT_INIT_RANGE = INIT_RANGE / 2  # as tiny/qwen3_5.py: the linear layers' outputs grow fast
IMAGE_SETTINGS = dict(max_slice_nums=4, scale_resolution=SLICE, patch_size=PATCH,
                      slice_mode=True, downsample_mode="16x", use_image_id=True)


def build_tokenizer():
    return build_bpe_tokenizer(SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               extra_special_tokens=PROCESSOR_TOKENS)


def build_image_processor():
    from transformers import MiniCPMV4_6ImageProcessorPil

    return MiniCPMV4_6ImageProcessorPil(**IMAGE_SETTINGS)


def reference_processor(tiny: TinyModel):
    """transformers' processor over the tiny model's in-memory parts (the PIL image
    processor; video parity runs transformers' own torchvision video processor)."""
    from mlxvlm.models.minicpm_video import MiniCPMVideoProcessor
    from mlxvlm.models.minicpmv4_6 import build_processor

    return build_processor(tiny.image_processor, tiny.tokenizer, CHAT_TEMPLATE,
                           MiniCPMVideoProcessor(**IMAGE_SETTINGS))


def token_ids(tokenizer) -> dict[str, int]:
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def text_and_vision_configs(tokenizer) -> tuple[dict, dict]:
    """The tiny hybrid text model's and tower's settings (see the module's docstring)."""
    ids = token_ids(tokenizer)
    text = dict(
        model_type="qwen3_5_text", vocab_size=(len(tokenizer) + 15) // 16 * 16,
        hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": TEXT_ROPE_THETA,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True,
                         "partial_rotary_factor": 0.25},
        initializer_range=TEXT_INIT_RANGE, eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=2, image_size=SLICE, patch_size=PATCH,
                  window_kernel_size=[2, 2], initializer_range=INIT_RANGE)
    return text, vision


def _config(tokenizer):
    from transformers import MiniCPMV4_6Config

    ids = token_ids(tokenizer)
    text, vision = text_and_vision_configs(tokenizer)
    return MiniCPMV4_6Config(text_config=text, vision_config=vision, insert_layer_id=1,
                             image_size=SLICE, image_token_id=ids["<|image_pad|>"],
                             video_token_id=ids["<|video_pad|>"], tie_word_embeddings=False,
                             downsample_mode="16x", merge_kernel_size=[2, 2], merger_times=1)


# Picked so that every parity prompt gets 24 greedy tokens with clear top-1/top-2 margins.
SEED_OFFSET = 2


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import MiniCPMV4_6ForConditionalGeneration

    tokenizer = build_tokenizer()
    seed += SEED_OFFSET
    torch.manual_seed(seed)
    model = MiniCPMV4_6ForConditionalGeneration(_config(tokenizer)).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return TinyModel(family, model, tokenizer, build_image_processor())


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    from transformers import MiniCPMV4_6VideoProcessor

    return save_minicpm_checkpoint(tiny, directory, layout,
                                   image_processor_type="MiniCPMV4_6ImageProcessorFast",
                                   processor_class="MiniCPMV4_6Processor",
                                   video_processor=MiniCPMV4_6VideoProcessor(**IMAGE_SETTINGS))


def save_minicpm_checkpoint(tiny: TinyModel, directory: str | Path, layout: str, *,
                            image_processor_type: str, processor_class: str,
                            video_processor) -> Path:
    """The model in ``layout`` (see the module's docstring), with transformers'
    ``video_processor``'s video_preprocessor_config.json; in the Hub's, the image
    processor and processor named as the Hub's preprocessor_config.json names them."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    tiny.tokenizer.save_pretrained(directory)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    tokenizer_config["extra_special_tokens"] = PROCESSOR_TOKENS
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    tiny.image_processor.save_pretrained(directory)
    video_processor.save_pretrained(directory)
    if layout == "transformers":
        (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    elif layout == "hub":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
        from safetensors.numpy import load_file

        from tiny.qwen3_5 import mtp_weights

        weights = load_file(str(directory / "model.safetensors"))
        weights.update(mtp_weights(weights, config["text_config"], seed=0))
        write_safetensors(weights, directory)
        preprocessor = json.loads((directory / "preprocessor_config.json").read_text())
        preprocessor["image_processor_type"] = image_processor_type
        preprocessor["processor_class"] = processor_class
        (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
        (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    else:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    return directory


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> the Hub's layout."""
    hub = {k: v for k, v in config.items() if k != "dtype"}
    text = {k: v for k, v in config["text_config"].items() if k not in ("layer_types", "dtype")}
    types = config["text_config"]["layer_types"]
    text["full_attention_interval"] = types.index("full_attention") + 1
    text["mtp_num_hidden_layers"] = 1
    hub["text_config"] = text
    hub["vision_config"] = {k: v for k, v in config["vision_config"].items() if k != "dtype"}
    hub["torch_dtype"] = "bfloat16"
    return hub
