"""Build the benchmark checkpoints offline: real model shapes, random weights.

    python benchmarks/checkpoints.py [--only smolvlm-256m] [--no-quantized]

Writes under benchmarks/checkpoints/ (git-ignored):

- ``smolvlm-256m-bf16``: SmolVLM-256M-Instruct's shapes (Idefics3: SigLIP 12x768 at
  512 px, pixel shuffle 4, a 30-layer 576-wide Llama), bfloat16;
- ``qwen2vl-2b-bf16``: Qwen2-VL-2B-Instruct's shapes (32-layer 1280-wide ViT, 28-layer
  1536-wide Qwen2 with M-RoPE), bfloat16;
- ``qwen2vl-mid-bf16``: that tower over Qwen2-0.5B's text shapes (``distributed.py``'s);
- ``qwen2vl-small-bf16``: 4 of its tower layers over 8 text layers of 512
  (``sharded_server.py``'s);
- ``qwen2vl-0.5b-bf16``: Qwen2-0.5B's text shapes under a 4-block tower (``distributed.py``
  at reduced scale);
- ``gemma4-e2b-bf16``: google/gemma-4-E2B-it's shapes (a 35-layer 1536-wide text model
  with per-layer inputs, the last 20 layers sharing KV, a 16-layer 768-wide vision tower
  at 280 soft tokens, E2B's 12-layer audio conformer), bfloat16, in the Hub's layout;
- ``qwen3vl-embedding-2b-bf16``: Qwen/Qwen3-VL-Embedding-2B's shapes (a 24-layer
  1024-wide ViT of 16-pixel patches with DeepStack taps after blocks 5, 11 and 17, a
  28-layer 2048-wide Qwen3 decoder with interleaved M-RoPE, tied embeddings), bfloat16,
  with the sentence-transformers files (last-token pooling, normalized) that make
  ``mlxvlm.load`` recognize it as an embedding model;
- ``glm46v-flash-bf16``: zai-org/GLM-4.6V-Flash's shapes (9B: the GLM-V tower, 24 x 1536,
  over a 40-layer 4096-wide GLM-4 decoder with partial M-RoPE), bfloat16 (about 20 GB on
  disk, more while building: run it alone);
- ``glm-ocr-bf16``: zai-org/GLM-OCR's shapes (0.9B: a 24-layer 1024-wide GLM-OCR tower
  over a 16-layer 1536-wide GLM decoder with 128-wide heads), bfloat16, without its
  multi-token-prediction layer;
- ``deepseek-ocr2-bf16``: deepseek-community/DeepSeek-OCR-2's shapes (3B, about 0.6B active:
  SAM ViT-B, 12 x 768 at 1024 px with 14-patch windows, under a 24-layer 896-wide Qwen2
  query encoder; a 12-layer 1280-wide DeepSeek-MoE decoder, the first layer dense, then 64
  routed experts (6 a token) and 2 shared ones), bfloat16, with the family's plain chat
  template (a user turn renders as the model card's prompt);
- ``llama32-11b-vision-bf16``: meta-llama/Llama-3.2-11B-Vision-Instruct's shapes (a
  32+8-layer 1280-wide tiled vision encoder at 560-px tiles, up to 4 tiles; a 40-layer
  4096-wide Llama whose layers 3, 8, ..., 38 cross-attend to the image), bfloat16;
- ``internvl3_5-1b-bf16``: OpenGVLab/InternVL3_5-1B-HF's shapes (InternViT-300M: 24x1024
  at 448 px, pixel shuffle 2 (256 tokens a tile), a 28-layer 1024-wide Qwen3), bfloat16;
- ``internvl3_5-30b-a3b-bf16``: OpenGVLab/InternVL3_5-30B-A3B-HF's shapes (the same tower;
  a 48-layer 2048-wide Qwen3-MoE, 128 experts of width 768, 8 a token, untied head),
  bfloat16 (about 61 GB: built only where that fits in memory and on disk);
- ``granite-docling-bf16``: ibm-granite/granite-for-docling-500m's shapes (a 12-layer
  768-wide SigLIP tower at 512-px tiles with DeepStack taps, coarse and fine connector
  paths, a 28-layer 1024-wide Granite decoder), bfloat16, with DocTags' tags in its
  tokenizer;
- ``phi4-multimodal-bf16``: microsoft/Phi-4-multimodal-instruct's shapes in transformers'
  native layout (5.6B: a 27-layer 1152-wide SigLIP tower over 448-px crops, a 24-block
  1024-wide conformer audio encoder, a 32-layer 3072-wide Phi-4-mini decoder with
  LongRoPE on 3/4 of each head; no LoRA folders), bfloat16 (about 11 GB on disk);
- ``qwen3-omni-30b-a3b-bf16``: Qwen/Qwen3-Omni-30B-A3B-Instruct's shapes, the whole
  model that speaks (its config.json): the thinker (AuT audio encoder, 32 x 1280; a
  27-layer 1152-wide Qwen3-VL tower of 16-px patches with DeepStack taps after blocks 8,
  16 and 24; a 48-layer 2048-wide Qwen3-MoE decoder, 32 heads over 4 KV heads, experts of
  768 with 8 a token, a 152064-token vocabulary, untied head), the talker and code2wav
  (``omni_speech.py``'s), bfloat16, saved by transformers in the Hub's layout (one tensor
  per expert); each MoE keeps only as many experts as a token uses (the thinker 8 of 128,
  the talker 6 of 128: a token's work is the same), and the talker's end-of-speech code
  row is zero too, so that both greedy decodes run to their limits (10.4 GB with all
  48 decoder layers, 8.1 GB with 28: ``--text-layers`` keeps fewer, at least the 25 the
  talker taps);
- ``*-4bit`` and ``*-8bit`` of each, made with ``python -m mlxvlm.convert``.

Each is a Hugging Face checkpoint (config.json in the Hub's layout, safetensors,
tokenizer, processor and chat template) that transformers, mlx-vlm and mlxvlm all load.
The tokenizer is a word-level vocabulary as large as the model's, so every sampled id
decodes. The end-of-sequence rows of the output head are zero, so greedy decoding of the
random model never stops early and every engine generates the same number of tokens. A
448x448 image and a prompt are saved beside the weights (``benchmark.json``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
OUT = HERE / "checkpoints"

# The prompt: 80 words of one token each under the word-level tokenizer.
PROMPT = " ".join(f"w{i}" for i in range(80))

SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Parts:
    """The processor's pieces, saved the way Hub checkpoints carry them."""

    tokenizer: object
    image_processor: object
    chat_template: str
    processor_config: dict
    image_processor_type: str  # the name Hub checkpoints record
    # More settings merged into preprocessor_config.json (an audio feature extractor's)
    preprocessor_extra: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)  # more JSON files: name -> contents
    hub_config: Callable[[dict], dict] | None = None  # config.json as the Hub's writes it

    def save(self, target: Path) -> None:
        self.tokenizer.save_pretrained(target)
        self.image_processor.save_pretrained(target)
        preprocessor = target / "preprocessor_config.json"
        settings = {**self.preprocessor_extra, **json.loads(preprocessor.read_text())}
        settings["image_processor_type"] = self.image_processor_type
        settings["processor_class"] = self.processor_config["processor_class"]
        preprocessor.write_text(json.dumps(settings, indent=2))
        for name, contents in self.files.items():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_text(json.dumps(contents, indent=2))
        if self.hub_config is not None:
            config = target / "config.json"
            config.write_text(json.dumps(self.hub_config(json.loads(config.read_text())), indent=2))
        (target / "processor_config.json").write_text(json.dumps(self.processor_config, indent=2))
        (target / "chat_template.jinja").write_text(self.chat_template)


def word_level_tokenizer(vocab_size: int, special: dict[str, int], eos: str, pad: str, bos=None,
                         **extra):
    """A word-level tokenizer with ``vocab_size`` entries and the specials at their ids;
    ``extra`` goes to transformers' tokenizer (``extra_special_tokens``, for instance)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [None] * vocab_size
    for token, index in special.items():
        names[index] = token
    if names[0] is None:
        names[0] = "<unk>"
    words = iter(range(vocab_size))
    names = [name if name is not None else f"w{next(words)}" for name in names]
    vocab = {name: index for index, name in enumerate(names)}
    unk = names[0]
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, pad_token=pad,
                                   bos_token=bos, unk_token=unk, **extra)


def smolvlm_256m():
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3ImageProcessorPil)

    special = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2,
               "<fake_token_around_image>": 49189, "<image>": 49190, "<global-img>": 49152,
               "<end_of_utterance>": 49279}
    special.update({f"<row_{r}_col_{c}>": 49153 + (r - 1) * 6 + (c - 1)
                    for r in range(1, 7) for c in range(1, 7)})
    tokenizer = word_level_tokenizer(49280, special, eos="<end_of_utterance>",
                                     pad="<|im_end|>", bos="<|im_start|>")
    config = Idefics3Config(
        image_token_id=49190, scale_factor=4, tie_word_embeddings=False,
        text_config=dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49280, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_theta=100000.0, bos_token_id=1, eos_token_id=49279, pad_token_id=2,
                         tie_word_embeddings=False),
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                           num_attention_heads=12, image_size=512, patch_size=16),
    )
    # One 512-px tile per image (the 448x448 benchmark image is not split).
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 512},
                                                max_image_size={"longest_edge": 512})
    parts = Parts(tokenizer, image_processor, SMOLVLM_TEMPLATE,
                  {"processor_class": "Idefics3Processor", "image_seq_len": 64},
                  "Idefics3ImageProcessor")
    return Idefics3ForConditionalGeneration, config, parts, [49279]


def qwen2vl_2b():
    from transformers import (Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)

    special = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
               "<|vision_start|>": 151652, "<|vision_end|>": 151653,
               "<|image_pad|>": 151655, "<|video_pad|>": 151656}
    tokenizer = word_level_tokenizer(151936, special, eos="<|im_end|>", pad="<|endoftext|>")
    config = Qwen2VLConfig(
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653, tie_word_embeddings=True,
        text_config=dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]},
                         bos_token_id=151643, eos_token_id=151645),
        vision_config=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16,
                           mlp_ratio=4, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
    )
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    parts = Parts(tokenizer, image_processor, QWEN_TEMPLATE,
                  {"processor_class": "Qwen2VLProcessor"}, "Qwen2VLImageProcessor")
    return Qwen2VLForConditionalGeneration, config, parts, [151645, 151643]


def qwen2vl_mid():
    """Qwen2-VL-2B's tower and vocabulary over Qwen2-0.5B's text shapes (24 layers of 896,
    14 heads, 2 key/value heads: they split over 2 ranks), for the sharding benchmark."""
    model_class, config, parts, eos_ids = qwen2vl_2b()
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = 896, 4864, 24
    text.layer_types = text.layer_types[:24]
    text.num_attention_heads, text.num_key_value_heads = 14, 2
    text.rope_parameters = dict(text.rope_parameters, mrope_section=[8, 12, 12])  # head 64
    config.vision_config.hidden_size = 896  # the merger's output: the text width
    return model_class, config, parts, eos_ids


def qwen2vl_small():
    """A small Qwen2-VL for the sharded server's benchmark (``sharded_server.py``): 4 of
    the 2B's tower layers over 8 text layers of 512 (8 heads, 2 key/value heads: they
    split over 2 ranks), the 2B's vocabulary; small enough that two ranks and one
    process serve 4 streams each within minutes on a shared 2-core host."""
    model_class, config, parts, eos_ids = qwen2vl_mid()
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = 512, 1536, 8
    text.layer_types = text.layer_types[:8]
    text.num_attention_heads, text.num_key_value_heads = 8, 2
    config.vision_config.depth = 4
    config.vision_config.hidden_size = 512
    return model_class, config, parts, eos_ids


def qwen2vl_05b():
    """Qwen2-0.5B's text shapes and vocabulary under a 4-block tower: ``qwen2vl-mid``'s
    text model at a size two ranks and one process fit in a few GB together
    (``distributed.py`` at reduced scale)."""
    model_class, config, parts, eos_ids = qwen2vl_mid()
    config.vision_config.depth, config.vision_config.embed_dim = 4, 320
    config.vision_config.num_heads = 4
    return model_class, config, parts, eos_ids


GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}{% endfor %}"
    "{% endif %}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def gemma4_hub_config(config: dict) -> dict:
    """transformers 5's config.json -> google/gemma-4-E2B-it's: the global layers' head size
    as ``global_head_dim`` instead of ``per_layer_config``."""
    text = config["text_config"]
    overrides = next(iter((text.pop("per_layer_config", None) or {}).values()), {})
    text["global_head_dim"] = overrides.get("head_dim", text["head_dim"])
    return config


def gemma4_e2b():
    from transformers import (Gemma4AudioFeatureExtractor, Gemma4Config,
                              Gemma4ForConditionalGeneration, Gemma4ImageProcessorPil)

    special = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<|turn>": 105, "<turn|>": 106,
               "<|image>": 255999, "<|audio>": 256000, "<|image|>": 258880,
               "<|audio|>": 258881, "<image|>": 258882, "<audio|>": 258883, "<|video|>": 258884}
    tokenizer = word_level_tokenizer(
        262144, special, eos="<eos>", pad="<pad>", bos="<bos>",
        extra_special_tokens={"boi_token": "<|image>", "eoi_token": "<image|>",
                              "image_token": "<|image|>", "boa_token": "<|audio>",
                              "eoa_token": "<audio|>", "audio_token": "<|audio|>"})
    layer_types = (["sliding_attention"] * 4 + ["full_attention"]) * 7
    config = Gemma4Config(
        image_token_id=258880, audio_token_id=258881, video_token_id=258884,
        boi_token_id=255999, eoi_token_id=258882, boa_token_id=256000, eoa_token_index=258883,
        eos_token_id=[1, 106], tie_word_embeddings=True,
        text_config=dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35,
                         num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                         global_head_dim=512, sliding_window=512, layer_types=layer_types,
                         vocab_size=262144, vocab_size_per_layer_input=262144,
                         hidden_size_per_layer_input=256, num_kv_shared_layers=20,
                         use_double_wide_mlp=True, final_logit_softcapping=30.0,
                         max_position_embeddings=131072, rms_norm_eps=1e-6,
                         pad_token_id=0, bos_token_id=2, eos_token_id=[1, 106]),
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16,
                           num_attention_heads=12, num_key_value_heads=12, head_dim=64,
                           patch_size=16, pooling_kernel_size=3, position_embedding_size=10240,
                           use_clipped_linears=True, standardize=False),
        audio_config=dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8,
                          subsampling_conv_channels=[128, 32], conv_kernel_size=5,
                          attention_chunk_size=12, attention_context_left=13,
                          attention_context_right=0, output_proj_dims=1536,
                          residual_weight=0.5, use_clipped_linears=True),
    )
    image_processor = Gemma4ImageProcessorPil(patch_size=16, max_soft_tokens=280,
                                              pooling_kernel_size=3)
    video = {"video_processor_type": "Gemma4VideoProcessor", "patch_size": 16,
             "max_soft_tokens": 70, "pooling_kernel_size": 3, "processor_class": "Gemma4Processor"}
    parts = Parts(tokenizer, image_processor, GEMMA4_TEMPLATE,
                  {"processor_class": "Gemma4Processor"}, "Gemma4ImageProcessor",
                  preprocessor_extra=json.loads(Gemma4AudioFeatureExtractor().to_json_string()),
                  files={"video_preprocessor_config.json": video},
                  hub_config=gemma4_hub_config)
    return Gemma4ForConditionalGeneration, config, parts, [1, 106]


def qwen3vl_embedding_2b():
    """Qwen/Qwen3-VL-Embedding-2B's shapes (its config.json, transformers 5's layout) and
    sentence-transformers files: ``modules.json`` of Transformer, last-token Pooling and
    Normalize, as the Hub repo's."""
    from transformers import (Qwen2VLImageProcessorPil, Qwen3VLConfig,
                              Qwen3VLForConditionalGeneration)

    special = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
               "<|vision_start|>": 151652, "<|vision_end|>": 151653,
               "<|image_pad|>": 151655, "<|video_pad|>": 151656}
    tokenizer = word_level_tokenizer(151936, special, eos="<|im_end|>", pad="<|endoftext|>")
    config = Qwen3VLConfig(
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653, tie_word_embeddings=True,
        text_config=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                          "mrope_section": [24, 20, 20],
                                          "mrope_interleaved": True},
                         bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=True),
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                           out_hidden_size=2048, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, num_position_embeddings=2304,
                           deepstack_visual_indexes=[5, 11, 17]),
    )
    # The embedder sizes images itself (4 to 1800 merged tokens of 32 px); these limits
    # are Qwen3-VL's preprocessor_config.json's.
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16, min_pixels=65536, max_pixels=16777216,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    video = {"video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
             "size": {"shortest_edge": 4096, "longest_edge": 25165824}, "patch_size": 16,
             "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "do_sample_frames": True, "fps": 2,
             "min_frames": 4, "max_frames": 768}
    modules = [
        {"idx": 0, "name": "0", "path": "",
         "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.base.modules.normalize.Normalize"},
    ]
    pooling = {"embedding_dimension": 2048, "pooling_mode": "lasttoken", "include_prompt": True}
    parts = Parts(tokenizer, image_processor, QWEN_TEMPLATE,
                  {"processor_class": "Qwen3VLProcessor"}, "Qwen2VLImageProcessor",
                  files={"video_preprocessor_config.json": video, "modules.json": modules,
                         "1_Pooling/config.json": pooling, "2_Normalize/config.json": {}})
    return Qwen3VLForConditionalGeneration, config, parts, [151645, 151643]
GLM_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n<think></think>\n{% endif %}"
)


def glm46v_flash():
    """zai-org/GLM-4.6V-Flash's shapes: a 24-layer 1536-wide GLM-V tower (336-px position
    table, 2 x 2 merging convolution) over a 40-layer 4096-wide GLM-4 decoder (32 heads,
    2 key/value heads, half of each head under M-RoPE)."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration, Glm46VImageProcessorPil

    special = {"<|endoftext|>": 151329, "[gMASK]": 151331, "<sop>": 151333,
               "<|system|>": 151335, "<|user|>": 151336, "<|assistant|>": 151337,
               "<|observation|>": 151338, "<|begin_of_image|>": 151339,
               "<|end_of_image|>": 151340, "<|begin_of_video|>": 151341,
               "<|end_of_video|>": 151342, "<|image|>": 151343, "<|video|>": 151344,
               "<think>": 151350, "</think>": 151351}
    tokenizer = word_level_tokenizer(151552, special, eos="<|endoftext|>", pad="<|endoftext|>")
    eos_ids = [151329, 151336, 151338]
    config = Glm4vConfig(
        image_token_id=151343, video_token_id=151344, image_start_token_id=151339,
        image_end_token_id=151340, video_start_token_id=151341, video_end_token_id=151342,
        tie_word_embeddings=False,
        text_config=dict(hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                         num_attention_heads=32, num_key_value_heads=2, vocab_size=151552,
                         max_position_embeddings=131072, rms_norm_eps=1e-5,
                         attention_bias=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0,
                                          "mrope_section": [8, 12, 12],
                                          "partial_rotary_factor": 0.5},
                         pad_token_id=151329, eos_token_id=eos_ids),
        vision_config=dict(depth=24, hidden_size=1536, num_heads=12, out_hidden_size=4096,
                           intermediate_size=13696, image_size=336, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, rms_norm_eps=1e-5),
    )
    image_processor = Glm46VImageProcessorPil(
        size={"shortest_edge": 12544, "longest_edge": 47040000})
    parts = Parts(tokenizer, image_processor, GLM_TEMPLATE,
                  {"processor_class": "Glm46VProcessor"}, "Glm46VImageProcessor")
    return Glm4vForConditionalGeneration, config, parts, eos_ids
# GLM-OCR answers without a thinking block
GLM_OCR_TEMPLATE = GLM_TEMPLATE.replace("<|assistant|>\n<think></think>\n", "<|assistant|>\n")


def glm_ocr():
    """zai-org/GLM-OCR's shapes (0.9B: a 24-layer 1024-wide GLM-OCR tower with q/k norms and
    biases, no position table, over a 16-layer 1536-wide GLM decoder with 128-wide heads,
    16 query and 8 key/value heads, the whole head under M-RoPE), with its
    multi-token-prediction layer left out (transformers does not build it)."""
    from transformers import GlmOcrConfig, GlmOcrForConditionalGeneration, Glm46VImageProcessorPil

    names = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
             "<|user|>", "<|assistant|>", "<|observation|>", "<|begin_of_image|>",
             "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>")
    special = {name: 59246 + index for index, name in enumerate(names)}
    special.update({"<|image|>": 59280, "<|video|>": 59281})
    tokenizer = word_level_tokenizer(59392, special, eos="<|endoftext|>", pad="<|endoftext|>")
    eos_ids = [59246, 59253]
    config = GlmOcrConfig(
        image_token_id=59280, video_token_id=59281, image_start_token_id=59256,
        image_end_token_id=59257, video_start_token_id=59258, video_end_token_id=59259,
        tie_word_embeddings=False,
        text_config=dict(hidden_size=1536, intermediate_size=4608, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         vocab_size=59392, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [16, 24, 24],
                                          "partial_rotary_factor": 1.0},
                         pad_token_id=59246, eos_token_id=eos_ids),
        vision_config=dict(depth=24, hidden_size=1024, num_heads=16, out_hidden_size=1536,
                           intermediate_size=4096, attention_bias=True, image_size=336,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           rms_norm_eps=1e-5),
    )
    image_processor = Glm46VImageProcessorPil(
        size={"shortest_edge": 12544, "longest_edge": 9633792})
    parts = Parts(tokenizer, image_processor, GLM_OCR_TEMPLATE,
                  {"processor_class": "Glm46VProcessor"}, "Glm46VImageProcessor")
    return GlmOcrForConditionalGeneration, config, parts, eos_ids


def deepseek_ocr2():
    """deepseek-community/DeepSeek-OCR-2's shapes: SAM ViT-B (12 x 768, 12 heads, 14-patch
    windows, global attention in blocks 2, 5, 8 and 11, a 1024-px table of 16-px patches,
    the neck to 256 channels and two stride-2 convolutions to 896) under a Qwen2-0.5B-sized
    query encoder (24 x 896, 14 heads over 2 KV heads), over DeepSeek-OCR's DeepSeek-MoE
    decoder (12 x 1280, 10 heads, a dense first layer of 6848, then 64 routed experts of 896
    with 6 a token and 2 shared ones; a 129280-token vocabulary)."""
    from transformers import (DeepseekOcr2Config, DeepseekOcr2ForConditionalGeneration,
                              DeepseekOcr2ImageProcessorPil)

    from mlxvlm.models.deepseek_ocr2 import CHAT_TEMPLATE

    special = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2,
               "<image>": 128815, "<|grounding|>": 128816, "<|ref|>": 128817,
               "<|/ref|>": 128818, "<|det|>": 128819, "<|/det|>": 128820}
    tokenizer = word_level_tokenizer(129280, special, eos="<｜end▁of▁sentence｜>",
                                     pad="<｜▁pad▁｜>", bos="<｜begin▁of▁sentence｜>")
    config = DeepseekOcr2Config(
        image_token_id=128815, tie_word_embeddings=False,
        vision_config=dict(
            sam_config=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                            image_size=1024, patch_size=16, window_size=14,
                            global_attn_indexes=[2, 5, 8, 11], output_channels=256,
                            downsample_channels=[512, 896]),
            encoder_config=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2,
                                rms_norm_eps=1e-6, max_position_embeddings=32768,
                                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
        text_config=dict(vocab_size=129280, hidden_size=1280, intermediate_size=6848,
                         moe_intermediate_size=896, num_hidden_layers=12, num_attention_heads=10,
                         num_key_value_heads=10, n_routed_experts=64, num_experts_per_tok=6,
                         n_shared_experts=2, mlp_layer_types=["dense"] + ["sparse"] * 11,
                         max_position_embeddings=8192, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         bos_token_id=0, eos_token_id=1, pad_token_id=2),
    )
    image_processor = DeepseekOcr2ImageProcessorPil()  # a 1024-px global view, 768-px tiles
    parts = Parts(tokenizer, image_processor, CHAT_TEMPLATE,
                  {"processor_class": "DeepseekOcr2Processor", "patch_size": 16,
                   "downsample_ratio": 4}, "DeepseekOcr2ImageProcessor")
    return DeepseekOcr2ForConditionalGeneration, config, parts, [1]
GRANITE_DOCLING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<image>' -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|end_of_text|>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_of_role|>assistant<|end_of_role|>' -}}{%- endif -%}"
)


def granite_docling():
    """ibm-granite/granite-for-docling-500m's shapes (transformers' GraniteDocling defaults:
    a 12-layer 768-wide SigLIP tower at 512-px tiles, DeepStack taps after layers 3, 7 and
    10, the coarse (4x4, 64 tokens a tile) and fine (2x2) connector paths, a 28-layer
    1024-wide Granite decoder, tied embeddings), without the density router. The tokenizer
    carries DocTags' <doctag> and location tags, so --output-format applies."""
    from transformers import (GraniteDoclingConfig, GraniteDoclingForConditionalGeneration,
                              GraniteDoclingImageProcessorPil)

    names = ("<|start_of_role|>", "<|end_of_role|>", "<fake_token_around_image>", "<global-img>")
    special = {"<|pad|>": 100256, "<|end_of_text|>": 100257, "<image>": 100337}
    special.update({name: 100258 + index for index, name in enumerate(names)})
    special.update({f"<row_{r}_col_{c}>": 100400 + (r - 1) * 16 + (c - 1)
                    for r in range(1, 17) for c in range(1, 17)})
    tags = ["<doctag>", "</doctag>", "<text>", "</text>", "<otsl>", "</otsl>"]
    tags += [f"<loc_{i}>" for i in range(500)]
    special.update({tag: 101000 + index for index, tag in enumerate(tags)})
    tokenizer = word_level_tokenizer(133800, special, eos="<|end_of_text|>", pad="<|pad|>")
    config = GraniteDoclingConfig(
        image_token_id=100337, pad_token_id=100256, tie_word_embeddings=True,
        text_config=dict(vocab_size=133800, pad_token_id=100256, bos_token_id=100257,
                         eos_token_id=100257),
        vision_config=dict(),
    )
    image_processor = GraniteDoclingImageProcessorPil()
    parts = Parts(tokenizer, image_processor, GRANITE_DOCLING_TEMPLATE,
                  {"processor_class": "GraniteDoclingProcessor", "image_seq_len": 64},
                  "GraniteDoclingImageProcessor")
    return GraniteDoclingForConditionalGeneration, config, parts, [100257]


MLLAMA_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] | trim }}{%- else %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] | trim }}{%- endif %}{%- endfor %}"
    "{%- endif %}{{- '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def llama32_11b_vision():
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaImageProcessorPil

    special = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001,
               "<|finetune_right_pad_id|>": 128004, "<|start_header_id|>": 128006,
               "<|end_header_id|>": 128007, "<|eom_id|>": 128008, "<|eot_id|>": 128009,
               "<|python_tag|>": 128010, "<|image|>": 128256}
    tokenizer = word_level_tokenizer(128257, special, eos="<|eot_id|>",
                                     pad="<|finetune_right_pad_id|>", bos="<|begin_of_text|>")
    eos_ids = [128001, 128008, 128009]
    config = MllamaConfig(
        image_token_index=128256,
        text_config=dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
                         cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38],
                         max_position_embeddings=131072, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                          "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192},
                         bos_token_id=128000, eos_token_id=eos_ids, pad_token_id=128004),
        vision_config=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                           num_global_layers=8, attention_heads=16, image_size=560,
                           patch_size=14, max_num_tiles=4, vision_output_dim=7680,
                           intermediate_layers_indices=[3, 7, 15, 23, 30]),
    )
    image_processor = MllamaImageProcessorPil(size={"height": 560, "width": 560},
                                              max_image_tiles=4)
    parts = Parts(tokenizer, image_processor, MLLAMA_TEMPLATE,
                  {"processor_class": "MllamaProcessor"}, "MllamaImageProcessor")
    return MllamaForConditionalGeneration, config, parts, eos_ids
INTERNVL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def internvl3_5(text_config: dict, tied: bool):
    """InternVL3.5-*-HF over ``text_config`` (the sizes' shared InternViT-300M tower)."""
    from transformers import (GotOcr2ImageProcessorPil, InternVLConfig,
                              InternVLForConditionalGeneration)

    special = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
               "<img>": 151669, "</img>": 151670, "<IMG_CONTEXT>": 151671, "<video>": 151672}
    tokenizer = word_level_tokenizer(
        151936, special, eos="<|im_end|>", pad="<|endoftext|>",
        extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                              "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"})
    config = InternVLConfig(
        image_token_id=151671, image_seq_length=256, downsample_ratio=0.5,
        tie_word_embeddings=tied,
        text_config=dict(head_dim=128,
                         vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                         tie_word_embeddings=tied,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         bos_token_id=151643, eos_token_id=151645, **text_config),
        vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                           num_attention_heads=16, image_size=448, patch_size=14,
                           attention_bias=True, use_qk_norm=False, norm_type="layer_norm"),
    )
    # The 448x448 benchmark image is one tile (no thumbnail).
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": 448, "width": 448}, crop_to_patches=True, min_patches=1, max_patches=12,
        image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    parts = Parts(tokenizer, image_processor, INTERNVL_TEMPLATE,
                  {"processor_class": "InternVLProcessor", "image_seq_length": 256},
                  "GotOcr2ImageProcessorFast")
    return InternVLForConditionalGeneration, config, parts, [151645, 151643]


PHI4_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'audio' %}<|audio|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def phi4_multimodal():
    from transformers import Phi4MultimodalConfig, Phi4MultimodalForCausalLM

    from mlxvlm.models.phi4_multimodal_audio_features import Phi4MultimodalFeatureExtractorNumpy
    from mlxvlm.models.phi4_multimodal_images import Phi4MultimodalImageProcessorPil

    special = {"<|endoftext|>": 199999, "<|image|>": 200010, "<|audio|>": 200011,
               "<|assistant|>": 200019, "<|end|>": 200020, "<|user|>": 200021,
               "<|system|>": 200022}
    tokenizer = word_level_tokenizer(
        200064, special, eos="<|endoftext|>", pad="<|endoftext|>", bos="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image|>", "audio_token": "<|audio|>"})
    eos_ids = [199999, 200020]
    pairs = 48  # 3/4 of the 128-wide heads rotate: 96 dims
    config = Phi4MultimodalConfig(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
        original_max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75,
                         "short_factor": [1.0 + i / pairs for i in range(pairs)],
                         "long_factor": [1.0 + 40 * i / pairs for i in range(pairs)],
                         "original_max_position_embeddings": 4096},
        bos_token_id=199999, pad_token_id=199999, eos_token_id=eos_ids,
        vision_config={"image_token_id": 200010}, audio_config={"audio_token_id": 200011},
    )
    audio = Phi4MultimodalFeatureExtractorNumpy().to_dict()
    audio.pop("mel_filters", None)
    audio["feature_extractor_type"] = "Phi4MultimodalFeatureExtractor"
    # The 448x448 benchmark image is one crop and the global view.
    parts = Parts(tokenizer, Phi4MultimodalImageProcessorPil(), PHI4_TEMPLATE,
                  {"processor_class": "Phi4MultimodalProcessor"},
                  "Phi4MultimodalImageProcessorFast", preprocessor_extra=audio)
    return Phi4MultimodalForCausalLM, config, parts, eos_ids
def internvl3_5_1b():
    return internvl3_5(dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                            num_hidden_layers=28, num_attention_heads=16,
                            num_key_value_heads=8), tied=True)


def internvl3_5_30b_a3b():
    return internvl3_5(dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                            num_hidden_layers=48, num_attention_heads=32,
                            num_key_value_heads=4, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=768,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
                       tied=False)


QWEN3_OMNI_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Experts kept per MoE: the experts one token uses (its work is the same as with 128)
QWEN3_OMNI_THINKER_EXPERTS = 8
QWEN3_OMNI_TALKER_EXPERTS = 6


def qwen3_omni_30b_a3b():
    """Qwen/Qwen3-Omni-30B-A3B-Instruct's shapes (its config.json), thinker, talker and
    code2wav, with the experts a token uses. The word-level tokenizer has the chat roles
    and the newline at their Qwen ids (``system`` 8948, ``user`` 872, ``assistant`` 77091,
    ``\\n`` 198), which the talker's prompt is found by."""
    from transformers import (Qwen2VLImageProcessorPil, Qwen3OmniMoeConfig,
                              Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor)

    from omni_speech import CODE_PREDICTOR, TALKER, TALKER_TEXT

    ids = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
           "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655,
           "<|video_pad|>": 151656, "<|audio_start|>": 151669, "<|audio_end|>": 151670,
           "<tts_pad>": 151671, "<tts_text_bos>": 151672, "<tts_text_eod>": 151673,
           "<|audio_pad|>": 151675}
    # the roles and the newline after them as Qwen's tokenizer gives them: the talker's
    # prompt is the assistant turn's first three tokens, then the answer's first
    roles = {"system": 8948, "user": 872, "assistant": 77091, "\n": 198}
    tokenizer = word_level_tokenizer(
        152064, {**ids, **roles}, eos="<|im_end|>", pad="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>",
            "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>", "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>"})
    media = dict(audio_token_id=151675, image_token_id=151655, video_token_id=151656,
                 audio_start_token_id=151669, vision_start_token_id=151652,
                 position_id_per_seconds=13)
    thinker = dict(
        **media, audio_end_token_id=151670, vision_end_token_id=151653, user_token_id=872,
        tie_word_embeddings=False, seconds_per_chunk=2,
        text_config=dict(hidden_size=2048, intermediate_size=768, moe_intermediate_size=768,
                         num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                         head_dim=128, num_experts=QWEN3_OMNI_THINKER_EXPERTS,
                         num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], vocab_size=152064, max_position_embeddings=65536,
                         rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [24, 20, 20], "interleaved": True,
                                          "mrope_interleaved": True},
                         bos_token_id=151643, eos_token_id=151645, pad_token_id=151643),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                           out_hidden_size=2048, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, num_position_embeddings=2304,
                           deepstack_visual_indexes=[8, 16, 24],
                           hidden_act="gelu_pytorch_tanh"),
        audio_config=dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20,
                          encoder_ffn_dim=5120, downsample_hidden_size=480, n_window=50,
                          n_window_infer=800, conv_chunksize=500, num_mel_bins=128,
                          max_source_positions=1500, output_dim=2048),
    )
    talker = dict(**TALKER, **media, audio_end_token_id=151670, seconds_per_chunk=2,
                  text_config={**TALKER_TEXT, "num_experts": QWEN3_OMNI_TALKER_EXPERTS},
                  code_predictor_config=CODE_PREDICTOR)
    # code2wav's defaults are the 30B's (8 x 1024 transformer, 1920x upsampling)
    config = Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker,
                                code2wav_config={}, enable_audio_output=True)
    # Qwen3-Omni's image processor: 16-px patches, merged 2x2, mean and std 0.5
    image_processor = Qwen2VLImageProcessorPil(patch_size=16, min_pixels=128 * 32 * 32,
                                               max_pixels=16384 * 32 * 32,
                                               image_mean=[0.5] * 3, image_std=[0.5] * 3)
    extractor = WhisperFeatureExtractor(feature_size=128, return_attention_mask=True)
    parts = Parts(tokenizer, image_processor, QWEN3_OMNI_TEMPLATE,
                  {"processor_class": "Qwen3OmniMoeProcessor"}, "Qwen2VLImageProcessor",
                  preprocessor_extra=extractor.to_dict())
    return Qwen3OmniMoeForConditionalGeneration, config, parts, [151645, 151643]


BUILDERS = {
    "smolvlm-256m": smolvlm_256m, "qwen2vl-2b": qwen2vl_2b, "qwen2vl-mid": qwen2vl_mid,
    "gemma4-e2b": gemma4_e2b, "qwen3vl-embedding-2b": qwen3vl_embedding_2b,
    "glm46v-flash": glm46v_flash, "glm-ocr": glm_ocr, "deepseek-ocr2": deepseek_ocr2,
    "llama32-11b-vision": llama32_11b_vision,
    "internvl3_5-1b": internvl3_5_1b, "internvl3_5-30b-a3b": internvl3_5_30b_a3b,
    "granite-docling": granite_docling, "phi4-multimodal": phi4_multimodal,
    "qwen2vl-small": qwen2vl_small, "qwen2vl-0.5b": qwen2vl_05b,
    "qwen3-omni-30b-a3b": qwen3_omni_30b_a3b,
}


def benchmark_image(size: int = 448) -> Image.Image:
    rng = np.random.default_rng(0)
    ys, xs = np.mgrid[0:size, 0:size] / size
    rgb = np.stack([np.sin(6 * xs + 1), np.cos(5 * ys), np.sin(4 * (xs + ys))], -1) * 0.4 + 0.5
    rgb += rng.normal(0, 0.05, rgb.shape)
    return Image.fromarray((np.clip(rgb, 0, 1) * 255).astype(np.uint8))


def fewer_layers(config, text_layers: int | None, vision_layers: int | None) -> None:
    """Keep the first layers of the decoder and of the vision tower, at the same widths
    (a host without room for the whole model still times a layer of its real shape); an
    omni model's are its thinker's."""
    thinker = getattr(config, "thinker_config", config)
    talker = getattr(config, "talker_config", None)
    if text_layers and talker is not None and talker.accept_hidden_layer >= text_layers:
        # the talker reads the thinker's hidden states after that many layers
        raise SystemExit(f"error: --text-layers {text_layers} drops the layer the talker "
                         f"reads (accept_hidden_layer {talker.accept_hidden_layer}): keep "
                         f"at least {talker.accept_hidden_layer + 1}")
    if text_layers:
        text = thinker.text_config
        cross = getattr(text, "cross_attention_layers", None)
        if cross:
            # Llama 3.2 Vision: the cross-attention layers that fall among the first
            # text_layers keep their places (3, 8, ...: every fifth), so the reduced
            # model alternates self- and cross-attention as the whole one does
            kept = [index for index in cross if index < text_layers]
            if not kept:
                raise SystemExit(f"error: --text-layers {text_layers} keeps none of the "
                                 f"cross-attention layers {cross} (the first is {min(cross)})")
            text.cross_attention_layers = kept
        text.num_hidden_layers = text_layers
        for key in ("layer_types", "mlp_layer_types"):
            if getattr(text, key, None):
                setattr(text, key, getattr(text, key)[:text_layers])
    if vision_layers:
        vision = thinker.vision_config
        key = "depth" if hasattr(vision, "depth") else "num_hidden_layers"
        taps = getattr(vision, "intermediate_layers_indices", None) or []
        if any(index >= vision_layers for index in taps):
            # Llama 3.2 Vision concatenates these layers' outputs: dropping one would
            # change the projector's width, which is no longer the real shape
            raise SystemExit(f"error: --vision-layers {vision_layers} drops the vision "
                             f"tower's tapped layers {taps}")
        setattr(vision, key, vision_layers)


def speaks_until_stopped(talker, config) -> None:
    """An omni talker as a trained one runs: transformers 5.25 leaves its expert banks as
    ``torch.empty`` gives them and its routers at zero (every expert tied), so they are
    drawn here; and its end-of-speech row is zero, so that its greedy codes never end
    before the frame limit."""
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in talker.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight")):
                param.copy_(config.initializer_range
                            * torch.randn(param.shape, generator=generator, dtype=torch.float32))
        talker.codec_head.weight[config.codec_eos_token_id] = 0


def build(name: str, target: Path, text_layers: int | None = None,
          vision_layers: int | None = None) -> None:
    import torch

    model_class, config, parts, eos_ids = BUILDERS[name]()
    fewer_layers(config, text_layers, vision_layers)
    torch.manual_seed(0)
    model = model_class._from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # greedy decoding of a random model must never pick EOS
        getattr(model, "thinker", model).get_output_embeddings().weight[eos_ids] = 0
        talker = getattr(model, "talker", None)
        if talker is not None:
            speaks_until_stopped(talker, config.talker_config)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    parts.save(target)
    benchmark_image().save(target / "image.png")
    (target / "benchmark.json").write_text(json.dumps({"image": "image.png", "prompt": PROMPT}))
    print(f"wrote {target}", file=sys.stderr)


def convert(source: Path, bits: int) -> None:
    target = source.with_name(source.name.replace("-bf16", f"-{bits}bit"))
    subprocess.run([sys.executable, "-m", "mlxvlm.convert", "--hf-path", str(source),
                    "--mlx-path", str(target), "-q", "--q-bits", str(bits), "--force"],
                   check=True)
    for extra in ("image.png", "benchmark.json"):
        (target / extra).write_bytes((source / extra).read_bytes())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=sorted(BUILDERS), action="append",
                        help="Build only this one (repeatable; default: all)")
    parser.add_argument("--no-quantized", action="store_true",
                        help="Skip the 4-bit and 8-bit conversions (default: make them)")
    parser.add_argument("--text-layers", type=int, default=None,
                        help="Keep this many decoder layers (the name gets -t<N>)")
    parser.add_argument("--vision-layers", type=int, default=None,
                        help="Keep this many vision-tower layers (the name gets -v<N>)")
    args = parser.parse_args()
    depth = "".join(f"-{tag}{n}" for tag, n in (("t", args.text_layers), ("v", args.vision_layers))
                    if n)
    for name in args.only or sorted(BUILDERS):
        source = OUT / f"{name}{depth}-bf16"
        build(name, source, args.text_layers, args.vision_layers)
        if not args.no_quantized:
            for bits in (4, 8):
                convert(source, bits)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
