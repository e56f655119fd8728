"""mlx-vlm's llava conversions write null for processor settings the source lacked; those
must fall back to the values derived from config.json, not reach the processor as None."""

from __future__ import annotations

import json
import shutil

from mlxvlm import load
from mlxvlm.prompt import prepare_inputs
from tiny import make_image


def test_null_processor_settings_keep_the_config_defaults(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints.path("llava", "hub")
    target = tmp_path / "llava"
    shutil.copytree(source, target)
    (target / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor", "patch_size": None,
        "vision_feature_select_strategy": None,
    }))
    _, expected = load(source)
    model, processor = load(target)
    image = make_image(64, 48, seed=1)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    ours = prepare_inputs(processor, messages, [image], feature_names=model.feature_names)
    reference = prepare_inputs(expected, messages, [image], feature_names=model.feature_names)
    assert ours.input_ids.tolist() == reference.input_ids.tolist()
