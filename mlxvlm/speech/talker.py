"""The talker as a stream of codec frames: ``TalkerStream`` is prefilled with the talker
prompt, then each ``step`` gives one frame (the talker's first code, then the code
predictor's other groups) or None once the talker ends its speech.

The text it hears arrives with ``add_text`` (one row per step; ``end_text`` after the
last), so that a streaming orchestrator may hand it the thinker's answer as it is
written; ``ready`` says whether the next step has the text it needs.

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
        self._take(hidden)

    def step(self) -> np.ndarray | None:
        """The next frame's codes (num_code_groups,), or None once the talker has ended
        (its EOS code, or ``max_frames`` frames given)."""
        if self.finished:
            return None
        # transformers counts the first codes sampled, the last of which starts no frame
        if self._code == self.config.codec_eos_token_id or self.sampled > self.sampling.max_frames:
            self.finished = True
            return None
        if not self.ready():
            raise RuntimeError("the talker's next step needs text it has not been given")
        frame, frame_embedding = self._residual_codes(self._code, self._hidden)
        text = self.heard.row(self.steps)
        embedding = (frame_embedding + text)[None, None]
        position = mx.full((3, 1), self.next_position, dtype=mx.int32)
        hidden = self.talker.model(embedding, position, self.cache)
        self.next_position += 1
        self.steps += 1
        self._take(hidden)
        return frame

    def _take(self, hidden: mx.array) -> None:
        """Sample the first code of the next frame from the talker's last hidden state."""
        self._hidden = hidden[:, -1:]
        logits = self.talker.codec_head(self._hidden[:, 0]).astype(mx.float32)
        if not self.sampling.greedy and self.seen.any():
            logits = _repetition_penalty(logits, self.seen, REPETITION_PENALTY)
        logits = logits + self._suppress
        seed_draw(self.sampling.seed, self.sampling.greedy, "talker", self.sampled)
        code = int(self._sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).item())
        self.seen[code] = True
        self.sampled += 1
        self._code = code

    def _residual_codes(self, code: int, hidden: mx.array) -> tuple[np.ndarray, mx.array]:
        """The code predictor's groups 1.. of the frame whose first code is ``code``, and
        the frame's embedding (the sum over its groups) that the talker hears next."""
        predictor = self.talker.code_predictor
        first = self.talker.model.codec_embedding(mx.array([code]))  # (1, hidden)
        cache = [KVCache() for _ in predictor.model.layers]
        inputs = mx.concatenate([hidden[0], first])[None]  # (1, 2, hidden)
        codes = [code]
        total = first[0]
        for group in range(self.config.num_code_groups - 1):
            out = predictor.model(inputs, cache)
            logits = predictor.lm_head[group](out[:, -1]).astype(mx.float32)
            seed_draw(self.sampling.seed, self.sampling.greedy, "code predictor",
                      self.steps * (self.config.num_code_groups - 1) + group)
            next_code = int(self._predictor_sample(
                logits - mx.logsumexp(logits, axis=-1, keepdims=True)).item())
            codes.append(next_code)
            embedded = predictor.model.codec_embedding[group](mx.array([next_code]))
            total = total + embedded[0]
            inputs = embedded[None]
        return np.array(codes, dtype=np.int64), total


def _repetition_penalty(logits: mx.array, seen: np.ndarray, penalty: float) -> mx.array:
    """transformers': a seen code's logit divided by the penalty if positive, else times it."""
    mask = mx.array(seen)
    penalized = mx.where(logits > 0, logits / penalty, logits * penalty)
    return mx.where(mask, penalized, logits)
