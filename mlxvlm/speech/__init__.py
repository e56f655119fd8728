"""Speech out: the stages that turn a thinker's answer into audio, each an object a
pipeline drives step by step (so that a streaming orchestrator can drive them chunk by
chunk, across requests):

- ``qwen3_omni_prompt``: the talker's prompt from the thinker's ids and hidden states
  (Qwen3-Omni's, as transformers builds it);
- ``talker``: the talker's stream of codec frames (its first code, then the code
  predictor's other groups), with its sampling;
- ``codec``: code2wav as a stream of waveform chunks that concatenate exactly;
- ``voices``: a checkpoint's voices by name; ``wav``: 16-bit PCM WAV files;
- Qwen2.5-Omni's: ``qwen2_5_omni_prompt`` (its talker prompt), ``qwen2_5_omni_talker``
  (one code per frame), ``qwen2_5_omni_codec`` (token2wav over all the codes),
  ``spk_dict`` (its voices file, read without torch);
- ``stages``: each speaking family's stages, by the name its model gives;
- ``pipeline``: a whole answer spoken, the stages run one after another (what
  ``generate(..., audio_output=True)`` uses).
"""
