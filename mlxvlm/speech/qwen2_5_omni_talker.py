"""Qwen2.5-Omni's talker as a stream of codec codes, one per step (a frame is one code):
the interface of ``speech.talker.TalkerStream`` (``add_text``/``end_text``, ``ready``,
``prefill``, ``step``; ``step_streams`` over several streams of one talker at once, as
``SpeechBatch`` steps them) over ``layers/qwen2_5_omni_talker.py``.

Sampling (``TalkerSampling``): ``temperature`` 0 is argmax after the model's own
suppression (``codec_bos`` never spoken), with no repetition penalty; otherwise as
transformers' ``generate`` samples by default: top-k 40, top-p 0.8, at the temperature
given (else 0.9), repetition penalty 1.05 over every code the talker has been fed or
spoke (its prompt's mask, pad and bos codes among them, as transformers counts its
input ids); a ``seed`` draws each code from its own seed (``talker_seed``), as
Qwen3-Omni's talker does. It stops at ``codec_pad`` or ``codec_end`` (transformers'
``talker_eos_token_id``, which it spells as the Hub's ids 8292 and 8294), not spoken.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mlxvlm.sampling import build_sampler
from mlxvlm.speech.heard_text import HeardText
from mlxvlm.speech.talker import TalkerSampling, _repetition_penalty
from mlxvlm.speech.talker_seed import seed_draw

TOP_K = 40
TOP_P = 0.8
REPETITION_PENALTY = 1.05


class TalkerStream:
    def __init__(self, talker, sampling: TalkerSampling):
        self.talker = talker
        self.config = config = talker.config
        self.sampling = sampling
        vocab = config.text.vocab_size
        suppress = np.zeros(vocab, np.float32)
        suppress[config.codec_bos_id] = -np.inf
        self._suppress = mx.array(suppress)
        self.eos = {config.codec_pad_id, config.codec_eos_id}
        self.cache = [KVCache() for _ in talker.model.layers]
        self.heard = HeardText()  # the text rows, then the pad
        self.steps = 0
        self.sampled = 0
        self.seen = np.zeros(vocab, bool)
        self.seen[[config.codec_mask_id, config.codec_pad_id, config.codec_bos_id]] = True
        self.next_position = 0
        self.finished = False
        self._code: int | None = None
        self._sample = (build_sampler(0.0) if sampling.greedy
                        else build_sampler(sampling.temperature, TOP_P, TOP_K))

    def add_text(self, rows: mx.array) -> None:
        self.heard.add(rows)

    def end_text(self, pad: mx.array) -> None:
        self.heard.end(pad)

    def ready(self) -> bool:
        return self.finished or self.heard.has(self.steps)

    def close(self) -> None:
        """Frees the caches and text (a stopped or finished stream steps no more)."""
        self.cache = []
        self.heard = HeardText()
        self.finished = True

    def prefill(self, rows: mx.array, positions: mx.array) -> None:
        logits = self.talker(rows, positions, self.cache)
        self.next_position = int(np.asarray(positions.astype(mx.float32)).max()) + 1
        self._take(logits)

    def step(self) -> np.ndarray | None:
        """The next code (a 0-d array), or None once the talker has ended (an end code,
        or ``max_frames`` codes given)."""
        return step_streams([self], self._alone)[0]

    @property
    def started(self) -> bool:
        return self._code is not None or self.finished

    @staticmethod
    def step_all(streams: list["TalkerStream"], forward) -> list[np.ndarray | None]:
        """``step_streams``: one code of each of ``streams`` at once."""
        return step_streams(streams, forward)

    def _alone(self, call, streams, rows: mx.array, positions: mx.array) -> mx.array:
        if self.cache is None:
            raise RuntimeError("this talker's cache is a row of a batch: the batch steps it")
        return call(rows, positions, self.cache)

    def _next_frame(self) -> tuple[np.ndarray | None, bool]:
        """(the frame the next step gives, None once ended; whether the talker runs a pass
        for it to take the code after it)."""
        if self.finished:
            return None, False
        if self._code in self.eos:
            self.finished = True
            return None, False
        frame = np.array(self._code, dtype=np.int64)
        if self.sampled >= self.sampling.max_frames:
            self.finished = True  # transformers' max_new_tokens: this code is the last
            return frame, False
        return frame, True

    def _take(self, logits: mx.array) -> None:
        if not self.sampling.greedy:
            logits = _repetition_penalty(logits, self.seen, REPETITION_PENALTY)
        logits = logits + self._suppress
        seed_draw(self.sampling.seed, self.sampling.greedy, "talker", self.sampled)
        code = int(self._sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).item())
        self.seen[code] = True
        self.sampled += 1
        self._code = code


def step_streams(streams: list[TalkerStream], forward) -> list[np.ndarray | None]:
    """One code for each of ``streams`` (talker streams of one talker) at once: one pass
    of the talker over those that go on, through ``forward(call, streams, rows (n, 1,
    width), positions (n, 3, 1))``, which runs ``call(rows, positions, cache)`` on the
    cache holding those streams' rows and gives back their logits (n, vocab), then each
    one's draw of its next code. None for a stream that has ended."""
    frames: list[np.ndarray | None] = []
    going: list[TalkerStream] = []
    for stream in streams:
        frame, runs = stream._next_frame()
        frames.append(frame)
        if runs:
            going.append(stream)
    if not going:
        return frames
    if not all(stream.ready() for stream in going):
        raise RuntimeError("the talker's next step needs text it has not been given")
    talker = going[0].talker
    codes = mx.array([stream._code for stream in going])
    text = mx.stack([stream.heard.row(stream.steps) for stream in going])
    rows = (talker.model.embed_tokens(codes) + text)[:, None]
    positions = mx.array([stream.next_position for stream in going], dtype=mx.int32)
    positions = mx.broadcast_to(positions[:, None, None], (len(going), 3, 1))
    logits = forward(talker, going, rows, positions)
    for i, stream in enumerate(going):
        stream.next_position += 1
        stream.steps += 1
        stream._take(logits[i:i + 1])
    return frames
