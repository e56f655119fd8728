"""Qwen2.5-Omni's talker text, from the thinker's ids and states as the answer is written,
as transformers' ``Qwen2_5OmniForConditionalGeneration.generate`` builds it for one
sequence (``TalkerText``, the family's follower of the thinker).

Each position the thinker was fed is one row in the thinker's width: its last hidden
state (after the final norm) plus its input embedding, the embedding zero at the
prompt's media placeholders. The talker's prefill is the prompt's rows, the voice's
``bos_token`` embedding and the answer's first row, the last two with the codec
embeddings of ``codec_pad`` and ``codec_bos`` added: it needs the answer's first token
fed, no more, so the talker starts then. Then it hears one row per step: the answer's
next rows up to its first end of sequence (transformers' ``first_eos_positions``, clamped
to at least 1 and to the last token, which is never fed), ``tts_text_end`` in place of
the row of that end, and ``tts_text_pad`` after. Each row is handed over once its token is
fed; the end is known once an end of sequence is written or the answer is complete.
Nothing the talker hears depends on a later token, so a talker following the thinker
and one started after the whole answer hear identical rows.

Positions: the thinker's (TMRoPE) for the prompt, the text ones after its largest for
the two rows after it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.speech.heard_text import FirstEnd, read_prompt_ids
from mlxvlm.speech.spk_dict import Voice


class TalkerText:
    """Follows the thinker for one answer: ``follow`` hands the talker its prefill once
    the answer's first token is fed, then each row whose token is fed and comes before
    the answer's end, then ``tts_text_end`` and ``end_text`` (``tts_text_pad``)."""

    def __init__(self, model, tap, prompt_tokens: int, voice: Voice, eos_ids):
        self.model, self.tap = model, tap
        self.prompt_tokens = prompt_tokens
        self.voice = voice
        self.prefilled = False
        self.rows_given = 0  # rows of the answer's tokens 1, 2, ... handed after the prefill
        self.ended = False
        self._end = FirstEnd(eos_ids)  # where the answer's first end of sequence is

    def follow(self, talker, generated, finished: bool) -> None:
        """The thinker has written ``generated`` (all of it when ``finished``): hand
        ``talker`` what it can hear now."""
        if self.ended:
            return
        written = len(generated)
        eos = self._end.find(generated)
        # positions whose states are final: the answer's last token is never fed
        fed = self.prompt_tokens + written - (1 if finished else 0)
        answer_fed = min(self.tap.positions(), fed) - self.prompt_tokens
        if not self.prefilled:
            if answer_fed < 1:
                if finished:
                    raise MlxvlmError("the answer is too short to speak (Qwen2.5-Omni's talker "
                                      "needs at least one token before its end)")
                return
            embeddings, positions = self._prefill()
            talker.prefill(embeddings, positions)
            self.prefilled = True
        # the index of the first token whose row is not heard (tts_text_end in its place):
        # transformers' first end of sequence, at least 1, at most the last token
        end = (max(eos, 1) if eos is not None
               else written - 1 if finished else None)
        ready = answer_fed - 1 if end is None else min(answer_fed, end) - 1
        start = self.prompt_tokens + 1
        while self.rows_given < ready:
            position = start + self.rows_given
            talker.add_text(self._rows(position, position + 1))
            self.rows_given += 1
        if end is not None and self.rows_given == end - 1:
            text_eos, text_pad = self._text_specials()
            talker.add_text(text_eos)
            talker.end_text(text_pad)
            self.ended = True
        elif finished:
            raise MlxvlmError("speech output needs the thinker's states of the whole answer")

    def _rows(self, start: int, stop: int) -> mx.array:
        """The answer's rows of positions ``start`` to ``stop`` (no media among them)."""
        return self.tap.hidden_between(start, stop) + self.tap.embeddings_between(start, stop)

    def _embed(self, ids) -> mx.array:
        return self.model.language_model.model.embed_tokens(mx.array(ids))

    def _text_specials(self) -> tuple[mx.array, mx.array]:
        config = self.model.talker.config
        return mx.split(self._embed([config.text_eos_id, config.text_pad_id]), 2)

    def _prefill(self) -> tuple[mx.array, mx.array]:
        """The talker's prefill (1, L, hidden) and its positions (3, L)."""
        model = self.model
        config = model.talker.config
        args = model.args
        prompt_ids = read_prompt_ids(self.tap, self.prompt_tokens)
        length = self.prompt_tokens
        embeddings, hidden = self.tap.states(length + 1)
        media = np.isin(prompt_ids, [args.audio_token_id, args.image_token_id,
                                     args.video_token_id])
        keep = np.ones((length + 1, 1), np.float32)
        keep[:length][media] = 0
        rows = hidden + embeddings * mx.array(keep, embeddings.dtype)
        bos = self._embed([self.voice.bos_token])
        pad_bos = model.talker.model.embed_tokens(mx.array([config.codec_pad_id,
                                                            config.codec_bos_id]))
        prefill = mx.concatenate([rows[:length], mx.concatenate([bos, rows[length:]]) + pad_bos])
        state = self.tap.state
        prompt_positions = None if state is None else state.positions(0, length)
        return prefill[None], _positions(prompt_positions, length)


def _positions(prompt_positions: mx.array | None, length: int) -> mx.array:
    if prompt_positions is None:
        return mx.broadcast_to(mx.arange(length + 2, dtype=mx.int32), (3, length + 2))
    prompt = np.asarray(prompt_positions.astype(mx.float32))
    after = prompt.max() + 1 + np.arange(2)
    positions = np.concatenate([prompt, np.broadcast_to(after, (3, 2))], axis=1)
    if np.all(positions == np.round(positions)):
        return mx.array(positions.astype(np.int32))
    return mx.array(positions.astype(np.float32))
