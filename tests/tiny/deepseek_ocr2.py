"""A tiny DeepSeek-OCR 2 (``deepseek_ocr2``) checkpoint, built offline from transformers'
``DeepseekOcr2ForConditionalGeneration`` with random float32 weights.

The encoder's query counts are fixed (256 for a view whose map has more than 144
tokens, else 144), so the sizes are picked around them: a 256-px global view in SAM
patches of 5 px is 51 x 51 patches, 13 x 13 = 169 tokens after the two stride-2
convolutions (256 queries); a 192-px tile is 38 x 38 patches, 10 x 10 tokens (144
queries); the processor counts 256 and 144 placeholders (its patch size 4, 256 / 16 and
192 / 16 per side). A tile's 38 x 38 patches meet the 51 x 51 position table and the
global block's relative tables resized, as 768-px tiles do on the real 1024-px tables.
Windows of 5 patches pad both maps. The text model is DeepSeek-MoE with
a dense first layer, then 4 routed experts (top 2) and a shared one, grouped KV heads.

The tokenizer adds BOS (``<｜begin▁of▁sentence｜>``) as DeepSeek's does and carries the
model card's special tokens (``<image>``, ``<|grounding|>``, ``<|ref|>``...).

Layouts:

``"transformers"``
    what transformers 5's ``save_pretrained`` writes (fused experts; the chat template
    mlxvlm gives the family, ``deepseek_ocr2.CHAT_TEMPLATE``, in chat_template.jinja).
``"hub"``
    the Hub's original tensor names (``model.sam_model.blocks.N.norm1``,
    ``model.qwen2_model.model.model.layers``, ``model.projector.layers``,
    ``model.view_seperator``, one tensor per expert), which transformers renames as it
    loads; no chat template (the model card prompts with plain text).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tiny.common import TinyModel, build_bpe_tokenizer, perturb_constants, write_safetensors

FAMILIES = ("deepseek_ocr2",)
LAYOUTS = ("transformers", "hub")

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD, "<image>", "<|grounding|>", "<|ref|>", "<|/ref|>",
                  "<|det|>", "<|/det|>"]
GLOBAL_SIZE, TILE_SIZE = 256, 192
PATCH = 4  # the processor's: 256 / 4 / 4 = 16 -> 256 placeholders, 192 / 4 / 4 -> 144
SAM_PATCH = 5  # 256 / 5 -> 51 patches -> 13 x 13 = 169 > 144: the global queries
TEXT_ROPE_THETA = 5000.0  # far from the default 1e4: reading the wrong key changes the logits
INIT_RANGE = 0.2


def build_tokenizer():
    from tokenizers import processors

    from mlxvlm.models.deepseek_ocr2 import CHAT_TEMPLATE

    tokenizer = build_bpe_tokenizer(SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, eos_token=EOS,
                                    pad_token=PAD, bos_token=BOS)
    bos_id = tokenizer.convert_tokens_to_ids(BOS)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def build_image_processor():
    from transformers import DeepseekOcr2ImageProcessorPil

    return DeepseekOcr2ImageProcessorPil(size={"height": GLOBAL_SIZE, "width": GLOBAL_SIZE},
                                         tile_size=TILE_SIZE)


def build_processor(tokenizer, image_processor):
    from transformers import DeepseekOcr2Processor

    return DeepseekOcr2Processor(image_processor=image_processor, tokenizer=tokenizer,
                                 chat_template=tokenizer.chat_template, patch_size=PATCH,
                                 downsample_ratio=4)


def reference_processor(tiny: TinyModel):
    return build_processor(tiny.tokenizer, tiny.image_processor)


def _config(tokenizer):
    from transformers import DeepseekOcr2Config

    sam = dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2,
               image_size=GLOBAL_SIZE, patch_size=SAM_PATCH, mlp_dim=64, window_size=5,
               global_attn_indexes=[1], downsample_channels=[24, 32], initializer_range=INIT_RANGE)
    encoder = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   rope_parameters={"rope_type": "default", "rope_theta": 3000.0},
                   initializer_range=INIT_RANGE)
    text = dict(vocab_size=(len(tokenizer) + 15) // 16 * 16, hidden_size=64, intermediate_size=128,
                moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                n_shared_experts=1, mlp_layer_types=["dense", "sparse", "sparse"],
                max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": TEXT_ROPE_THETA},
                bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
                eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
                pad_token_id=tokenizer.convert_tokens_to_ids(PAD), initializer_range=INIT_RANGE)
    return DeepseekOcr2Config(vision_config={"sam_config": sam, "encoder_config": encoder},
                              text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>"))


def build_tiny_model(family: str, seed: int = 0) -> TinyModel:
    import torch
    from transformers import DeepseekOcr2ForConditionalGeneration

    tokenizer = build_tokenizer()
    # the shared seed (2) leaves the one-image answer a 3e-4 margin; seed 4 gives every
    # case (24 tokens, and 64 for the model card's prompts) its full length, margins
    # at least 2e-3
    seed += 2
    torch.manual_seed(seed)
    model = DeepseekOcr2ForConditionalGeneration(_config(tokenizer)).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    perturb_constants(model, generator)
    with torch.no_grad():  # initialized to zeros: give the tables something to say
        for name, param in model.named_parameters():
            if "rel_pos" in name or "pos_embed" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    eos = tokenizer.convert_tokens_to_ids(EOS)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids(PAD)
    return TinyModel(family, model, tokenizer, build_image_processor())


# transformers 5's names -> the Hub's originals (the inverse of the renames transformers'
# loader applies to deepseek_ocr2 checkpoints), first match wins
TO_HUB = (
    (r"^model\.vision_tower\.sam_encoder\.layers\.(\d+)\.layer_norm1\.", r"model.sam_model.blocks.\1.norm1."),
    (r"^model\.vision_tower\.sam_encoder\.layers\.(\d+)\.layer_norm2\.", r"model.sam_model.blocks.\1.norm2."),
    (r"^model\.vision_tower\.sam_encoder\.layers\.(\d+)\.", r"model.sam_model.blocks.\1."),
    (r"^model\.vision_tower\.sam_encoder\.patch_embed\.projection\.", "model.sam_model.patch_embed.proj."),
    (r"^model\.vision_tower\.sam_encoder\.pos_embed", "model.sam_model.pos_embed"),
    (r"^model\.vision_tower\.sam_encoder\.neck\.conv1\.", "model.sam_model.neck.0."),
    (r"^model\.vision_tower\.sam_encoder\.neck\.layer_norm1\.", "model.sam_model.neck.1."),
    (r"^model\.vision_tower\.sam_encoder\.neck\.conv2\.", "model.sam_model.neck.2."),
    (r"^model\.vision_tower\.sam_encoder\.neck\.layer_norm2\.", "model.sam_model.neck.3."),
    (r"^model\.vision_tower\.sam_encoder\.proj\.conv1\.", "model.sam_model.net_2."),
    (r"^model\.vision_tower\.sam_encoder\.proj\.conv2\.", "model.sam_model.net_3."),
    (r"^model\.vision_tower\.vision_encoder\.", "model.qwen2_model.model.model."),
    (r"^model\.vision_tower\.query_768_resolution\.", "model.qwen2_model.query_768."),
    (r"^model\.vision_tower\.query_1024_resolution\.", "model.qwen2_model.query_1024."),
    (r"^model\.multi_modal_projector\.", "model.projector.layers."),
    (r"^model\.view_separator", "model.view_seperator"),
    (r"^model\.language_model\.", "model."),
)


def hub_weights(weights: dict, moe_intermediate_size: int) -> dict:
    out = {}
    for name, value in weights.items():
        for pattern, replacement in TO_HUB:
            name, count = re.subn(pattern, replacement, name, count=1)
            if count:
                break
        if name.endswith(".mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(value.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = value[e, :moe_intermediate_size].copy()
                out[f"{base}{e}.up_proj.weight"] = value[e, moe_intermediate_size:].copy()
        elif name.endswith(".mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = value[e].copy()
        else:
            out[name] = value
    return out


def save_checkpoint(tiny: TinyModel, directory: str | Path, layout: str) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tiny.model.save_pretrained(directory)
    build_processor(tiny.tokenizer, tiny.image_processor).save_pretrained(directory)
    if layout == "transformers":
        return directory
    if layout != "hub":
        raise ValueError(f"unknown layout {layout!r} (choose from {LAYOUTS})")
    from safetensors.numpy import load_file

    weights = load_file(str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    write_safetensors(hub_weights(weights, config["text_config"]["moe_intermediate_size"]), directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer_config = directory / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings.pop("chat_template", None)
    tokenizer_config.write_text(json.dumps(settings, indent=2))
    return directory
