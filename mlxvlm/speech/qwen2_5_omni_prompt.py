"""Qwen2.5-Omni's talker prompt, from the thinker's ids and states, as transformers'
``Qwen2_5OmniForConditionalGeneration.generate`` builds it for one sequence.

Each position the thinker was fed is one row in the thinker's width: its last hidden
state (after the final norm) plus its input embedding, the embedding zero at media
placeholders. The talker's prefill is the prompt's rows, the voice's ``bos_token``
embedding and the answer's first row, the last two with the codec embeddings of
``codec_pad`` and ``codec_bos`` added. Then it hears one row per step: the rest of the
answer, the embedding of ``tts_text_end`` just after the answer's last token before its
end of sequence (rows past it: ``tts_text_pad``), and ``tts_text_pad`` once they run out.

Positions: the thinker's (TMRoPE) for the prompt, the text ones after its largest for
the two rows after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxvlm.errors import MlxvlmError
from mlxvlm.speech.spk_dict import Voice


@dataclass
class TalkerPrompt:
    embeddings: mx.array  # (1, L, hidden): the talker's prefill
    positions: mx.array  # (3, L)
    trailing: mx.array  # (N, hidden): one row per decode step
    pad: mx.array  # (1, hidden): tts_text_pad, heard once the trailing rows run out


class WholeAnswerText:
    """The pipeline's follower of the thinker for Qwen2.5-Omni: the talker hears nothing
    until the answer is complete (its prefill holds the answer's first row and its
    trailing rows mark the answer's end, as transformers builds them from the whole
    answer), then its whole text at once."""

    def __init__(self, model, tap, prompt_tokens: int, voice: Voice, eos_ids):
        self.model, self.tap = model, tap
        self.prompt_tokens = prompt_tokens
        self.voice = voice
        self.eos_ids = eos_ids
        self.ended = False

    def follow(self, talker, generated, finished: bool) -> None:
        if self.ended or not finished:
            return
        tap = self.tap
        if any(ids is None for ids in tap.ids):
            raise MlxvlmError("speech output needs the prompt's token ids")
        ids = np.concatenate([np.asarray(i).reshape(-1) for i in tap.ids])
        generated = np.asarray(list(generated), dtype=np.int64)
        if len(generated) == 0:
            raise MlxvlmError("there is no answer to speak (no tokens were generated)")
        fed = self.prompt_tokens + len(generated) - 1
        if len(ids) < fed:
            raise MlxvlmError("speech output needs the thinker's states of the whole prompt "
                              "(a reused prompt cache skips them)")
        embeddings, hidden = tap.states(fed)
        positions = None if tap.state is None else tap.state.positions(0, self.prompt_tokens)
        prompt = build_talker_prompt(self.model, ids[:self.prompt_tokens], generated,
                                     embeddings, hidden, self.voice, self.eos_ids, positions)
        talker.add_text(prompt.trailing)
        talker.end_text(prompt.pad)
        talker.prefill(prompt.embeddings, prompt.positions)
        self.ended = True


def build_talker_prompt(model, prompt_ids: np.ndarray, generated_ids: np.ndarray,
                        embeddings: mx.array, hidden: mx.array, voice: Voice, eos_ids,
                        prompt_positions: mx.array | None = None) -> TalkerPrompt:
    """``embeddings``/``hidden``: the thinker's (T, width) states of the positions fed,
    at least the prompt's and all generated tokens' but the last. ``prompt_positions``:
    the thinker's (3, P) prompt positions (None: text positions)."""
    talker = model.talker
    config = talker.config
    args = model.args
    prompt_ids = np.asarray(prompt_ids).reshape(-1)
    generated_ids = np.asarray(generated_ids).reshape(-1)
    length, answer = len(prompt_ids), len(generated_ids)
    if answer < 2:
        raise MlxvlmError("the answer is too short to speak (Qwen2.5-Omni's talker needs "
                          "at least one token before its end)")
    fed = length + answer - 1
    media = np.isin(prompt_ids, [args.audio_token_id, args.image_token_id, args.video_token_id])
    keep = np.ones((fed, 1), np.float32)
    keep[:length][media] = 0
    rows = hidden[:fed] + embeddings[:fed] * mx.array(keep, embeddings.dtype)

    embed = model.language_model.model.embed_tokens
    codec = talker.model.embed_tokens
    bos, text_eos, text_pad = mx.split(
        embed(mx.array([voice.bos_token, config.text_eos_id, config.text_pad_id])), 3)
    pad_bos = codec(mx.array([config.codec_pad_id, config.codec_bos_id]))
    prefill = mx.concatenate([rows[:length], mx.concatenate([bos, rows[length:length + 1]]) + pad_bos])

    trailing = mx.concatenate([rows[length + 1:], text_eos, text_pad])
    # transformers puts tts_text_end after the answer's last token before its first end
    # of sequence (the rows after it hear tts_text_pad), clamped into the answer
    eos = np.flatnonzero(np.isin(generated_ids, list(eos_ids)))
    first_eos = min(max(int(eos[0]) if len(eos) else answer, 1), answer - 1)
    where = np.arange(trailing.shape[0])[:, None]
    trailing = mx.where(mx.array(where >= first_eos), text_pad, trailing)
    trailing = mx.where(mx.array(where == first_eos - 1), text_eos, trailing)
    return TalkerPrompt(prefill[None], _positions(prompt_positions, length), trailing, text_pad)


def _positions(prompt_positions: mx.array | None, length: int) -> mx.array:
    if prompt_positions is None:
        return mx.broadcast_to(mx.arange(length + 2, dtype=mx.int32), (3, length + 2))
    prompt = np.asarray(prompt_positions.astype(mx.float32))
    after = prompt.max() + 1 + np.arange(2)
    positions = np.concatenate([prompt, np.broadcast_to(after, (3, 2))], axis=1)
    if np.all(positions == np.round(positions)):
        return mx.array(positions.astype(np.int32))
    return mx.array(positions.astype(np.float32))
