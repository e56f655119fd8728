"""Speech out: the stages that turn a thinker's answer into audio, each an object a
pipeline drives step by step (so that a streaming orchestrator can drive them chunk by
chunk, across requests):

- ``qwen3_omni_prompt``: the talker's text (its prefill, then one row per answer token)
  from the thinker's ids and hidden states as the answer is written (Qwen3-Omni's, as
  transformers builds it);
- ``talker``: the talker's stream of codec frames (its first code, then the code
  predictor's other groups), with its sampling (seeded per draw);
- ``codec``: code2wav as a stream of waveform chunks that concatenate exactly;
- ``stages``: each speaking family's text follower, talker and codec, by name;
- ``voices``: a checkpoint's voices by name; ``wav``: 16-bit PCM WAV files;
- ``duration``: codec frames per second of audio, the frames a bound in seconds allows;
- ``pipeline``: an answer spoken as it is written (``AnswerSpeaker``: the talker follows
  the thinker token by token), or after (``speak``), with identical codes.
- ``talker_seed``: each sampled draw of a talker seeded from the request's seed;
- Qwen2.5-Omni's: ``qwen2_5_omni_prompt`` (its talker text, the prefill once the answer's
  first token is fed, then one row per token), ``qwen2_5_omni_talker`` (one code per
  frame), ``qwen2_5_omni_codec`` (token2wav over all the codes), ``spk_dict`` (its voices
  file, read without torch).
"""
