"""Qwen3-Omni (the thinker) through mlxvlm's other doors: checkpoints named as
mlx-community's conversions name them (float and quantized, speech-output tensors beside
the thinker's) load unchanged; batch_generate decodes audio and image prompts as generate
does one by one; the OpenAI-compatible server takes an image and a sound in one message.
"""

from __future__ import annotations

import base64

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from av_media import sine, write_audio
from parity import parameter_list
from server_harness import MODEL_ID, LiveServer, png_data_url
from tiny import make_image
from mlxvlm import batch_generate, generate, load
from mlxvlm.prompt import prepare_inputs

FAMILY = "qwen3_omni_moe"
IMAGE = make_image(84, 56, seed=5)
SOUND = sine(1.5, 16000, 500.0)
MESSAGES = [{"role": "user", "content": [
    {"type": "image"}, {"type": "audio"}, {"type": "text", "text": "Tell me about both."}]}]
# mlx-community's quantized conversions keep the routers at 8 bits (mlx-vlm's predicate).
ROUTER_BITS = 8


@pytest.fixture(scope="module")
def hub(tiny_checkpoints):
    return load(tiny_checkpoints.path(FAMILY, "hub"))


def first_logits(model, processor) -> np.ndarray:
    inputs = prepare_inputs(processor, MESSAGES, [IMAGE], audio=[SOUND],
                            feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    return np.array(model(inputs.input_ids, model.make_cache(), embeddings=embeddings,
                          state=state)[0])


def write_mlx_checkpoint(model, source, target, quantization=None):
    """``source``'s config and processor files; ``model``'s parameters under their names
    (mlx-community's: ``thinker.*``) and speech-output tensors, marked as MLX tools mark
    their files."""
    import json
    import shutil

    target.mkdir(parents=True)
    for item in source.iterdir():
        if item.suffix != ".safetensors":
            shutil.copyfile(item, target / item.name)
    if quantization is not None:
        config = json.loads((target / "config.json").read_text())
        config["quantization"] = quantization
        (target / "config.json").write_text(json.dumps(config))
    weights = dict(parameter_list(model))
    weights["talker.codec_head.weight"] = mx.zeros((8, 4))
    weights["code2wav.pre_transformer.norm.weight"] = mx.zeros((4,))
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "mlx"})
    return target


def test_mlx_community_float_checkpoint_loads_unchanged(tiny_checkpoints, hub, tmp_path):
    model, processor = hub
    path = write_mlx_checkpoint(model, tiny_checkpoints.path(FAMILY, "hub"), tmp_path / "mlx")
    converted, converted_processor = load(path)
    np.testing.assert_array_equal(first_logits(converted, converted_processor),
                                  first_logits(model, processor))


def test_mlx_community_quantized_checkpoint_loads_unchanged(tiny_checkpoints, tmp_path):
    model, processor = load(tiny_checkpoints.path(FAMILY, "hub"))
    quantization = {"group_size": 32, "bits": 4}

    def predicate(path, module):
        if not path.startswith("thinker.language_model.") or not hasattr(module, "to_quantized"):
            return False
        if module.weight.shape[-1] % 32:  # the experts' 16-wide down projections
            return False
        if path.endswith("mlp.gate"):
            quantization[path] = {"group_size": 32, "bits": ROUTER_BITS}
            return quantization[path]
        return True

    nn.quantize(model, group_size=32, bits=4, class_predicate=predicate)
    assert isinstance(model.language_model.model.layers[1].mlp.gate, nn.QuantizedLinear)
    path = write_mlx_checkpoint(model, tiny_checkpoints.path(FAMILY, "hub"), tmp_path / "q",
                                quantization)
    converted, converted_processor = load(path)
    gate = converted.language_model.model.layers[1].mlp.gate
    assert isinstance(gate, nn.QuantizedLinear) and gate.bits == ROUTER_BITS
    np.testing.assert_allclose(first_logits(converted, converted_processor),
                               first_logits(model, processor), atol=1e-5, rtol=0)


def test_batch_generate_takes_audio_and_images_as_generate_does(hub):
    model, processor = hub
    prompts = [MESSAGES, "Listen and tell me a story.", "Hello"]
    images = [[IMAGE], None, None]
    audios = [[SOUND], [sine(0.7, 16000, 900.0)], None]
    alone = [generate(model, processor, p, image=i, audio=a, max_tokens=12)
             for p, i, a in zip(prompts, images, audios)]
    together = batch_generate(model, processor, prompts, images, audios=audios, max_tokens=12)
    assert [o.tokens for o in together] == [o.tokens for o in alone]
    assert alone[1].tokens != alone[2].tokens


def test_server_takes_an_image_and_a_sound_in_one_message(hub, tmp_path):
    model, processor = hub
    wav = write_audio(tmp_path / "sound.wav", SOUND, 16000).read_bytes()
    content = [{"type": "image_url", "image_url": {"url": png_data_url(IMAGE)}},
               {"type": "input_audio",
                "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
               {"type": "text", "text": "Tell me about both."}]
    expected = generate(model, processor, [{"role": "user", "content": [
        {"type": "image", "image": IMAGE}, {"type": "audio", "audio": str(tmp_path / "sound.wav")},
        {"type": "text", "text": "Tell me about both."}]}], max_tokens=16)
    silent = generate(model, processor, [{"role": "user", "content": [
        {"type": "image", "image": IMAGE}, {"type": "text", "text": "Tell me about both."}]}],
        max_tokens=16)
    assert expected.tokens != silent.tokens  # the sound is really used
    with LiveServer(model, processor) as live:
        response = live.client().chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": content}],
            temperature=0, max_tokens=16)
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == expected.prompt_tokens
