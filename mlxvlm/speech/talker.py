"""The talker as a stream of codec frames: ``TalkerStream`` is prefilled with the talker
prompt, then each ``step`` gives one frame (the talker's first code, then the code
predictor's other groups) or None once the talker ends its speech.

The text it hears arrives with ``add_text`` (one row per step; ``end_text`` after the
last), so that a streaming orchestrator may hand it the thinker's answer as it is
written; ``ready`` says whether the next step has the text it needs.

``step_streams`` steps several streams of one talker at once (``SpeechBatch``, whose
``TalkerRows`` hold their KV caches as rows of one): each pass of the code predictor and
the talker's pass over all of them, each row's codes drawn by its own stream as it draws
them alone; ``step`` is ``step_streams`` over the stream alone, on its own cache.

Sampling (``TalkerSampling``): ``temperature`` 0 is plain argmax for the talker and the
code predictor (after the talker's token suppression, with no repetition penalty);
otherwise the talker samples as transformers' ``generate`` does by default (top-k 50,
top-p 1.0, repetition penalty 1.05 over the codes so far, at the temperature given or
0.9) and the code predictor at its own settings (top-k 50, top-p 0.8, temperature 1.0).
A ``seed`` draws every sampled code from its own seed (``step_seed`` of the frame, or of
the frame and group), so a seeded talker speaks the same codes whatever ran between its
steps (the thinker's, interleaved).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mlxvlm.sampling import build_sampler
from mlxvlm.speech.heard_text import HeardText
from mlxvlm.speech.talker_seed import seed_draw

# transformers' Qwen3OmniMoeForConditionalGeneration.generate defaults
DEFAULT_TEMPERATURE = 0.9
TOP_K = 50
TOP_P = 1.0
REPETITION_PENALTY = 1.05
PREDICTOR_TOP_K = 50
PREDICTOR_TOP_P = 0.8
# the codec vocabulary's last 1024 entries (special tokens) are never sampled, but EOS
SUPPRESSED_TAIL = 1024


@dataclass(frozen=True)
class TalkerSampling:
    temperature: float = DEFAULT_TEMPERATURE
    max_frames: int = 4096
    seed: int | None = None  # None: MLX's global random state

    @classmethod
    def from_temperature(cls, temperature: float | None, max_frames: int = 4096,
                         seed: int | None = None) -> "TalkerSampling":
        """``None``: the checkpoint's own sampling (transformers' defaults)."""
        if temperature is not None and temperature < 0:
            raise ValueError(f"talker_temperature must be at least 0, got {temperature}")
        return cls(DEFAULT_TEMPERATURE if temperature is None else float(temperature),
                   max_frames, seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class TalkerStream:
    """One sequence's talker: its KV caches, the text rows still to hear, the codes so far."""

    def __init__(self, talker, sampling: TalkerSampling):
        self.talker = talker
        self.config = talker.config
        self.sampling = sampling
        vocab = self.config.text.vocab_size
        eos = self.config.codec_eos_token_id
        allowed = np.ones(vocab, bool)
        allowed[max(vocab - SUPPRESSED_TAIL, 0):] = False
        allowed[eos] = True
        self._suppress = mx.array(np.where(allowed, 0.0, -np.inf).astype(np.float32))
        self.cache = [KVCache() for _ in talker.model.layers]
        self.heard = HeardText()  # the text rows, then the pad
        self.steps = 0  # frames fed back so far
        self.sampled = 0  # first codes sampled so far (transformers' max_new_tokens count)
        self.seen = np.zeros(vocab, bool)  # codes sampled (the repetition penalty's)
        self.next_position = 0
        self.finished = False
        self._code: int | None = None
        self._hidden: mx.array | None = None
        if sampling.greedy:
            self._sample = self._predictor_sample = build_sampler(0.0)
        else:
            self._sample = build_sampler(sampling.temperature, TOP_P, TOP_K)
            self._predictor_sample = build_sampler(1.0, PREDICTOR_TOP_P, PREDICTOR_TOP_K)

    # -- the text it hears --------------------------------------------------------------

    def add_text(self, rows: mx.array) -> None:
        """The next rows of text (rows, hidden), one per step."""
        self.heard.add(rows)

    def end_text(self, pad: mx.array) -> None:
        """No more text: the steps after the last row hear ``pad``."""
        self.heard.end(pad)

    def ready(self) -> bool:
        """Whether ``step`` can run: prefilled, and the text its step hears is given."""
        return self.started and (self.finished or self.heard.has(self.steps))

    @property
    def started(self) -> bool:
        return self._hidden is not None or self.finished

    def close(self) -> None:
        """Frees the caches and text (a stopped or finished stream steps no more)."""
        self.cache, self._hidden = [], None
        self.heard = HeardText()
        self.finished = True

    # -- running --------------------------------------------------------------------------

    def prefill(self, embeddings: mx.array, positions: mx.array) -> None:
        hidden = self.talker.model(embeddings, positions, self.cache)
        self.next_position = int(np.asarray(positions.astype(mx.float32)).max()) + 1
        _take_first_codes([self], hidden[:, -1:])

    def step(self) -> np.ndarray | None:
        """The next frame's codes (num_code_groups,), or None once the talker has ended
        (its EOS code, or ``max_frames`` frames given)."""
        return step_streams([self], self._alone)[0]

    @staticmethod
    def step_all(streams: list["TalkerStream"], forward) -> list[np.ndarray | None]:
        """``step_streams``: one frame of each of ``streams`` at once."""
        return step_streams(streams, forward)

    def _alone(self, call, streams, inputs: mx.array, positions: mx.array) -> mx.array:
        if self.cache is None:
            raise RuntimeError("this talker's cache is a row of a batch: the batch steps it")
        return call(inputs, positions, self.cache)

    def _ended(self) -> bool:
        """Whether the talker has ended (then ``finished``): its EOS code, or transformers'
        count of first codes sampled passed (the last of which starts no frame)."""
        if not self.finished and (self._code == self.config.codec_eos_token_id
                                  or self.sampled > self.sampling.max_frames):
            self.finished = True
        return self.finished

    def _first_code(self, logits: mx.array) -> mx.array:
        """The next frame's first code, drawn (lazily) from the talker head's ``logits``
        (1, vocab) after the repetition penalty and the suppression."""
        if not self.sampling.greedy and self.seen.any():
            logits = _repetition_penalty(logits, self.seen, REPETITION_PENALTY)
        return self._draw(self._sample, logits + self._suppress, "talker", self.sampled)

    def _took_first(self, code: int, hidden: mx.array) -> None:
        self._hidden = hidden
        self.seen[code] = True
        self.sampled += 1
        self._code = code

    def _residual_code(self, group: int, logits: mx.array) -> mx.array:
        """Group ``group + 1``'s code of this frame from the code predictor's ``logits``."""
        draw = self.steps * (self.config.num_code_groups - 1) + group
        return self._draw(self._predictor_sample, logits, "code predictor", draw)

    def _draw(self, sample, logits: mx.array, stage: str, draw: int) -> mx.array:
        """One code (1,), seeded by the request's seed for (``stage``, ``draw``) when it
        samples; lazy: the seed is taken as the draw is built."""
        seed_draw(self.sampling.seed, self.sampling.greedy, stage, draw)
        return sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def step_streams(streams: list[TalkerStream], forward) -> list[np.ndarray | None]:
    """One frame for each of ``streams`` (talker streams of one talker) at once: their
    code predictor's passes over all of them (each pass one forward of every row, then
    each row's draw), then one pass of the talker over them through ``forward(call,
    streams, inputs (n, 1, hidden), positions (n, 3, 1))``, which runs ``call(inputs,
    positions, cache)`` on the cache holding those streams' rows and gives back their
    hidden states, then each one's first code of its next frame. None for a stream
    that has ended."""
    frames: list[np.ndarray | None] = [None] * len(streams)
    going = [i for i, stream in enumerate(streams) if not stream._ended()]
    if not going:
        return frames
    rows = [streams[i] for i in going]
    if not all(stream.ready() for stream in rows):
        raise RuntimeError("the talker's next step needs text it has not been given")
    talker = rows[0].talker
    codes, frame_embeddings = _residual_codes(talker, rows)
    text = mx.stack([stream.heard.row(stream.steps) for stream in rows])
    inputs = (frame_embeddings + text)[:, None]
    positions = mx.array([stream.next_position for stream in rows], dtype=mx.int32)
    positions = mx.broadcast_to(positions[:, None, None], (len(rows), 3, 1))
    hidden = forward(talker.model, rows, inputs, positions)
    for stream in rows:
        stream.next_position += 1
        stream.steps += 1
    _take_first_codes(rows, hidden)
    for i, frame in zip(going, codes):
        frames[i] = frame
    return frames


def _take_first_codes(streams: list[TalkerStream], hidden: mx.array) -> None:
    """Each stream's next first code from its row of the talker's last hidden states
    (n, 1, hidden): the head over every row at once, then each row's own draw."""
    logits = streams[0].talker.codec_head(hidden[:, 0]).astype(mx.float32)
    drawn = mx.concatenate([stream._first_code(logits[i:i + 1])
                            for i, stream in enumerate(streams)])
    for i, (stream, code) in enumerate(zip(streams, drawn.tolist())):
        stream._took_first(code, hidden[i:i + 1])


def _residual_codes(talker, streams: list[TalkerStream]) -> tuple[list[np.ndarray], mx.array]:
    """The code predictor's groups 1.. of each stream's frame (whose first code and
    hidden state its last step took), all streams in each of its passes (its cache is
    fresh each frame, so the rows align), and each frame's embedding (n, hidden): the
    sum over its groups, which the talker hears next."""
    predictor = talker.code_predictor
    first_codes = [stream._code for stream in streams]
    first = talker.model.codec_embedding(mx.array(first_codes))  # (n, hidden)
    cache = [KVCache() for _ in predictor.model.layers]
    hidden = mx.concatenate([stream._hidden for stream in streams])  # (n, 1, hidden)
    inputs = mx.concatenate([hidden, first[:, None]], axis=1)  # (n, 2, hidden)
    codes = [first_codes]
    total = first
    for group in range(talker.config.num_code_groups - 1):
        out = predictor.model(inputs, cache)
        logits = predictor.lm_head[group](out[:, -1]).astype(mx.float32)
        drawn = mx.concatenate([stream._residual_code(group, logits[i:i + 1])
                                for i, stream in enumerate(streams)])
        codes.append(drawn.tolist())
        embedded = predictor.model.codec_embedding[group](drawn)  # (n, hidden)
        total = total + embedded
        inputs = embedded[:, None]
    frames = np.array(codes, dtype=np.int64).T  # (n, groups)
    return list(frames), total


def _repetition_penalty(logits: mx.array, seen: np.ndarray, penalty: float) -> mx.array:
    """transformers': a seen code's logit divided by the penalty if positive, else times it."""
    mask = mx.array(seen)
    penalized = mx.where(logits > 0, logits / penalty, logits * penalty)
    return mx.where(mask, penalized, logits)
