"""Tiny Phi-4-multimodal checkpoints (transformers' native layout, ``model_type:
phi4_multimodal``), built offline (see tests/tiny/__init__.py).

Phi-4-multimodal's shape, small: a Phi-3 text model (fused q/k/v, fused gate/up, a
rotary on 3/4 of each head under LongRoPE whose short and long factors differ, a tied
head), a SigLIP tower over 64-px crops of 2-px patches (32 x 32 patches: after the 2 x 2
pooling, the 16 x 16 tokens per crop transformers' processor counts for 448-px crops of
14-px patches), and a conformer audio encoder (80 mel bins, 8x time reduction, chunked
streaming attention: ``chunk_size`` 4 with 1 chunk of left context, where the real one
sees the whole clip). The processor cuts a picture into up to 4 crops and a global view.

Layouts:

``"transformers"``
    What transformers 5's ``save_pretrained`` writes for the model, and the processor's
    files: ``processor_config.json`` nesting the image processor's and the audio
    processor's settings, ``chat_template.jinja``.
``"hub"``
    As the Hub's transformers-layout Phi-4-multimodal-instruct is laid out (written by
    transformers 4.5x): ``rope_scaling`` with ``"type": "longrope"``, ``rope_theta`` and
    ``partial_rotary_factor`` at the top level, ``torch_dtype``, tensors by the module
    tree without the tied head, one ``preprocessor_config.json`` holding the image
    processor's and the feature extractor's settings, the chat template in
    ``chat_template.json``, and sampling settings in ``generation_config.json``
    (``HUB_SAMPLING``).

The tokenizer, as Phi-4's, adds no BOS; it names its image and audio tokens
(``<|image|>``, ``<|audio|>``) as the processor reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny.common import INIT_RANGE, TinyModel, build_bpe_tokenizer, perturb_constants, write_safetensors

FAMILIES = ("phi4_multimodal",)
LAYOUTS = ("transformers", "hub")

SPECIAL_TOKENS = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                  "<|image|>", "<|audio|>", "<|tool|>", "<|/tool|>")
MEDIA_TOKENS = {"image_token": "<|image|>", "audio_token": "<|audio|>"}

# Phi-4-multimodal's template in shape: <|role|>content<|end|>, an image part as
# <|image|> and an audio part as <|audio|> (each expanded by the processor).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif content['type'] == 'audio' %}{{ '<|audio|>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

CROP = 64
PATCH = 2
MAX_CROPS = 4
ROPE_THETA = 7_000.0  # far from the default
ROTARY_PAIRS = 6  # head_dim 16, partial_rotary_factor 0.75: 12 rotated dims
SHORT_FACTOR = [1.0, 1.3, 1.9, 2.6, 4.0, 5.5]
LONG_FACTOR = [1.0, 2.0, 4.5, 9.0, 15.0, 30.0]
ORIGINAL_MAX_POSITIONS = 4096
HUB_SAMPLING = {"temperature": 0.7, "top_p": 0.9}
IMAGE_SETTINGS = dict(size={"height": CROP, "width": CROP}, patch_size=PATCH, dynamic_hd=MAX_CROPS)
AUDIO_SETTINGS = dict(audio_compression_rate=8, audio_downsample_rate=1, audio_feat_stride=1)


def build_tokenizer():
    tokenizer = build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="<|endoftext|>",
        bos_token="<|endoftext|>", pad_token="<|endoftext|>", extra_special_tokens=MEDIA_TOKENS,
    )
    return tokenizer


def build_image_processor():
    from mlxvlm.models.phi4_multimodal_images import Phi4MultimodalImageProcessorPil

    return Phi4MultimodalImageProcessorPil(**IMAGE_SETTINGS)


def build_feature_extractor():
    from mlxvlm.models.phi4_multimodal_audio_features import Phi4MultimodalFeatureExtractorNumpy

    return Phi4MultimodalFeatureExtractorNumpy(**AUDIO_SETTINGS)


def reference_processor(tiny: TinyModel):
    """transformers' own Phi4MultimodalProcessor: its torchvision image processor and its
    torch feature extractor, over the tiny model's tokenizer."""
    from transformers import (
        Phi4MultimodalFeatureExtractor,
        Phi4MultimodalImageProcessor,
        Phi4MultimodalProcessor,
    )

    return Phi4MultimodalProcessor(
        image_processor=Phi4MultimodalImageProcessor(**IMAGE_SETTINGS),
        audio_processor=Phi4MultimodalFeatureExtractor(**AUDIO_SETTINGS),
        tokenizer=tiny.tokenizer, chat_template=CHAT_TEMPLATE,
    )


def _config(tokenizer):
    from transformers import Phi4MultimodalConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                  image_size=CROP, patch_size=PATCH, crop_size=CROP, feature_layer=-2,
                  image_token_id=ids["<|image|>"])
    audio = dict(hidden_size=32, intermediate_size=48, num_blocks=2, num_attention_heads=4,
                 chunk_size=4, left_chunk=1, ext_pw_out_channel=32,
                 depthwise_separable_out_channel=32, kernel_size=3, input_size=80,
                 time_reduction=8, bias_max_distance=16, nemo_conv_channels=8,
                 audio_token_id=ids["<|audio|>"], initializer_range=INIT_RANGE)
    return Phi4MultimodalConfig(
        vocab_size=(len(tokenizer) + 15) // 16 * 16, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=131072, original_max_position_embeddings=ORIGINAL_MAX_POSITIONS,
        rope_parameters={"rope_type": "longrope", "rope_theta": ROPE_THETA,
                         "partial_rotary_factor": 0.75, "short_factor": SHORT_FACTOR,
                         "long_factor": LONG_FACTOR,
                         "original_max_position_embeddings": ORIGINAL_MAX_POSITIONS},
        rms_norm_eps=1e-5, initializer_range=INIT_RANGE, tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|endoftext|>"], ids["<|end|>"]],
        vision_config=vision, audio_config=audio,
    )


# Picked so that every parity prompt gets 24 greedy tokens with clear top-1/top-2 margins.
SEED_OFFSET = {"phi4_multimodal": 0}


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import Phi4MultimodalForCausalLM

    tokenizer = build_tokenizer()
    seed += SEED_OFFSET.get(family, 0)
    torch.manual_seed(seed)
    model = Phi4MultimodalForCausalLM(_config(tokenizer)).float().eval()
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        # transformers initializes the vision tower's projections at unit scale, which at
        # these widths grows its states to hundreds (float32 noise past the tolerance)
        for name, param in model.named_parameters():
            if "embed_tokens_extend" in name and name.endswith(".weight") and param.ndim >= 2 \
                    and "position_embedding" not in name and "bias_values" not in name:
                # the projections into the text width at the text embeddings' scale, so
                # that the answers depend on the prompt's text as well as its media
                scale = INIT_RANGE / 4 if "img_projection" in name else INIT_RANGE
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():  # the constant-initialized parameters and buffers off their init
        for name, param in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("feature_extensor", ".b1", ".b2")):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            elif name.endswith("global_mean"):  # about a clip's log-mel levels
                param.copy_(12.0 + 2.0 * torch.randn(param.shape, generator=generator))
            elif name.endswith("global_invstd"):
                param.copy_(0.2 + 0.1 * torch.rand(param.shape, generator=generator))
            elif name.endswith("position_embedding.weight"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                                            tokenizer.convert_tokens_to_ids("<|end|>")]
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return TinyModel(family, model, tokenizer, build_image_processor())


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    if layout == "transformers":
        _save_processor(tiny, directory)
    elif layout == "hub":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
        weights = {name: value.detach().numpy().copy()
                   for name, value in tiny.model.state_dict().items() if name != "lm_head.weight"}
        write_safetensors(weights, directory)
        _save_hub_processor_files(tiny, directory)
        generation = json.loads((directory / "generation_config.json").read_text())
        generation.update(do_sample=True, **HUB_SAMPLING)
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    else:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    return directory


def _tokenizer_files(tiny: TinyModel, directory: Path) -> None:
    tiny.tokenizer.save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config["extra_special_tokens"] = MEDIA_TOKENS
    config["add_bos_token"] = False
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "chat_template.jinja").unlink(missing_ok=True)


def _processor_settings() -> tuple[dict, dict]:
    image = {**build_image_processor().to_dict(), "image_processor_type": "Phi4MultimodalImageProcessor"}
    audio = {**build_feature_extractor().to_dict(),
             "feature_extractor_type": "Phi4MultimodalFeatureExtractor"}
    audio.pop("mel_filters", None)
    return image, audio


def _save_processor(tiny: TinyModel, directory: Path) -> None:
    """What Phi4MultimodalProcessor's save_pretrained writes in transformers 5: the
    tokenizer's files, chat_template.jinja and processor_config.json nesting the
    sub-processors' settings."""
    _tokenizer_files(tiny, directory)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    image, audio = _processor_settings()
    (directory / "processor_config.json").write_text(json.dumps({
        "image_processor": image, "audio_processor": audio,
        "processor_class": "Phi4MultimodalProcessor",
    }, indent=2, default=str))


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> the Hub's (transformers 4.5x's spellings)."""
    hub = {k: v for k, v in config.items() if k not in ("dtype", "rope_parameters")}
    rope = config["rope_parameters"]
    hub.update(
        rope_scaling={"type": "longrope", "short_factor": rope["short_factor"],
                      "long_factor": rope["long_factor"]},
        rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
        torch_dtype="bfloat16", transformers_version="4.50.0.dev0",
    )
    for sub in ("vision_config", "audio_config"):
        hub[sub] = {k: v for k, v in config[sub].items() if k != "dtype"}
    return hub


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    for name in ("processor_config.json", "preprocessor_config.json", "chat_template.jinja",
                 "tokenizer_config.json", "tokenizer.json"):
        (directory / name).unlink(missing_ok=True)
    image, audio = _processor_settings()
    merged = {**image, **audio, "image_processor_type": "Phi4MultimodalImageProcessorFast",
              "processor_class": "Phi4MultimodalProcessor"}
    (directory / "preprocessor_config.json").write_text(json.dumps(merged, indent=2, default=str))
    _tokenizer_files(tiny, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["processor_class"] = "Phi4MultimodalProcessor"
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
