"""Spoken requests in the batching engine, in process, on the tiny full Qwen3-Omni
(tests/tiny/qwen3_omni_speech.py), greedy thinker and talker:

- ``RowsTap``: each row of a batched pass recorded into its own tap holds what the row
  records passed alone (a row without a tap records nothing);
- two spoken requests and a text one submitted together: each spoken one's text, codes
  and audio are ``generate(audio_output=True)``'s, its items text and audio in the order
  made, ending with its speech; the text one is unchanged;
- where the engine speculates (prompt lookup), a spoken request decodes as a plain row
  and still speaks as ``generate`` does;
- a speaker's own failure fails its request alone; a fault of the talker step fails the
  spoken requests and no text row.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

import mlxvlm
from mlxvlm.batching import BatchAudio, BatchEngine, BatchStep, EngineFault, SamplingOptions
from mlxvlm.batching.speculation_rule import SpeculationRule
from mlxvlm.generate.speculative import Speculation
from mlxvlm.generate.speech import SpeechRequest
from mlxvlm.models.layers.hidden_tap import HiddenTap, RowsTap
from mlxvlm.prompt import prepare_inputs
from mlxvlm.speech.pipeline import AnswerSpeaker
from mlxvlm.speech.speech_batch import SpeechBatch

pytest.importorskip("torch")  # the tiny checkpoint is built with transformers' classes

THINKER_TOKENS = 8
FRAMES = 12
DESCRIBE = [{"role": "user", "content": "Describe a red circle."}]
SQUARE = [{"role": "user", "content": "Describe a blue square."}]
COUNT = [{"role": "user", "content": "Count to many."}]


@pytest.fixture(scope="module")
def loaded(speaking_checkpoint):
    return mlxvlm.load(speaking_checkpoint)


def test_rows_tap_hands_each_row_what_it_records_alone(loaded):
    model, _ = loaded
    language_model = model.language_model
    decoder = language_model.model
    layer = 2
    table = np.asarray(decoder.embed_tokens.weight)
    # Ids the table has: MLX's gather does not check its indices, so an id past the end
    # reads whatever memory follows the table (which earlier work in the process leaves
    # there: zero in one pass, not in another).
    rng = np.random.default_rng(0)
    prompts = mx.array(rng.integers(10, table.shape[0], (3, 7)))
    steps = mx.array(rng.integers(10, table.shape[0], (3, 1)))

    def record(rows, taps):
        """``prompts``' ``rows`` then one decode step, into ``taps``."""
        cache = model.make_cache()
        decoder.hidden_tap = taps
        try:
            language_model(prompts[rows], cache)
            language_model(steps[rows], cache)
        finally:
            decoder.hidden_tap = None

    batched = [HiddenTap(layer), None, HiddenTap(layer)]
    record([0, 1, 2], RowsTap(batched))
    for row in (0, 2):
        alone = HiddenTap(layer)
        record([row], alone)
        tap = batched[row]
        assert tap.positions() == alone.positions() == 8
        for ours, theirs in zip(tap.ids, alone.ids):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
        # the records are the table's rows of the ids fed (numpy refuses an id past its end)
        fed = np.concatenate([np.asarray(prompts[row]), np.asarray(steps[row])])
        np.testing.assert_array_equal(
            np.concatenate([np.asarray(e)[0] for e in alone.embeddings]), table[fed])
        for ours, theirs in [*zip(tap.embeddings, alone.embeddings),
                             *zip(tap.hidden, alone.hidden)]:
            assert ours.shape == theirs.shape
            np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5,
                                       atol=1e-5)


class Collected:
    """One request's delivered items, and the event set once its last one came."""

    def __init__(self, spoken: bool):
        self.items: list = []
        self.done = threading.Event()
        self.spoken = spoken

    def __call__(self, item) -> None:
        self.items.append(item)
        last = (isinstance(item, BaseException)
                or (isinstance(item, BatchAudio) and item.speech is not None)
                or (not self.spoken and isinstance(item, BatchStep)
                    and item.finish_reason is not None))
        if last:
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(item.text for item in self.items if isinstance(item, BatchStep))

    @property
    def failure(self) -> BaseException | None:
        return self.items[-1] if isinstance(self.items[-1], BaseException) else None


def run_together(loaded, requests, **engine_options):
    """``requests``: (messages, SpeechRequest or None, max_tokens), submitted at once to
    one engine; each one's ``Collected``."""
    model, processor = loaded
    engine = BatchEngine(model, processor, **{"max_batch_size": 4, **engine_options})
    engine.speculation_rule = SpeculationRule(adaptive=False)  # (where it speculates) always
    collected = []
    for messages, speech, max_tokens in requests:
        inputs = prepare_inputs(processor, messages,
                                feature_names=getattr(model, "feature_names", None))
        collected.append(Collected(speech is not None))
        engine.submit(inputs, SamplingOptions(max_tokens=max_tokens, temperature=0.0),
                      collected[-1], speech=speech)
    engine.start()
    try:
        for each in collected:
            assert each.done.wait(120)
    finally:
        engine.close()
    return engine, collected


def alone(loaded, messages, voice=None):
    model, processor = loaded
    return mlxvlm.generate(model, processor, messages, max_tokens=THINKER_TOKENS,
                           temperature=0.0, audio_output=True, voice=voice,
                           talker_temperature=0, talker_max_frames=FRAMES)


def test_spoken_rows_speak_as_alone_beside_a_text_row(loaded):
    model, processor = loaded
    text_alone = mlxvlm.generate(model, processor, COUNT, max_tokens=60, temperature=0.0)
    engine, (first, second, text) = run_together(loaded, [
        (DESCRIBE, SpeechRequest(None, 0, FRAMES), THINKER_TOKENS),
        (SQUARE, SpeechRequest("Aiden", 0, FRAMES), THINKER_TOKENS),
        (COUNT, None, 60)])
    assert engine.stats.peak_batch_size == 3
    assert engine.stats.requests_finished == 3
    assert text.text == text_alone.text
    assert not any(isinstance(item, BatchAudio) for item in text.items)
    for spoken, expected in ((first, alone(loaded, DESCRIBE)),
                             (second, alone(loaded, SQUARE, "Aiden"))):
        assert spoken.failure is None
        last = spoken.items[-1]
        steps = [item for item in spoken.items if isinstance(item, BatchStep)]
        assert steps[-1].finish_reason is not None
        assert spoken.items.index(steps[-1]) < len(spoken.items) - 1  # speech after the text
        assert spoken.text == expected.text
        np.testing.assert_array_equal(last.speech.codes, expected.audio_codes)
        chunks = [item.chunk for item in spoken.items if isinstance(item, BatchAudio)]
        np.testing.assert_array_equal(np.concatenate(chunks), expected.audio)
        np.testing.assert_array_equal(last.speech.audio, expected.audio)
        # the talker follows the thinker: audio before the text's last step
        first_audio = next(i for i, item in enumerate(spoken.items)
                           if isinstance(item, BatchAudio) and len(item.chunk))
        assert first_audio < spoken.items.index(steps[-1])


@pytest.mark.parametrize("max_batch_size", [1, 2])
def test_a_spoken_row_decodes_plainly_where_the_engine_speculates(loaded, max_batch_size):
    """Prompt lookup on: the text request speculates, the spoken one decodes as a plain
    row (its talker reads one thinker state per token) and speaks as ``generate`` does."""
    model, processor = loaded
    text_alone = mlxvlm.generate(model, processor, COUNT, max_tokens=30, temperature=0.0)
    engine, (spoken, text) = run_together(
        loaded, [(DESCRIBE, SpeechRequest(None, 0, FRAMES), THINKER_TOKENS), (COUNT, None, 30)],
        max_batch_size=max_batch_size, speculation=Speculation(prompt_lookup_num_tokens=2))
    expected = alone(loaded, DESCRIBE)
    assert spoken.text == expected.text and text.text == text_alone.text
    np.testing.assert_array_equal(spoken.items[-1].speech.codes, expected.audio_codes)
    np.testing.assert_array_equal(spoken.items[-1].speech.audio, expected.audio)
    assert engine.stats.drafted_tokens > 0  # the text request did speculate


def test_a_speakers_failure_fails_its_request_alone(loaded, monkeypatch):
    took = AnswerSpeaker.took  # each frame the talker speaks goes to its codec here

    def failing_took(self, frame):
        if self.speech.voice == "Aiden" and len(self.frames) == 3:
            raise RuntimeError("this codec broke")
        return took(self, frame)

    monkeypatch.setattr(AnswerSpeaker, "took", failing_took)
    engine, (failing, speaking, text) = run_together(loaded, [
        (SQUARE, SpeechRequest("Aiden", 0, FRAMES), THINKER_TOKENS),
        (DESCRIBE, SpeechRequest(None, 0, FRAMES), THINKER_TOKENS),
        (COUNT, None, 60)])
    assert str(failing.failure) == "this codec broke"
    assert speaking.failure is None and text.failure is None
    monkeypatch.undo()
    expected = alone(loaded, DESCRIBE)
    np.testing.assert_array_equal(speaking.items[-1].speech.codes, expected.audio_codes)
    assert engine.stats.requests_failed == 1 and engine.stats.requests_finished == 2


def test_a_talker_step_fault_fails_the_spoken_requests_not_the_text(loaded, monkeypatch):
    model, processor = loaded
    text_alone = mlxvlm.generate(model, processor, COUNT, max_tokens=60, temperature=0.0)
    step = SpeechBatch.step

    def faulty_step(self):
        if len(self) == 2:  # both spoken requests are speaking
            raise RuntimeError("the batched talker broke")
        return step(self)

    monkeypatch.setattr(SpeechBatch, "step", faulty_step)
    engine, (first, second, text) = run_together(loaded, [
        (DESCRIBE, SpeechRequest(None, 0, FRAMES), THINKER_TOKENS),
        (SQUARE, SpeechRequest(None, 0, FRAMES), THINKER_TOKENS),
        (COUNT, None, 60)])
    for spoken in (first, second):
        assert isinstance(spoken.failure, EngineFault)
        assert "the batched talker broke" in str(spoken.failure)
    assert text.failure is None and text.text == text_alone.text
    assert engine.stats.requests_failed == 2
