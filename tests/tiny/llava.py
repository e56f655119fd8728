"""Tiny LLaVA-family checkpoints (LLaVA 1.5, LLaVA-NeXT, LLaVA-OneVision) for parity tests.

Each is a randomly initialised transformers model (float32) with the family's usual
backbones — llama for LLaVA 1.5, mistral (no sliding window, as llava-v1.6-mistral)
for LLaVA-NeXT, qwen2 with a SigLIP tower for OneVision — a byte-level BPE
tokenizer with the family's special tokens and a chat template in the style of its
real checkpoints, and the PIL image processor at tiny tile sizes (42 px tiles of 14 px
patches, AnyRes pinpoints scaled down like the real ones). Saved in one of two layouts:

``"transformers"``
    Everything as transformers 5's ``save_pretrained`` writes it: ``config.json`` with
    complete sub-configs and ``rope_parameters``, ``processor_config.json`` holding the
    image processor, and tensors named ``language_model.model.*``,
    ``vision_tower.embeddings.*`` (no ``vision_model.`` level).
``"hub"``
    The older layout of llava-hf's checkpoints: sub-configs holding only values that
    differ from their class defaults (so ``hidden_size`` of a llama text model may be
    missing, and the vision tower's ``hidden_act``), ``rope_theta``, ``torch_dtype``,
    ``preprocessor_config.json``, ``chat_template.json``, and tensors named
    ``vision_tower.vision_model.*``. LLaVA 1.5's has no ``processor_config.json`` (as
    before llava-hf added one), so the processor's patch size must come from the model.

Tiny random models can lie, so weights use a large init range, biases and norms are
perturbed, the text rope θ is not the default, and a tower handing over the wrong state
would fail: LLaVA's and NeXT's feature layers are not the last block, OneVision's is the
last block's output before the (perturbed) post-LayerNorm. OneVision ties its embeddings
like the 0.5b checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny.common import (
    INIT_RANGE,
    TinyModel,
    build_bpe_tokenizer,
    perturb_constants,
    write_safetensors,
)

FAMILIES = ("llava", "llava_next", "llava_onevision")
LAYOUTS = ("transformers", "hub")

TEXT_ROPE_THETA = 5000.0
PATCH = 14
TILE = 42  # vision tower input: 3 x 3 patches
# LLaVA-NeXT's [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]] at 1/8.
NEXT_PINPOINTS = [[42, 84], [84, 42], [84, 84], [126, 42], [42, 126]]
# OneVision's 384 .. 2304 square grid at 42 / 384.
ONEVISION_PINPOINTS = [[42 * i, 42 * j] for i in range(1, 7) for j in range(1, 7)]

LLAMA_TOKENS = ("<unk>", "<s>", "</s>", "<image>", "<pad>")
QWEN_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")

# Vicuna style, as llava-1.5: images first in a turn, then its text.
LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% else %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'video' %}<video>\n{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}</s>{% else %} {% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

# Mistral instruct style, as llava-v1.6-mistral.
MISTRAL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST] "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'video' %}<video>\n{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %} [/INST]"
    "{% elif message['role'] == 'assistant' %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}</s>"
    "{% endif %}"
    "{% endfor %}"
)

# Qwen ChatML, as llava-onevision-qwen2.
QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'video' %}<video>\n{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEMPLATES = {"llava": LLAVA_TEMPLATE, "llava_next": MISTRAL_TEMPLATE, "llava_onevision": QWEN_TEMPLATE}
PROCESSOR_CLASSES = {"llava": "LlavaProcessor", "llava_next": "LlavaNextProcessor",
                     "llava_onevision": "LlavaOnevisionProcessor"}
IMAGE_PROCESSOR_TYPES = {"llava": "CLIPImageProcessor", "llava_next": "LlavaNextImageProcessor",
                         "llava_onevision": "LlavaOnevisionImageProcessor"}


# ------------------------------------------------------------------------------ tokenizer


def build_tokenizer(family: str):
    if family == "llava_onevision":
        return build_bpe_tokenizer(
            QWEN_TOKENS, chat_template=TEMPLATES[family], eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
        )
    return build_bpe_tokenizer(
        LLAMA_TOKENS, chat_template=TEMPLATES[family], eos_token="</s>", pad_token="<pad>",
        bos_token="<s>",
    )


def build_image_processor(family: str):
    if family == "llava":
        from transformers import CLIPImageProcessorPil

        return CLIPImageProcessorPil(
            size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE}
        )
    if family == "llava_onevision":
        from transformers import LlavaOnevisionImageProcessorPil

        return LlavaOnevisionImageProcessorPil(
            size={"height": TILE, "width": TILE}, image_grid_pinpoints=ONEVISION_PINPOINTS
        )
    from transformers import LlavaNextImageProcessorPil

    return LlavaNextImageProcessorPil(
        size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
        image_grid_pinpoints=NEXT_PINPOINTS,
    )


def processor_options(family: str) -> dict:
    """What the processor needs besides its parts (processor_config.json)."""
    if family == "llava_onevision":
        return {"num_image_tokens": (TILE // PATCH) ** 2, "vision_feature_select_strategy": "full",
                "vision_aspect_ratio": "anyres_max_9", "image_token": "<image>",
                "video_token": "<video>"}
    return {"patch_size": PATCH, "vision_feature_select_strategy": "default",
            "num_additional_image_tokens": 1, "image_token": "<image>"}


def build_processor(tiny: TinyModel):
    """The reference processor, built from the in-memory parts (not from any files)."""
    import transformers

    processor_class = getattr(transformers, PROCESSOR_CLASSES[tiny.family])
    parts = dict(image_processor=tiny.image_processor, tokenizer=tiny.tokenizer)
    if tiny.family == "llava_onevision":  # its video processor needs torchvision
        from mlxvlm.models.processor_utils import image_only

        processor_class, parts["video_processor"] = image_only(processor_class), None
    return processor_class(
        **parts, chat_template=TEMPLATES[tiny.family], **processor_options(tiny.family)
    )


reference_processor = build_processor


# ---------------------------------------------------------------------------------- model


def _token_ids(tokenizer) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids
    if "<|im_end|>" in tokenizer.get_vocab():
        return {"bos_token_id": ids("<|endoftext|>"), "eos_token_id": ids("<|im_end|>"),
                "pad_token_id": ids("<|endoftext|>"), "image_token_index": ids("<image>"),
                "video_token_index": ids("<video>")}
    return {"bos_token_id": ids("<s>"), "eos_token_id": ids("</s>"), "pad_token_id": ids("<pad>"),
            "image_token_index": ids("<image>")}


def _config(family: str, tokenizer):
    ids = _token_ids(tokenizer)
    text = dict(
        vocab_size=(len(tokenizer) + 15) // 16 * 16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,  # llama's and mistral's default: absent from the hub config
        rope_parameters={"rope_type": "default", "rope_theta": TEXT_ROPE_THETA},
        initializer_range=INIT_RANGE,
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
    )
    # CLIP's hidden_act (quick_gelu) and layer_norm_eps are left at their defaults.
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=3, num_attention_heads=2, image_size=TILE, patch_size=PATCH,
                  initializer_range=INIT_RANGE, initializer_factor=2.0)
    common = dict(vision_config=vision, image_token_index=ids["image_token_index"],
                  vision_feature_select_strategy="default", tie_word_embeddings=False,
                  pad_token_id=ids["pad_token_id"])
    if family == "llava":
        from transformers import LlavaConfig

        return LlavaConfig(text_config={**text, "model_type": "llama"}, vision_feature_layer=-2,
                           **common)
    if family == "llava_next":
        from transformers import LlavaNextConfig

        # Two blocks' states concatenated, neither of them the last block's.
        return LlavaNextConfig(
            text_config={**text, "model_type": "mistral", "sliding_window": None},
            vision_feature_layer=[-3, -2], image_grid_pinpoints=NEXT_PINPOINTS, **common,
        )
    if family == "llava_onevision":
        from transformers import LlavaOnevisionConfig

        # SigLIP's hidden_act (gelu_pytorch_tanh) and layer_norm_eps are left at their
        # defaults; the last block's states, before the post-LayerNorm, as the real ones.
        siglip = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=3, num_attention_heads=2, image_size=TILE,
                      patch_size=PATCH, vision_use_head=False)
        return LlavaOnevisionConfig(
            text_config={**text, "model_type": "qwen2", "tie_word_embeddings": True},
            vision_config=siglip, image_token_index=ids["image_token_index"],
            video_token_index=ids["video_token_index"], vision_feature_layer=-1,
            vision_feature_select_strategy="full", image_grid_pinpoints=ONEVISION_PINPOINTS,
            vision_aspect_ratio="anyres_max_9", tie_word_embeddings=True,
            pad_token_id=ids["pad_token_id"],
        )
    raise ValueError(f"unknown family {family!r}")


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    import transformers

    tokenizer = build_tokenizer(family)
    config = _config(family, tokenizer)
    model_class = {"llava": transformers.LlavaForConditionalGeneration,
                   "llava_next": transformers.LlavaNextForConditionalGeneration,
                   "llava_onevision": transformers.LlavaOnevisionForConditionalGeneration}[family]
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    ids = _token_ids(tokenizer)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, ids[key])
    return TinyModel(family, model, tokenizer, build_image_processor(family))


# ---------------------------------------------------------------------------------- saving


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    """Write ``tiny`` into ``directory`` in ``layout`` ("transformers" or "hub")."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    if layout == "transformers":
        if tiny.family == "llava_onevision":
            _save_onevision_processor_files(tiny, directory)
        else:
            build_processor(tiny).save_pretrained(directory)
        return directory  # save_pretrained's own tensors and names
    if layout != "hub":
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
    state = tiny.model.state_dict()
    if tiny.model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    weights = {hub_name(name): value.detach().cpu().numpy() for name, value in state.items()}
    write_safetensors(weights, directory)
    _save_hub_processor_files(tiny, directory)
    return directory


def hub_name(name: str) -> str:
    """Module name -> the name in llava-hf's original safetensors."""
    for prefix, replacement in (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.vision_model.", "vision_tower.vision_model."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("model.image_newline", "image_newline"),
    ):
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    raise ValueError(f"unexpected tensor {name!r}")


# Keys transformers 5 writes that the Hub's older configs never had.
_V5_ONLY_KEYS = ("dtype", "transformers_version", "rope_parameters", "layer_types", "head_dim",
                 "output_attentions", "multimodal_projector_bias", "image_seq_length")
_TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM"}


def _diff_from_defaults(sub: dict) -> dict:
    """A sub-config as transformers 4's ``to_diff_dict`` wrote it: only non-defaults."""
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[sub["model_type"]]().to_dict()
    diff = {k: v for k, v in sub.items()
            if k not in _V5_ONLY_KEYS and (k not in defaults or defaults[k] != v)}
    diff["model_type"] = sub["model_type"]
    return diff


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> the layout of llava-hf's original checkpoints."""
    text = config["text_config"]
    hub_text = _diff_from_defaults(text)
    theta = text["rope_parameters"]["rope_theta"]
    if "rope_theta" in hub_text or theta != 10000.0:
        hub_text["rope_theta"] = theta
    hub_text["architectures"] = [_TEXT_ARCHITECTURES[text["model_type"]]]
    hub_text["torch_dtype"] = "float32"
    hub = {k: v for k, v in config.items()
           if k not in _V5_ONLY_KEYS and k not in ("text_config", "vision_config")}
    hub.update(text_config=hub_text, vision_config=_diff_from_defaults(config["vision_config"]),
               ignore_index=-100, vocab_size=text["vocab_size"], torch_dtype="float32",
               transformers_version="4.40.0.dev0")
    if config["model_type"] != "llava":
        hub["use_image_newline_parameter"] = True
    return hub


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    for name in ("processor_config.json", "chat_template.jinja"):
        (directory / name).unlink(missing_ok=True)
    tiny.tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    preprocessor = tiny.image_processor.to_dict()
    preprocessor["image_processor_type"] = IMAGE_PROCESSOR_TYPES[tiny.family]
    preprocessor["processor_class"] = PROCESSOR_CLASSES[tiny.family]
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (directory / "chat_template.json").write_text(
        json.dumps({"chat_template": TEMPLATES[tiny.family]})
    )
    if tiny.family != "llava":  # llava-1.5's snapshot predates processor_config.json
        options = {**processor_options(tiny.family), "processor_class": PROCESSOR_CLASSES[tiny.family]}
        (directory / "processor_config.json").write_text(json.dumps(options, indent=2))


def _save_onevision_processor_files(tiny: TinyModel, directory: Path) -> None:
    """What save_pretrained writes for LlavaOnevisionProcessor, which it cannot do here
    without the video processor (torchvision): sub-processors nested in
    processor_config.json, the chat template in chat_template.jinja."""
    tiny.tokenizer.save_pretrained(directory)
    image_processor = tiny.image_processor.to_dict()
    image_processor["image_processor_type"] = IMAGE_PROCESSOR_TYPES[tiny.family]
    video_processor = {"video_processor_type": "LlavaOnevisionVideoProcessor",
                       "size": {"height": TILE, "width": TILE}, "do_resize": True}
    config = {"image_processor": image_processor, "video_processor": video_processor,
              **processor_options(tiny.family), "processor_class": PROCESSOR_CLASSES[tiny.family]}
    (directory / "processor_config.json").write_text(json.dumps(config, indent=2))
    (directory / "chat_template.jinja").write_text(TEMPLATES[tiny.family])
