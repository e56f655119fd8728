"""Qwen3-Omni's talker prompt, from the thinker's ids and hidden states, as transformers'
``Qwen3OmniMoeForConditionalGeneration.generate`` builds it for one sequence:

- the user turns (every token whose turn's role token is ``user``): media placeholders as
  ``hidden_projection`` of the thinker's hidden state at ``accept_hidden_layer``, text as
  ``text_projection`` of the thinker's input embedding;
- then the assistant turn's first nine positions: its ``<|im_start|>assistant\\n``, four
  ``tts_pad``, ``tts_bos`` and the answer's first token (text projections), added to the
  codec embeddings of (nothing x3) nothink, think_bos, think_eos, the speaker, codec_pad,
  codec_bos;
- the rest of the answer (``trailing``), one row per talker step, then ``tts_eos``; after
  it the talker hears ``tts_pad``.

Positions: text-only prompts count 0, 1, 2 ...; with media, transformers recomputes
TMRoPE over the talker's ids, which is the thinker's positions of the kept tokens moved
back by the text tokens left out before them (each advanced the position by one).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxvlm.errors import MlxvlmError


@dataclass
class TalkerPrompt:
    embeddings: mx.array  # (1, L, hidden): the talker's prefill
    positions: mx.array  # (3, L)
    trailing: mx.array  # (N, hidden): one row per decode step, the last one tts_eos
    pad: mx.array  # (1, hidden): tts_pad, heard once the trailing rows run out


def build_talker_prompt(model, prompt_ids: np.ndarray, generated_ids: np.ndarray,
                        embeddings: mx.array, hidden: mx.array, speaker_id: int,
                        eos_ids, prompt_positions: mx.array | None = None) -> TalkerPrompt:
    """``embeddings``/``hidden``: the thinker's (T, width) states of the positions fed,
    at least the prompt's and all generated tokens' but the last. ``prompt_positions``:
    the thinker's (3, P) prompt positions (None: text positions)."""
    speech = model.speech_config
    talker = model.talker
    talker_config = speech.talker
    args = model.args
    prompt_ids = np.asarray(prompt_ids).reshape(-1)
    generated_ids = np.asarray(generated_ids).reshape(-1)
    sequence = np.concatenate([prompt_ids, generated_ids])
    fed = len(sequence) - 1  # the last token is never fed to the thinker
    embeddings, hidden = embeddings[:fed], hidden[:fed]
    length = len(prompt_ids)

    # each token's role: the token after the latest <|im_start|> at or before it
    starts = np.where(prompt_ids == speech.im_start_token_id, np.arange(length), -1)
    previous_start = np.maximum.accumulate(starts).clip(min=0)
    roles = prompt_ids[np.minimum(previous_start + 1, length - 1)]
    user = np.flatnonzero(roles == speech.user_token_id)
    media_ids = [args.audio_token_id, args.image_token_id, args.video_token_id]
    media = np.isin(sequence, media_ids)

    assistant = np.flatnonzero((prompt_ids[:-1] == speech.im_start_token_id)
                               & (prompt_ids[1:] == speech.assistant_token_id))
    if not len(assistant):
        raise MlxvlmError("the prompt has no assistant turn to speak (no <|im_start|>assistant)")
    start = int(assistant[-1])

    user_parts = mx.zeros((len(user), talker_config.text.hidden_size), dtype=embeddings.dtype)
    user_media = media[user]
    rows = mx.array(user)
    if user_media.any():
        projected_media = talker.hidden_projection(hidden[rows[mx.array(np.flatnonzero(user_media))]])
        user_parts[mx.array(np.flatnonzero(user_media))] = projected_media
    if (~user_media).any():
        text_rows = mx.array(np.flatnonzero(~user_media))
        user_parts[text_rows] = talker.text_projection(embeddings[rows[text_rows]])

    thinker_embed = model.thinker.language_model.model.embed_tokens
    specials = mx.array([speech.tts_bos_token_id, speech.tts_eos_token_id, speech.tts_pad_token_id])
    tts_bos, tts_eos, tts_pad = mx.split(talker.text_projection(thinker_embed(specials)), 3)

    answer = talker.text_projection(embeddings[start:])
    answer_text = mx.concatenate([answer[:3], mx.repeat(tts_pad, 4, axis=0), tts_bos,
                                  answer[3:4]])
    codec_ids = mx.array([talker_config.codec_nothink_id, talker_config.codec_think_bos_id,
                          talker_config.codec_think_eos_id, speaker_id,
                          talker_config.codec_pad_id, talker_config.codec_bos_id])
    codec = mx.concatenate([mx.zeros((3, answer.shape[1]), answer.dtype),
                            talker.model.codec_embedding(codec_ids)])
    trailing = mx.concatenate([answer[4:], tts_eos])
    # transformers moves tts_eos to just after the answer's end of sequence (the rows
    # after it hear tts_pad): entry j holds generated token j + 1
    eos = np.flatnonzero(np.isin(generated_ids, list(eos_ids)))
    first_eos = int(eos[0]) if len(eos) else len(generated_ids)
    if first_eos < trailing.shape[0]:
        rows_after = trailing.shape[0] - first_eos - 1
        trailing = mx.concatenate([trailing[:first_eos], tts_eos,
                                   mx.repeat(tts_pad, rows_after, axis=0)])

    prefill = mx.concatenate([user_parts, answer_text + codec])[None]
    positions = _positions(prompt_positions, prompt_ids, user, media, prefill.shape[1])
    return TalkerPrompt(prefill, positions, trailing, tts_pad)


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
