"""Qwen3-Omni's talker text, from the thinker's ids and hidden states as the answer is
written, as transformers' ``Qwen3OmniMoeForConditionalGeneration.generate`` builds it for
one sequence (``TalkerText``, the family's follower of the thinker):

- the prefill: the user turns (every token whose turn's role token is ``user``): media
  placeholders as ``hidden_projection`` of the thinker's hidden state at
  ``accept_hidden_layer``, text as ``text_projection`` of the thinker's input embedding;
  then the assistant turn's first nine positions: its ``<|im_start|>assistant\\n``, four
  ``tts_pad``, ``tts_bos`` and the answer's first token (text projections), added to the
  codec embeddings of (nothing x3) nothink, think_bos, think_eos, the speaker, codec_pad,
  codec_bos. It needs the answer's first token only: the talker starts then;
- the rest of the answer, one row per talker step, each handed over once the thinker
  has fed its token, then ``tts_eos``; after it the talker hears ``tts_pad``.

Positions: text-only prompts count 0, 1, 2 ...; with media, transformers recomputes
TMRoPE over the talker's ids, which is the thinker's positions of the kept tokens moved
back by the text tokens left out before them (each advanced the position by one).

Every row is projected on its own, whenever it arrives: a talker that follows the
thinker step by step and one started after the whole answer hear identical rows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.speech.heard_text import FirstEnd, read_prompt_ids


class TalkerText:
    """Follows the thinker for one answer: ``follow`` hands the talker its prefill once
    the answer's first token is fed, then each text row whose token is written and fed
    (and, once the answer is complete, ``tts_eos`` and ``end_text``)."""

    def __init__(self, model, tap, prompt_tokens: int, speaker_id: int, eos_ids):
        self.model, self.tap = model, tap
        self.prompt_tokens = prompt_tokens
        self.speaker_id = speaker_id
        self.prefilled = False
        self.rows_given = 0  # answer rows handed to the talker after its prefill
        self.ended = False
        self._start: int | None = None  # the assistant turn's <|im_start|>
        self._end = FirstEnd(eos_ids)  # where the answer's first end of sequence is

    def follow(self, talker, generated, finished: bool) -> None:
        """The thinker has written ``generated`` (all of it when ``finished``): hand
        ``talker`` what it can hear now. Rows wait until their token is fed to the thinker
        and known not to come after the answer's end of sequence."""
        if self.ended:
            return
        written = len(generated)
        eos = self._end.find(generated)
        # positions whose embeddings are final: the answer's last token is never fed
        fed = self.prompt_tokens + written - (1 if finished else 0)
        usable = min(self.tap.positions(), fed)
        start = self._assistant_start()
        if not self.prefilled:
            if usable < start + 4:
                if finished:
                    raise MlxvlmError("there is no answer to speak (the talker needs the "
                                      "answer's first token fed to the thinker)")
                return
            embeddings, positions = self._prefill(start)
            talker.prefill(embeddings, positions)
            self.prefilled = True
        # transformers hears the answer up to its first end of sequence (the rows after
        # it tts_pad): rows stop there, or where the written answer stops if none is seen
        bound = eos if eos is not None else written
        ready = max(0, min(usable - (start + 4), bound))
        projection = self.model.talker.text_projection
        while self.rows_given < ready:
            position = start + 4 + self.rows_given
            talker.add_text(projection(self.tap.embeddings_between(position, position + 1)))
            self.rows_given += 1
        if finished:
            tts_eos, tts_pad = self._specials()[1:]
            talker.add_text(tts_eos)
            talker.end_text(tts_pad)
            self.ended = True

    def _assistant_start(self) -> int:
        if self._start is None:
            speech = self.model.speech_config
            prompt_ids = read_prompt_ids(self.tap, self.prompt_tokens)
            assistant = np.flatnonzero((prompt_ids[:-1] == speech.im_start_token_id)
                                       & (prompt_ids[1:] == speech.assistant_token_id))
            if not len(assistant):
                raise MlxvlmError("the prompt has no assistant turn to speak "
                                  "(no <|im_start|>assistant)")
            self._start = int(assistant[-1])
        return self._start

    def _specials(self) -> tuple[mx.array, mx.array, mx.array]:
        speech = self.model.speech_config
        thinker_embed = self.model.thinker.language_model.model.embed_tokens
        specials = mx.array([speech.tts_bos_token_id, speech.tts_eos_token_id,
                             speech.tts_pad_token_id])
        return mx.split(self.model.talker.text_projection(thinker_embed(specials)), 3)

    def _prefill(self, start: int) -> tuple[mx.array, mx.array]:
        """The talker's prefill (1, L, hidden) and its positions (3, L)."""
        model = self.model
        speech = model.speech_config
        talker = model.talker
        talker_config = speech.talker
        args = model.args
        prompt_ids = read_prompt_ids(self.tap, self.prompt_tokens)
        length = len(prompt_ids)
        embeddings, hidden = self.tap.states(start + 4)

        # each token's role: the token after the latest <|im_start|> at or before it
        starts = np.where(prompt_ids == speech.im_start_token_id, np.arange(length), -1)
        previous_start = np.maximum.accumulate(starts).clip(min=0)
        roles = prompt_ids[np.minimum(previous_start + 1, length - 1)]
        user = np.flatnonzero(roles == speech.user_token_id)
        media_ids = [args.audio_token_id, args.image_token_id, args.video_token_id]
        media = np.isin(prompt_ids, media_ids)

        user_parts = mx.zeros((len(user), talker_config.text.hidden_size), dtype=embeddings.dtype)
        user_media = media[user]
        rows = mx.array(user)
        if user_media.any():
            projected_media = talker.hidden_projection(hidden[rows[mx.array(np.flatnonzero(user_media))]])
            user_parts[mx.array(np.flatnonzero(user_media))] = projected_media
        if (~user_media).any():
            text_rows = mx.array(np.flatnonzero(~user_media))
            user_parts[text_rows] = talker.text_projection(embeddings[rows[text_rows]])

        tts_bos, _, tts_pad = self._specials()
        answer = talker.text_projection(embeddings[start:start + 4])
        answer_text = mx.concatenate([answer[:3], mx.repeat(tts_pad, 4, axis=0), tts_bos,
                                      answer[3:4]])
        codec_ids = mx.array([talker_config.codec_nothink_id, talker_config.codec_think_bos_id,
                              talker_config.codec_think_eos_id, self.speaker_id,
                              talker_config.codec_pad_id, talker_config.codec_bos_id])
        codec = mx.concatenate([mx.zeros((3, answer.shape[1]), answer.dtype),
                                talker.model.codec_embedding(codec_ids)])
        prefill = mx.concatenate([user_parts, answer_text + codec])[None]
        state = self.tap.state
        prompt_positions = None if state is None else state.positions(0, self.prompt_tokens)
        positions = _positions(prompt_positions, prompt_ids, user, media, prefill.shape[1])
        return prefill, positions


def _positions(prompt_positions, prompt_ids, user, media, length) -> mx.array:
    if prompt_positions is None:
        return mx.broadcast_to(mx.arange(length, dtype=mx.int32), (3, length))
    kept = np.zeros(len(prompt_ids), bool)
    kept[user] = True
    if media[: len(prompt_ids)][~kept].any():
        raise MlxvlmError("speech output for media outside the user's turns is not supported")
    dropped_before = np.cumsum(~kept) - (~kept)
    thinker = np.asarray(prompt_positions.astype(mx.float32))[:, user]
    user_positions = thinker - dropped_before[user][None]
    following = (user_positions.max() + 1 if len(user) else 0) + np.arange(length - len(user))
    positions = np.concatenate([user_positions, np.broadcast_to(following, (3, len(following)))],
                               axis=1)
    if np.all(positions == np.round(positions)):
        return mx.array(positions.astype(np.int32))
    return mx.array(positions.astype(np.float32))
