"""Tiny Gemma 3n checkpoints (see tests/tiny/__init__.py), in two layouts:

``"transformers"``
    Exactly what transformers 5's ``save_pretrained`` writes for the model and the processor:
    ``text_config`` with per-layer-type ``rope_parameters``, tensors named ``model.*`` and
    ``lm_head.weight``, ``processor_config.json`` holding the image processor's and the
    feature extractor's settings.
``"hub"``
    google/gemma-3n-E2B-it's layout: ``rope_theta`` / ``rope_local_base_freq`` /
    ``rope_scaling: null`` in place of ``rope_parameters``, the tied head left out of the
    safetensors, ``preprocessor_config.json`` and ``processor_config.json`` apart, the chat
    template in ``chat_template.json``.

The text model is E2B-shaped in miniature: sliding and global layers (window 16, shorter
than every prompt), the last two layers sharing the KV of the last concrete layer of their
type, MatFormer-style per-layer MLP widths, activation sparsity on the first layers,
AltUp with 4 inputs, Laurel, per-layer inputs and final-logit soft-capping. Both rope θ are
off their defaults. The vision tower is MobileNetV5 with a small block layout given in
``vision_config.model_args`` (edge-residual, universal inverted residual and multi-query
attention blocks, one with strided keys/values, and the multi-scale fusion adapter pooling
an 8 x 8 map to 4 x 4 = 16 soft tokens). The token ids are laid out as Gemma 3n's are: text,
then the vision vocabulary (``<end_of_image>``, ``<image_soft_token>``), then the audio one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny.common import INIT_RANGE, TinyModel, build_bpe_tokenizer, perturb_constants, write_safetensors

FAMILIES = ("gemma3n",)
LAYOUTS = ("transformers", "hub")

TEXT_SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
    "<start_of_audio>",
)
# Gemma 3n's vision and audio vocabularies: hard tokens embedded by their own embedders.
MULTIMODAL_VOCAB = 4
VISION_TOKENS = ("<end_of_image>", "<image_soft_token>", "<unused_vision_2>", "<unused_vision_3>")
AUDIO_TOKENS = ("<end_of_audio>", "<audio_soft_token>", "<unused_audio_2>", "<unused_audio_3>")

# Gemma 3n's chat template, less the system-prompt folding the tests do not use.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'audio' %}<audio_soft_token>"
    "{% elif item['type'] == 'image' %}<image_soft_token>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

IMAGE_SIZE = 128
VISION_TOKENS_PER_IMAGE = 16
AUDIO_TOKENS_PER_CLIP = 16
SLIDING_WINDOW = 16
GLOBAL_ROPE_THETA = 20_000.0
LOCAL_ROPE_THETA = 500.0
MEL_BINS = 32

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
               "sliding_attention", "full_attention"]
NUM_KV_SHARED_LAYERS = 2
INTERMEDIATE_SIZES = [96, 128, 96, 64, 96, 128]  # MatFormer: widths per layer
ACTIVATION_SPARSITY = [0.95, 0.95, 0.0, 0.0, 0.0, 0.0]

# A small MobileNetV5 layout in timm's block strings (type_repeats_kernels_stride_...):
# stem 128 -> 64, then strides 2 per stage to 4 x 4; stage 2 holds multi-query attention
# with strided keys/values ("v2"), stage 3 one without.
ARCH = [
    ["er_r1_k3_s2_e4_c16"],
    ["uir_r1_a3_k5_s2_e4_c24", "uir_r1_a3_k0_s1_e2_c24"],
    ["uir_r1_a5_k5_s2_e4_c32", "mqa_r1_k3_h2_v2_s1_d8_c32", "uir_r1_a0_k0_s1_e2_c32"],
    ["uir_r1_a5_k5_s2_e4_c40", "mqa_r1_k3_h2_s1_d8_c40", "uir_r1_a0_k0_s1_e2_c40"],
]


def vision_model_args() -> dict:
    """timm's ``create_model`` arguments for the small layout: the decoded block arguments
    (as JSON holds them) and a smaller stem and fusion output."""
    from timm.models._efficientnet_builder import decode_arch_def

    return {"block_args": decode_arch_def(ARCH), "stem_size": 16, "msfa_output_resolution": 4}


def build_tokenizer():
    from transformers import PreTrainedTokenizerFast

    bpe = build_bpe_tokenizer(
        TEXT_SPECIAL_TOKENS + VISION_TOKENS + AUDIO_TOKENS, chat_template=CHAT_TEMPLATE,
        eos_token="<eos>", pad_token="<pad>", bos_token="<bos>",
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe.backend_tokenizer, bos_token="<bos>", eos_token="<eos>",
        pad_token="<pad>", errors="replace",
        extra_special_tokens={
            "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>", "boa_token": "<start_of_audio>",
            "eoa_token": "<end_of_audio>", "audio_token": "<audio_soft_token>",
        },
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_processor(tokenizer, image_processor=None, feature_extractor=None):
    from transformers import Gemma3nAudioFeatureExtractor, Gemma3nProcessor, SiglipImageProcessorPil

    image_processor = image_processor or SiglipImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )
    feature_extractor = feature_extractor or Gemma3nAudioFeatureExtractor(feature_size=MEL_BINS)
    return Gemma3nProcessor(
        feature_extractor=feature_extractor, image_processor=image_processor, tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE, image_seq_length=VISION_TOKENS_PER_IMAGE,
        audio_seq_length=AUDIO_TOKENS_PER_CLIP,
    )


def reference_processor(tiny: TinyModel):
    """transformers' processor over the tiny model's in-memory parts."""
    return build_processor(tiny.tokenizer, tiny.image_processor, tiny.feature_extractor)


def token_ids(tokenizer) -> dict:
    def tid(t):
        return tokenizer.convert_tokens_to_ids(t)

    return dict(
        pad=tid("<pad>"), eos=tid("<eos>"), bos=tid("<bos>"), end_of_turn=tid("<end_of_turn>"),
        boi=tid("<start_of_image>"), eoi=tid("<end_of_image>"), image=tid("<image_soft_token>"),
        boa=tid("<start_of_audio>"), eoa=tid("<end_of_audio>"), audio=tid("<audio_soft_token>"),
        vision_offset=tid(VISION_TOKENS[0]), audio_offset=tid(AUDIO_TOKENS[0]),
    )


def _config(tokenizer):
    from transformers import Gemma3nConfig

    ids = token_ids(tokenizer)
    assert ids["audio_offset"] == ids["vision_offset"] + MULTIMODAL_VOCAB == len(tokenizer) - MULTIMODAL_VOCAB
    text = dict(
        vocab_size=len(tokenizer),
        vocab_size_per_layer_input=ids["vision_offset"],
        hidden_size=64,
        hidden_size_per_layer_input=16,
        intermediate_size=INTERMEDIATE_SIZES,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        num_kv_shared_layers=NUM_KV_SHARED_LAYERS,
        activation_sparsity_pattern=ACTIVATION_SPARSITY,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=SLIDING_WINDOW,
        max_position_embeddings=1024,
        laurel_rank=8,
        altup_num_inputs=4,
        final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": GLOBAL_ROPE_THETA},
            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_THETA},
        },
        initializer_range=INIT_RANGE,
        pad_token_id=ids["pad"], bos_token_id=ids["bos"], eos_token_id=[ids["eos"], ids["end_of_turn"]],
    )
    vision = dict(
        architecture="mobilenetv5_300m_enc", model_args=vision_model_args(), hidden_size=2048,
        vocab_size=MULTIMODAL_VOCAB, vocab_offset=ids["vision_offset"], initializer_range=INIT_RANGE,
        label_names=[], num_classes=0,
    )
    audio = dict(
        input_feat_size=MEL_BINS, hidden_size=32, conf_num_attention_heads=2,
        conf_num_hidden_layers=2, sscp_conv_channel_size=[8, 4], conf_attention_chunk_size=4,
        conf_attention_context_left=5, conf_attention_context_right=0, conf_reduction_factor=2,
        vocab_size=MULTIMODAL_VOCAB, vocab_offset=ids["audio_offset"],
    )
    return Gemma3nConfig(
        text_config=text, vision_config=vision, audio_config=audio,
        vision_soft_tokens_per_image=VISION_TOKENS_PER_IMAGE,
        audio_soft_tokens_per_image=AUDIO_TOKENS_PER_CLIP,
        boi_token_id=ids["boi"], eoi_token_id=ids["eoi"], image_token_id=ids["image"],
        boa_token_id=ids["boa"], eoa_token_id=ids["eoa"], audio_token_id=ids["audio"],
        initializer_range=INIT_RANGE,
    )


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import Gemma3nForConditionalGeneration

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Gemma3nForConditionalGeneration(_config(tokenizer)).float().eval()
    # timm builds the tower by consuming the block arguments it is given (in place):
    # the config keeps them as JSON holds them.
    model.config.vision_config.model_args = vision_model_args()
    generator = torch.Generator().manual_seed(seed + 1)
    _randomize(model, generator)
    ids = token_ids(tokenizer)
    model.generation_config.bos_token_id = ids["bos"]
    model.generation_config.eos_token_id = [ids["eos"], ids["end_of_turn"]]
    model.generation_config.pad_token_id = ids["pad"]
    processor = build_processor(tokenizer)
    tiny = TinyModel(family, model, tokenizer, processor.image_processor)
    tiny.feature_extractor = processor.feature_extractor
    return tiny


def _randomize(model, generator) -> None:
    """Weights a tiny model's output depends on: transformers and timm initialise AltUp's
    output scale and coefficients to zero, MobileNetV5's layer scales to 1e-5 and its
    norms to one; all are drawn at random here."""
    import torch

    perturb_constants(model, generator)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("correct_output_scale", "correction_coefs.weight",
                              "prediction_coefs.weight", "layer_scale.gamma")):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            elif "vision_tower" in name and name.endswith(("norm.weight", "bn.weight", "bn1.weight", "bn2.weight")):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    if layout == "transformers":
        reference_processor(tiny).save_pretrained(directory)
        return directory
    if layout != "hub":
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(hub_config(config), indent=2))
    write_safetensors(hub_weights(tiny.model), directory)
    _save_hub_processor_files(tiny, directory)
    return directory


def hub_weights(model) -> dict[str, np.ndarray]:
    """The tensors as google/gemma-3n-*-it's safetensors hold them (tied head left out)."""
    return {
        name: value.detach().cpu().numpy()
        for name, value in model.state_dict().items()
        if name != "lm_head.weight"
    }


def hub_config(config: dict) -> dict:
    """transformers 5's config.json -> the layout of google/gemma-3n-*-it's."""
    config = json.loads(json.dumps(config))
    text = config["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope["full_attention"]["rope_theta"]
    text["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    text["rope_scaling"] = None
    text.pop("dtype", None)
    config["torch_dtype"] = "float32"
    config.pop("dtype", None)
    config["transformers_version"] = "4.53.0.dev0"
    return config


def _save_hub_processor_files(tiny: TinyModel, directory: Path) -> None:
    for name in ("processor_config.json", "chat_template.jinja", "preprocessor_config.json"):
        (directory / name).unlink(missing_ok=True)
    # One preprocessor_config.json for the image processor and the feature extractor.
    preprocessor = json.loads(tiny.feature_extractor.to_json_string())
    preprocessor.update(json.loads(tiny.image_processor.to_json_string()))
    preprocessor.update(image_processor_type="SiglipImageProcessorFast",
                        feature_extractor_type="Gemma3nAudioFeatureExtractor",
                        processor_class="Gemma3nProcessor")
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    (directory / "processor_config.json").write_text(json.dumps(
        {"audio_seq_length": AUDIO_TOKENS_PER_CLIP, "image_seq_length": VISION_TOKENS_PER_IMAGE,
         "processor_class": "Gemma3nProcessor"}, indent=2))
    tiny.tokenizer.save_pretrained(directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
