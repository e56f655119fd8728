"""benchmarks/run.py's run order and table, and helpers of other benchmark scripts (the
engines themselves run in benchmarks/)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

RUN_PY = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"


def _harness():
    spec = importlib.util.spec_from_file_location("benchmark_run", RUN_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(ttft: float, decode: float) -> dict:
    return {"load_s": 1.0, "ttft_s": ttft, "prompt_tps": 100 / ttft, "decode_tps": decode,
            "max_rss_gb": 0.5, "pages_per_min": 60 / (ttft + 10 / decode)}


def test_engines_alternate_and_reverse_every_other_run():
    harness = _harness()
    engines = ["mlxvlm", "mlx-vlm", "transformers"]
    assert harness.run_order(engines, 0) == engines
    assert harness.run_order(engines, 1) == ["transformers", "mlx-vlm", "mlxvlm"]
    assert harness.run_order(engines, 2) == engines
    assert engines == ["mlxvlm", "mlx-vlm", "transformers"]  # not reversed in place


def test_table_gives_the_ratio_of_medians_and_the_run_by_run_ratios():
    harness = _harness()
    # The machine drifts: each run of both engines is slower than the one before.
    results = {
        "mlxvlm": [_run(1.0, 20.0), _run(2.0, 10.0), _run(4.0, 5.0)],
        "transformers": [_run(1.25, 10.0), _run(2.5, 5.0), _run(3.2, 4.0)],
    }
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")
            for line in harness.table(results).splitlines()}
    assert rows["metric"][-2:] == ["mlxvlm ÷ transformers", "run by run |"]
    ttft = rows["time to first token (s)"]
    assert ttft[1] == "2.00 (1.00–4.00)" and ttft[2] == "2.50 (1.25–3.20)"
    assert ttft[3] == "0.80×"  # 2.00 / 2.50
    # 1.0/1.25, 2.0/2.5, 4.0/3.2: median 0.80, min 0.80, max 1.25
    assert ttft[4] == "0.80 (0.80–1.25) |"
    decode = rows["decode tokens/s"]
    assert decode[3] == "2.00×" and decode[4] == "2.00 (1.25–2.00) |"


def test_pages_per_minute_is_a_page_read_and_answered():
    harness = _harness()
    # 11 tokens: the first at 2 s, the 10 after it at 5 tokens/s, so a page takes 4 s
    assert harness.pages_per_min({"ttft_s": 2.0, "decode_tokens": 11, "decode_tps": 5.0}) == 15.0
    assert harness.pages_per_min({"ttft_s": 3.0, "decode_tokens": 1, "decode_tps": 0.0}) == 20.0
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")
            for line in harness.table({"mlxvlm": [_run(2.0, 5.0)],
                                       "transformers": [_run(8.0, 5.0)]}).splitlines()}
    assert rows["pages/min"][1:4] == ["15.00 (15.00–15.00)", "6.00 (6.00–6.00)", "2.50×"]


def test_the_lookup_engine_is_mlxvlm_drafting_from_the_prompt(tmp_path):
    harness = _harness()
    command = harness.engine_command(harness.LOOKUP, "python", tmp_path, tmp_path / "p.png",
                                     "OCR:", 32, prompt_lookup_num_tokens=5)
    assert Path(command[1]).name == "mlxvlm_engine.py"
    assert command[-2:] == ["--prompt-lookup-num-tokens", "5"]
    plain = harness.engine_command("mlxvlm", "python", tmp_path, tmp_path / "p.png", "OCR:", 32)
    assert "--prompt-lookup-num-tokens" not in plain
    runs = {"mlxvlm": [{"drafted": 0}], harness.LOOKUP: [{"drafted": 8, "accepted": 2},
                                                         {"drafted": 12, "accepted": 3}]}
    assert harness.acceptance(runs) == "mlxvlm+lookup: 5/20 drafted tokens accepted (25.0%)"


def test_a_page_is_letter_sized_dark_text_on_white():
    import sys

    sys.path.insert(0, str(RUN_PY.parent))
    from page import document_page, letter_size

    assert letter_size(612) == (612, 792)
    page = document_page(*letter_size(306)).convert("L")
    assert page.size == (306, 396)
    dark = sum(1 for value in page.get_flattened_data() if value < 128) / (306 * 396)
    assert 0.01 < dark < 0.3  # text, not a blank or black sheet


def test_the_mlx_vlm_copy_links_the_weights_and_drops_the_keys_it_rejects(tmp_path):
    import json
    import sys

    sys.path.insert(0, str(RUN_PY.parent))
    from mlx_vlm_copy import mlx_vlm_copy

    source = tmp_path / "glm-ocr-bf16"
    source.mkdir()
    config = {"model_type": "glm_ocr", "dtype": "bfloat16",
              "text_config": {"hidden_size": 8, "dtype": "bfloat16"},
              "vision_config": {"depth": 2, "dtype": "bfloat16",
                                "rope_parameters": {"rope_theta": 10000.0}}}
    (source / "config.json").write_text(json.dumps(config))
    (source / "model.safetensors").write_bytes(b"weights")
    target = mlx_vlm_copy(source)
    assert target.name == "glm-ocr-bf16-mlx-vlm"
    assert (target / "model.safetensors").resolve() == (source / "model.safetensors").resolve()
    copied = json.loads((target / "config.json").read_text())
    assert copied["vision_config"] == {"depth": 2}
    assert copied["text_config"] == config["text_config"] and copied["dtype"] == "bfloat16"
    assert json.loads((source / "config.json").read_text()) == config  # the source untouched
    assert mlx_vlm_copy(source) == target  # again: the links already there are kept


def test_fewer_layers_keeps_the_widths_and_each_per_layer_list_in_step():
    import sys

    import pytest
    from transformers import DeepseekOcr2Config, GlmOcrConfig, MllamaConfig

    sys.path.insert(0, str(RUN_PY.parent))
    from checkpoints import fewer_layers

    glm = GlmOcrConfig(text_config=dict(num_hidden_layers=16, hidden_size=1536),
                       vision_config=dict(depth=24, hidden_size=1024))
    fewer_layers(glm, 4, 2)
    assert (glm.text_config.num_hidden_layers, glm.vision_config.depth) == (4, 2)
    assert (glm.text_config.hidden_size, glm.vision_config.hidden_size) == (1536, 1024)
    ocr = DeepseekOcr2Config(text_config=dict(num_hidden_layers=12,
                                              mlp_layer_types=["dense"] + ["sparse"] * 11))
    fewer_layers(ocr, 3, None)
    assert ocr.text_config.mlp_layer_types == ["dense", "sparse", "sparse"]
    llama = MllamaConfig(text_config=dict(num_hidden_layers=40,
                                          cross_attention_layers=[3, 8, 13, 18, 23, 28, 33, 38]),
                         vision_config=dict(num_hidden_layers=32,
                                            intermediate_layers_indices=[3, 7, 15, 23, 30]))
    fewer_layers(llama, 10, None)
    assert llama.text_config.num_hidden_layers == 10
    assert llama.text_config.cross_attention_layers == [3, 8]  # at their stride, as in the 40
    with pytest.raises(SystemExit, match="keeps none of the cross-attention layers"):
        fewer_layers(MllamaConfig(text_config=dict(cross_attention_layers=[3, 8])), 3, None)
    with pytest.raises(SystemExit, match="tapped layers"):
        fewer_layers(llama, None, 16)
    fewer_layers(llama, None, 31)
    assert llama.vision_config.num_hidden_layers == 31


def test_the_omni_checkpoint_keeps_what_a_token_and_the_talker_use():
    import sys

    import pytest

    sys.path.insert(0, str(RUN_PY.parent))
    from checkpoints import fewer_layers, qwen3_omni_30b_a3b

    _, config, parts, eos_ids = qwen3_omni_30b_a3b()
    thinker, talker = config.thinker_config, config.talker_config
    # as many experts as a token uses: its work is the 30B's
    assert thinker.text_config.num_experts == thinker.text_config.num_experts_per_tok
    assert talker.text_config.num_experts == talker.text_config.num_experts_per_tok
    fewer_layers(config, talker.accept_hidden_layer + 1, None)
    assert thinker.text_config.num_hidden_layers == talker.accept_hidden_layer + 1
    assert thinker.text_config.hidden_size == talker.thinker_hidden_size  # widths kept
    with pytest.raises(SystemExit, match="drops the layer the talker reads"):
        fewer_layers(config, talker.accept_hidden_layer, None)
    # the talker finds each turn by the role token after <|im_start|>, and its prompt is
    # the assistant turn's first three tokens: Qwen's tokenizer ends each header with
    # "\n", its id 198
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w1"}]}]
    text = parts.tokenizer.apply_chat_template(messages, chat_template=parts.chat_template,
                                               add_generation_prompt=True, tokenize=False)
    ids = parts.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[:3] == [config.im_start_token_id, config.user_token_id, 198]
    assert ids[-3:] == [config.im_start_token_id, config.assistant_token_id, 198]
    assert thinker.image_token_id in ids and config.im_end_token_id in eos_ids


def test_the_omni_talker_is_drawn_and_speaks_to_the_frame_limit():
    import sys

    import torch
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as tm

    sys.path.insert(0, str(RUN_PY.parent))
    from checkpoints import speaks_until_stopped

    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, head_dim=8,
                 num_attention_heads=2, num_key_value_heads=1)
    config = Qwen3OmniMoeConfig(talker_config=dict(
        text_config=dict(small, vocab_size=64, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=8, shared_expert_intermediate_size=8),
        code_predictor_config=dict(small, vocab_size=16, num_code_groups=2),
        num_code_groups=2, thinker_hidden_size=16, codec_eos_token_id=40,
        spatial_merge_size=2)).talker_config
    talker = tm.Qwen3OmniMoeTalkerForConditionalGeneration._from_config(config)
    speaks_until_stopped(talker, config)
    drawn = {name: param.detach() for name, param in talker.named_parameters()
             if name.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight"))}
    assert len(drawn) == 3
    for name, value in drawn.items():  # the init's normal, whatever memory held before
        assert torch.isfinite(value).all(), name
        assert abs(value.std().item() - config.initializer_range) < 0.3 * config.initializer_range
    head = talker.codec_head.weight.detach()
    assert not head[config.codec_eos_token_id].any()  # greedy never ends the speech
    assert (head.abs().sum(dim=1) > 0).sum() == head.shape[0] - 1


def test_each_run_records_the_load_average_it_started_under():
    import json
    import sys

    harness = _harness()
    reported = {"load_s": 1.0, "ttft_s": 2.0, "prompt_tps": 50.0, "decode_tps": 4.0,
                "decode_tokens": 9, "max_rss_gb": 0.5}
    run = harness.run_once([sys.executable, "-c", f"print({json.dumps(json.dumps(reported))})"],
                           timeout=60)
    assert {key: run[key] for key in reported} == reported
    assert len(run["load_average"]) == 3 and all(value >= 0 for value in run["load_average"])
    assert run["pages_per_min"] == 60 / (2.0 + 8 / 4.0)


def test_full_depth_copies_each_missing_layer_from_a_kept_one_of_its_kind(tmp_path, monkeypatch):
    import json
    import sys

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    sys.path.insert(0, str(RUN_PY.parent))
    import full_depth

    # Llama 3.2 Vision's placement: 10 kept layers (cross-attention at 3 and 8) grown to 40
    chosen = full_depth.templates(10, 40, [3, 8], [3, 8, 13, 18, 23, 28, 33, 38])
    assert chosen[:10] == list(range(10))
    assert [chosen[i] for i in (13, 18, 23, 28, 33, 38)] == [8, 3, 8, 3, 8, 3]
    assert all(chosen[i] not in (3, 8) for i in range(10, 40) if i % 5 != 3)

    # A reduced checkpoint of 2 text layers and 1 vision block, grown to 4 and 3
    source = tmp_path / "tiny-t2-v1-bf16"
    source.mkdir()
    weights = {"model.language_model.embed_tokens.weight": torch.arange(12.0).reshape(4, 3),
               "model.visual.blocks.0.mlp.weight": torch.arange(6.0).reshape(3, 2)}
    for index in range(2):
        weights[f"model.language_model.layers.{index}.mlp.weight"] = (
            torch.arange(8.0).reshape(4, 2) + 100 * index)
        weights[f"model.language_model.layers.{index}.norm.weight"] = torch.ones(2)
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()},
              str(source / "model.safetensors"))
    config = {"text_config": {"num_hidden_layers": 2, "hidden_size": 2},
              "vision_config": {"depth": 1}}
    (source / "config.json").write_text(json.dumps(config))
    (source / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(full_depth, "full_config", lambda name: {
        "text_layers": 4, "cross": [], "vision_key": "depth", "vision_layers": 3})
    monkeypatch.setattr(full_depth, "SHARD_BYTES", 40)  # several shards
    target = tmp_path / "tiny-bf16"
    full_depth.grow(source, "tiny", target)

    grown_config = json.loads((target / "config.json").read_text())
    assert grown_config["text_config"] == {"num_hidden_layers": 4, "hidden_size": 2}
    assert grown_config["vision_config"] == {"depth": 3}
    assert (target / "tokenizer.json").read_text() == "{}"
    index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) > 1 and all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    grown = {}
    for shard in shards:
        with safe_open(target / shard, "pt") as handle:
            grown.update({name: handle.get_tensor(name).float() for name in handle.keys()})
    assert set(grown) == set(index) == (
        {f"model.language_model.layers.{i}.{p}.weight" for i in range(4) for p in ("mlp", "norm")}
        | {f"model.visual.blocks.{i}.mlp.weight" for i in range(3)}
        | {"model.language_model.embed_tokens.weight"})
    layer = "model.language_model.layers.{}.mlp.weight"
    for kept in range(2):
        assert torch.equal(grown[layer.format(kept)], weights[layer.format(kept)])
    # Layers 2 and 3 are layers 0 and 1's rows rolled by their index: the same values,
    # not the same matrix
    assert torch.equal(grown[layer.format(2)], torch.roll(weights[layer.format(0)], 2, 0))
    assert torch.equal(grown[layer.format(3)], torch.roll(weights[layer.format(1)], 3, 0))
    assert torch.equal(grown["model.visual.blocks.2.mlp.weight"],
                       torch.roll(weights["model.visual.blocks.0.mlp.weight"], 2, 0))
    assert torch.equal(grown["model.language_model.embed_tokens.weight"],
                       weights["model.language_model.embed_tokens.weight"])


def test_gemma4_table_checkpoint_at_full_depth_keeps_the_real_layer_pattern(tmp_path):
    import json
    import sys

    sys.path.insert(0, str(RUN_PY.parent))
    import checkpoints
    import per_layer_table

    real = checkpoints.gemma4_e2b()[1].text_config
    (tmp_path / "full").mkdir()
    per_layer_table.gemma4_e2b(tmp_path / "full", 35)
    full = json.loads((tmp_path / "full" / "config.json").read_text())["text_config"]
    assert full["num_hidden_layers"] == 35
    assert full["layer_types"] == real.layer_types
    # google/gemma-4-E2B-it: a global layer every fifth, the last 20 layers sharing KV
    assert [i for i, kind in enumerate(full["layer_types"]) if kind == "full_attention"] == \
        list(range(4, 35, 5))
    assert full["num_kv_shared_layers"] == 20
    (tmp_path / "reduced").mkdir()
    per_layer_table.gemma4_e2b(tmp_path / "reduced", 5)
    reduced = json.loads((tmp_path / "reduced" / "config.json").read_text())["text_config"]
    assert reduced["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention",
                                      "sliding_attention", "full_attention"]
    assert reduced["num_kv_shared_layers"] == 2


def test_spoken_batching_ignores_the_end_ids_mlxvlm_load_stops_at(speaking_checkpoint):
    import sys

    from mlxvlm import load
    from mlxvlm.text.tokenization import processor_state

    sys.path.insert(0, str(RUN_PY.parent))
    from spoken_batching import eos_ids

    _, processor = load(speaking_checkpoint)
    assert eos_ids(speaking_checkpoint) == sorted(processor_state(processor).eos_token_ids)


def test_the_speech_benchmark_checkpoint_has_its_talker_drawn(tmp_path, monkeypatch):
    """omni_speech.py's own build (at small widths): the talker's experts and routers drawn
    as transformers' init draws the other weights, and its speech never ending early."""
    import json
    import sys

    import numpy as np
    from safetensors.torch import load_file

    sys.path.insert(0, str(RUN_PY.parent))
    import omni_speech

    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, head_dim=8,
                 num_attention_heads=2, num_key_value_heads=1)
    monkeypatch.setattr(omni_speech, "CHECKPOINTS", tmp_path)
    monkeypatch.setattr(omni_speech, "TALKER_TEXT", dict(
        omni_speech.TALKER_TEXT, **small, moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                         "mrope_section": [2, 1, 1], "interleaved": True}))
    monkeypatch.setattr(omni_speech, "CODE_PREDICTOR", dict(omni_speech.CODE_PREDICTOR, **small))
    monkeypatch.setattr(omni_speech, "TALKER", dict(omni_speech.TALKER, thinker_hidden_size=16))
    monkeypatch.setattr(omni_speech, "CODE2WAV", dict(
        codebook_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, decoder_dim=16,
        upsample_rates=[2, 2, 2, 2], upsampling_ratios=[2, 2]))
    directory = omni_speech.build(6)
    config = json.loads((directory / "config.json").read_text())["talker_config"]
    weights = {k: v.float().numpy() for k, v in
               load_file(str(directory / "model.safetensors")).items()}
    drawn = [k for k in weights
             if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"))
             and k.startswith("talker.model.layers.")]
    assert len(drawn) == 3 * small["num_hidden_layers"]
    # the same spread as the weights transformers' init draws, in every layer
    reference = weights["talker.model.layers.0.mlp.shared_expert.gate_proj.weight"].std()
    assert abs(reference - config["initializer_range"]) < 0.2 * config["initializer_range"]
    for name in drawn:
        assert np.isfinite(weights[name]).all(), name
        assert abs(weights[name].std() - reference) < 0.3 * reference, name
    head = weights["talker.codec_head.weight"]
    assert not head[config["codec_eos_token_id"]].any()
    assert np.count_nonzero(np.abs(head).sum(axis=1)) == head.shape[0] - 1


def test_the_speech_benchmark_times_mlxvlm_with_its_cpu_set_up(tmp_path):
    """omni_speech.py's mlxvlm child imports mlxvlm before MLX (MLX loaded first keeps its
    own BLAS: float32 products and code2wav's convolutions several times slower), and its
    loader refuses to time a process where MLX was loaded first."""
    import os
    import subprocess
    import sys

    script = RUN_PY.parent / "omni_speech.py"
    env = {k: v for k, v in os.environ.items() if k != "MLXVLM_NO_OPENBLAS"}
    # no checkpoint of that many experts: the child gets past the set-up check to its config
    child = subprocess.run([sys.executable, str(script), "--engine", "mlxvlm", "--experts",
                            "987654"], capture_output=True, text=True, env=env, timeout=300)
    assert child.returncode != 0
    assert "config.json" in child.stderr, child.stderr
    assert "set-up did not run" not in child.stderr
    mlx_first = ("import sys; import mlx.core; sys.path.insert(0, sys.argv[1]); "
                 "import omni_speech; omni_speech.load_mlxvlm(omni_speech.Path(sys.argv[2]), "
                 "'float32', True)")
    loaded_first = subprocess.run([sys.executable, "-c", mlx_first, str(RUN_PY.parent),
                                   str(tmp_path)], capture_output=True, text=True, env=env,
                                  timeout=300)
    assert loaded_first.returncode != 0
    assert loaded_first.stderr.strip().splitlines()[-1] == (
        "error: mlxvlm's CPU set-up did not run (skipped: mlx.core was imported before mlxvlm)")
