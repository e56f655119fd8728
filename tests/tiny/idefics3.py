"""Tiny Idefics3 and SmolVLM checkpoints (see tests/tiny/__init__.py), in two layouts:

``"transformers"``
    Exactly what transformers 5's ``save_pretrained`` writes for the model and processor:
    ``text_config`` with ``rope_parameters``, vision ``model_type`` ``idefics3_vision`` /
    ``smolvlm_vision``, the image processor's settings in ``processor_config.json``.
``"hub"``
    HuggingFaceTB/SmolVLM-256M-Instruct's layout (``idefics3``) or SmolVLM2's
    (``smolvlm``): ``rope_theta`` in ``text_config``, the vision config's old
    ``model_type`` with the image sizes beside it, ``preprocessor_config.json`` of the
    family's image processor, ``processor_config.json`` with ``image_seq_len`` and the chat
    template in ``chat_template.json``. Tensors are named ``model.vision_model.*``,
    ``model.connector.*``, ``model.text_model.*`` and ``lm_head.*`` in both layouts.

Tiles are 32 pixels (4 x 4 patches of 8, shuffled 2 x 2 into 4 tokens); images are first
scaled to a longest edge of 64, so a landscape photo becomes 2 x 2 tiles and a wide one
1 x 2, each plus the global view. The Idefics3 model unties its LM head (as SmolVLM-256M
does), the SmolVLM one ties it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny.common import INIT_RANGE, TinyModel, build_bpe_tokenizer, perturb_constants

FAMILIES = ("idefics3", "smolvlm")
LAYOUTS = ("transformers", "hub")

ROW_COL_TOKENS = tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<end_of_utterance>",
    "<fake_token_around_image>", "<image>", "<global-img>",
) + ROW_COL_TOKENS

# SmolVLM's chat template (transformers' DEFAULT_CHAT_TEMPLATE for SmolVLM, less video).
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'] is string %}{{': ' + message['content']}}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

TILE = 32
LONGEST_EDGE = 64
PATCH = 8
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE_FACTOR**2
ROPE_THETA = {"idefics3": 3_000.0, "smolvlm": 5_000.0}  # far from Llama's default 10000


# SmolVLM2's video settings (its checkpoints' video_sampling: 1 fps, at most 64 frames).
VIDEO_SAMPLING = {"fps": 1, "max_frames": 64, "video_size": {"longest_edge": LONGEST_EDGE}}
VIDEO_PROCESSOR = {
    "video_processor_type": "SmolVLMVideoProcessor", "video_sampling": VIDEO_SAMPLING,
    "size": {"longest_edge": LONGEST_EDGE}, "max_image_size": {"longest_edge": TILE},
    "resample": 1, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_pad": True,
}


def build_tokenizer():
    return build_bpe_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token="<end_of_utterance>",
        pad_token="<|im_end|>", bos_token="<|im_start|>",
    )


def image_processor_class(family: str):
    from transformers import Idefics3ImageProcessorPil, SmolVLMImageProcessorPil

    return {"idefics3": Idefics3ImageProcessorPil, "smolvlm": SmolVLMImageProcessorPil}[family]


def build_image_processor(family: str):
    return image_processor_class(family)(
        size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE},
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )


def build_processor(tokenizer, image_processor):
    """The processor transformers pairs with both families' images (SmolVLM's own needs
    torchvision for its video processor)."""
    from transformers import Idefics3Processor

    return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                             image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)


def reference_processor(tiny: TinyModel):
    """transformers' processor over the tiny model's in-memory parts."""
    return build_processor(tiny.tokenizer, tiny.image_processor)


def _config(family: str, tokenizer):
    from transformers import Idefics3Config, SmolVLMConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        model_type="llama",
        vocab_size=(len(tokenizer) + 15) // 16 * 16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA[family]},
        initializer_range=INIT_RANGE,
        bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<end_of_utterance>"],
        pad_token_id=ids["<|im_end|>"],
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=TILE, patch_size=PATCH, initializer_range=INIT_RANGE)
    config_class = {"idefics3": Idefics3Config, "smolvlm": SmolVLMConfig}[family]
    return config_class(text_config=text, vision_config=vision, scale_factor=SCALE_FACTOR,
                        image_token_id=ids["<image>"], tie_word_embeddings=family == "smolvlm")


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration

    tokenizer = build_tokenizer()
    model_class = {"idefics3": Idefics3ForConditionalGeneration,
                   "smolvlm": SmolVLMForConditionalGeneration}[family]
    torch.manual_seed(seed)
    model = model_class(_config(family, tokenizer)).float().eval()
    perturb_constants(model, torch.Generator().manual_seed(seed + 1))
    model.generation_config.bos_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return TinyModel(family, model, tokenizer, build_image_processor(family))


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    if layout == "transformers":
        build_processor(tiny.tokenizer, tiny.image_processor).save_pretrained(directory)
        if tiny.family == "smolvlm":  # as SmolVLMProcessor.save_pretrained nests it
            config = json.loads((directory / "processor_config.json").read_text())
            config["video_processor"] = VIDEO_PROCESSOR
            (directory / "processor_config.json").write_text(json.dumps(config, indent=2))
    elif layout == "hub":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
        _save_hub_processor_files(tiny, directory)
    else:
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    return directory


# Keys SmolVLM's text_config carries, in their old spellings (rope_theta for rope_parameters).
_HUB_TEXT_KEYS = ("head_dim", "hidden_size", "intermediate_size", "max_position_embeddings",
                  "model_type", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                  "pad_token_id", "bos_token_id", "eos_token_id", "rms_norm_eps",
                  "tie_word_embeddings", "vocab_size", "initializer_range")
_HUB_VISION_KEYS = ("hidden_size", "image_size", "intermediate_size", "num_attention_heads",
                    "num_hidden_layers", "patch_size", "initializer_range")


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> SmolVLM-256M-Instruct's (idefics3) or SmolVLM2's."""
    family = config["model_type"]
    text, vision = config["text_config"], config["vision_config"]
    hub_text = {k: text[k] for k in _HUB_TEXT_KEYS}
    hub_text["architectures"] = ["VLlama3ForCausalLM"]
    hub_text["rope_theta"] = text["rope_parameters"]["rope_theta"]
    hub_vision = {k: vision[k] for k in _HUB_VISION_KEYS}
    hub_vision.update(model_type=family, max_image_size={"longest_edge": TILE},
                      size={"longest_edge": LONGEST_EDGE}, use_base_siglip=False)
    if family == "smolvlm":
        hub_vision["model_type"] = "smolvlm_vision"
    architecture = {"idefics3": "Idefics3ForConditionalGeneration",
                    "smolvlm": "SmolVLMForConditionalGeneration"}[family]
    return {
        "architectures": [architecture],
        "image_token_id": config["image_token_id"],
        "model_type": family,
        "scale_factor": config["scale_factor"],
        "text_config": hub_text,
        "tie_word_embeddings": config["tie_word_embeddings"],
        "torch_dtype": "float32",
        "transformers_version": "4.46.0" if family == "idefics3" else "4.50.0.dev0",
        "use_cache": True,
        "vision_config": hub_vision,
        "vocab_size": text["vocab_size"],
    }


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    family = tiny.family
    processor_class = {"idefics3": "Idefics3Processor", "smolvlm": "SmolVLMProcessor"}[family]
    preprocessor = {
        "do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True,
        "do_rescale": True, "do_resize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "image_processor_type": {"idefics3": "Idefics3ImageProcessor",
                                 "smolvlm": "SmolVLMImageProcessor"}[family],
        "max_image_size": {"longest_edge": TILE}, "processor_class": processor_class,
        "resample": 1, "rescale_factor": 1 / 255, "size": {"longest_edge": LONGEST_EDGE},
    }
    if family == "smolvlm":
        preprocessor["video_sampling"] = VIDEO_SAMPLING
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (directory / "processor_config.json").write_text(json.dumps(
        {"image_seq_len": IMAGE_SEQ_LEN, "processor_class": processor_class}, indent=2))
    tiny.tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
