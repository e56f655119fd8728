"""Gemma 3n's audio against transformers (float32), on the tiny checkpoint (see
tests/tiny/gemma3n.py): logits within 1e-4 and 24 greedy tokens for audio alone (two clips
of different lengths, so the shorter is padded within the batch and its soft tokens with
the padding embedding) and audio with an image; the guard that another sound changes the
output. References through transformers' processor with the audio passed as it documents
it (``processor(text=..., audio=...)``).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from av_media import sine

from parity import LOGITS_ATOL, MIN_REFERENCE_MARGIN, NEW_TOKENS, loaded  # noqa: F401 (fixture)
from tiny import make_image
from tiny.gemma3n import reference_processor
from mlxvlm import stream_generate
from mlxvlm.prompt import prepare_inputs

torch = pytest.importorskip("torch")

FAMILY = "gemma3n"
IMAGE = make_image(84, 56, seed=2)
SOUND_A = sine(0.5, 16000, 440.0)
SOUND_B = sine(0.35, 16000, 900.0)
SOUND_C = sine(0.5, 16000, 250.0)  # A's length, another pitch


def user(*parts, text):
    return [{"role": "user", "content": [*({"type": p} for p in parts),
                                         {"type": "text", "text": text}]}]


CASES = {
    "audio": (user("audio", "audio", text="Listen and tell me a story."),
              {"audio": [SOUND_A, SOUND_B]}),
    "audio_image": (user("image", "audio", text="What do you see and hear?"),
                    {"image": [IMAGE], "audio": [SOUND_A]}),
    "other_audio": (user("image", "audio", text="What do you see and hear?"),
                    {"image": [IMAGE], "audio": [SOUND_C]}),
}


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    """case -> transformers' prompt ids, first-pass logits, greedy tokens, thinnest margin."""

    @functools.cache
    def run(case):
        messages, media = CASES[case]
        tiny = tiny_checkpoints.model(FAMILY)
        processor = reference_processor(tiny)
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        batch = processor(text=[text], images=media.get("image"), audio=media.get("audio"),
                          return_tensors="pt")
        with torch.no_grad():
            logits = tiny.model(**batch).logits[0].numpy()
            out = tiny.model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False,
                                      output_scores=True, return_dict_in_generate=True)
        tokens = out.sequences[0, batch["input_ids"].shape[1]:].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        return batch["input_ids"][0].tolist(), logits, tokens, min(margins)

    return run


def our_logits(model, processor, messages, media):
    inputs = prepare_inputs(processor, messages, media.get("image"), audio=media.get("audio"),
                            feature_names=model.feature_names)
    embeddings, state = model.embed(inputs.input_ids, **inputs.features)
    logits = model(inputs.input_ids, model.make_cache(), embeddings=embeddings, state=state)
    return inputs.input_ids[0].tolist(), np.array(logits[0])


def our_tokens(model, processor, messages, media):
    results = stream_generate(model, processor, messages, image=media.get("image"),
                              audio=media.get("audio"), max_tokens=NEW_TOKENS, temperature=0.0)
    return [r.token for r in results]


@pytest.mark.parametrize("case", ["audio", "audio_image"])
@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_first_pass_logits_match_transformers(layout, case, loaded, reference):
    model, processor = loaded(FAMILY, layout)
    ref_ids, ref_logits, _, _ = reference(case)
    ids, logits = our_logits(model, processor, *CASES[case])
    assert ids == ref_ids
    np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("case", ["audio", "audio_image"])
def test_greedy_tokens_match_transformers(case, loaded, reference):
    model, processor = loaded(FAMILY, "hub")
    _, _, ref_tokens, margin = reference(case)
    assert len(ref_tokens) == NEW_TOKENS and margin > MIN_REFERENCE_MARGIN
    assert our_tokens(model, processor, *CASES[case]) == ref_tokens


def test_the_prompt_holds_each_clips_soft_tokens(loaded, reference):
    """Two clips of different lengths: each fills its 16 placeholders, the shorter with
    more padding embeddings (the first-pass test checks their values)."""
    model, processor = loaded(FAMILY, "transformers")
    ids = np.array(reference("audio")[0])
    assert (ids == model.args.audio_token_id).sum() == 2 * model.args.audio_soft_tokens_per_image
    inputs = prepare_inputs(processor, *CASES["audio"][:1], audio=CASES["audio"][1]["audio"],
                            feature_names=model.feature_names)
    valid = np.array(inputs.features["input_features_mask"]).sum(axis=1)
    assert valid[0] > valid[1]


def test_another_sound_changes_the_output(loaded, reference):
    model, processor = loaded(FAMILY, "transformers")
    other = our_tokens(model, processor, *CASES["other_audio"])
    assert other != reference("audio_image")[2]
    assert other == reference("other_audio")[2]


def test_batch_generate_gives_each_prompt_its_reference_tokens(loaded, reference):
    """Audio alone, audio with an image and an image alone, decoded together."""
    from mlxvlm import batch_generate

    model, processor = loaded(FAMILY, "hub")
    cases = [CASES["audio"], CASES["audio_image"], CASES["other_audio"]]
    outputs = batch_generate(model, processor, [m for m, _ in cases],
                             [media.get("image") for _, media in cases],
                             audios=[media.get("audio") for _, media in cases],
                             max_tokens=NEW_TOKENS, temperature=0.0)
    assert [o.tokens for o in outputs] == [reference(c)[2] for c in ("audio", "audio_image", "other_audio")]


def test_server_answers_audio_as_transformers_does(loaded, reference):
    """The OpenAI-compatible server takes the clip as an ``input_audio`` part (base64 WAV)
    beside an image and answers as ``generate`` does for the clip it decodes (16-bit
    samples; ``generate``'s tokens are compared with transformers' above)."""
    import base64
    import io
    import wave

    from server_harness import MODEL_ID, LiveServer, png_data_url

    model, processor = loaded(FAMILY, "transformers")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((SOUND_A * 32767).astype("<i2").tobytes())
    # The reference for the clip as the server decodes it (16-bit samples).
    samples = np.frombuffer(buffer.getvalue()[44:], "<i2").astype(np.float32) / 32768
    messages, media = CASES["audio_image"]
    inputs = prepare_inputs(processor, messages, media["image"], audio=[samples],
                            feature_names=model.feature_names)
    expected = [r.token for r in stream_generate(model, processor, messages, image=media["image"],
                                                 audio=[samples], max_tokens=NEW_TOKENS,
                                                 temperature=0.0)]
    content = [
        {"type": "image_url", "image_url": {"url": png_data_url(IMAGE)}},
        {"type": "input_audio", "input_audio": {
            "data": base64.b64encode(buffer.getvalue()).decode(), "format": "wav"}},
        {"type": "text", "text": messages[0]["content"][-1]["text"]},
    ]
    with LiveServer(model, processor) as live:
        response = live.client().chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": content}], temperature=0,
            max_tokens=NEW_TOKENS,
        )
    assert response.choices[0].message.content == processor.tokenizer.decode(
        expected, skip_special_tokens=True)
    assert response.usage.prompt_tokens == inputs.input_ids.shape[1]
