"""A copy of a benchmark checkpoint in the layout mlx-vlm 0.7.10 parses.

    python benchmarks/mlx_vlm_copy.py glm-ocr-bf16      # writes glm-ocr-bf16-mlx-vlm/

transformers 5 writes ``dtype`` into every sub-config (and GLM-OCR's ``rope_parameters``
into its vision config); mlx-vlm's GLM-OCR builds its vision config's dataclass from that
dict as it is and stops on the keys it has no field for. The copy links every file but
config.json, whose sub-configs lose those keys: the weights and the model are the same.

DeepSeek-OCR 2 (``deepseek-ocr2-bf16``): mlx-vlm's ``deepseekocr_2`` reads
deepseek-ai/DeepSeek-OCR-2's own schema, not transformers' ``deepseek_ocr2``: a
``language_config`` (DeepSeek-V2 fields), a ``vision_config`` of ``width`` tables (SAM's and
the Qwen2 encoder's), a ``projector_config``, and its own processor's settings
(``candidate_resolutions``, ``patch_size``, ``downsample_ratio``). transformers already saves
the weights under DeepSeek's names (``model.sam_model``, ``model.qwen2_model``, ...), so the
copy rewrites config.json and processor_config.json from the transformers config and links
the rest.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHECKPOINTS = Path(__file__).resolve().parent / "checkpoints"
# Sub-config keys mlx-vlm 0.7.10's dataclasses do not take (transformers 5 writes them)
DROPPED = {"vision_config": ("dtype", "rope_parameters")}


def deepseek_ocr2_config(config: dict) -> tuple[dict, dict]:
    """DeepSeek-OCR-2's own config.json and processor settings, from transformers'."""
    text, vision = config["text_config"], config["vision_config"]
    sam, encoder = vision["sam_config"], vision["encoder_config"]
    dense = [kind == "dense" for kind in text["mlp_layer_types"]]
    language = dict(
        model_type="deepseek_v2", vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        moe_intermediate_size=text["moe_intermediate_size"],
        num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=text["num_attention_heads"],
        num_key_value_heads=text["num_key_value_heads"],
        n_shared_experts=text["n_shared_experts"], n_routed_experts=text["n_routed_experts"],
        num_experts_per_tok=text["num_experts_per_tok"], topk_method=text["topk_method"],
        routed_scaling_factor=text["routed_scaling_factor"],
        first_k_dense_replace=dense.index(False) if False in dense else len(dense),
        qk_nope_head_dim=0, qk_rope_head_dim=0,  # multi-head attention, no latent one
        max_position_embeddings=text["max_position_embeddings"],
        rms_norm_eps=text["rms_norm_eps"],
        rope_theta=text["rope_parameters"]["rope_theta"],
        bos_token_id=text.get("bos_token_id"), eos_token_id=text.get("eos_token_id"))
    vision_config = dict(model_type="vision", width={
        "qwen2-0-5b": {"dim": encoder["hidden_size"]},
        "sam_vit_b": {"image_size": sam["image_size"], "width": sam["hidden_size"],
                      "layers": sam["num_hidden_layers"], "heads": sam["num_attention_heads"],
                      "patch_size": sam["patch_size"], "window_size": sam["window_size"],
                      "global_attn_indexes": sam["global_attn_indexes"],
                      "downsample_channels": sam["downsample_channels"]}})
    own = dict(model_type="deepseekocr_2", architectures=["DeepseekOCR2ForCausalLM"],
               language_config=language, vision_config=vision_config,
               projector_config=dict(projector_type="linear",
                                     input_dim=encoder["hidden_size"],
                                     n_embed=text["hidden_size"]),
               image_token_index=config["image_token_id"], tile_tag="2D",
               global_view_pos="head", candidate_resolutions=[[sam["image_size"]] * 2],
               eos_token_id=[text.get("eos_token_id")])
    return own, {"candidate_resolutions": [[sam["image_size"]] * 2]}


def mlx_vlm_copy(source: Path) -> Path:
    target = source.with_name(source.name + "-mlx-vlm")
    target.mkdir(exist_ok=True)
    rewritten = ("config.json", "processor_config.json")
    for path in source.iterdir():
        link = target / path.name
        if path.name not in rewritten and not link.exists():
            link.symlink_to(path.resolve())
    config = json.loads((source / "config.json").read_text())
    processor = json.loads((source / "processor_config.json").read_text()) \
        if (source / "processor_config.json").exists() else None
    if config.get("model_type") == "deepseek_ocr2":
        config, settings = deepseek_ocr2_config(config)
        processor = {k: v for k, v in processor.items() if k != "processor_class"} | settings
    for section, keys in DROPPED.items():
        for key in keys:
            config.get(section, {}).pop(key, None)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    if processor is not None:
        (target / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return target


if __name__ == "__main__":
    name = Path(sys.argv[1])
    print(mlx_vlm_copy(name if name.is_dir() else CHECKPOINTS / name))
