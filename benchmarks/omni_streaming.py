"""A spoken answer's time to first audio with the talker following the thinker, against
the talker started after the whole answer (how mlxvlm spoke before), on one full
Qwen3-Omni checkpoint (thinker, talker and code2wav).

    python benchmarks/omni_streaming.py --model PATH [--max-tokens 48] [--frames 96]

Both modes run the same greedy answer (thinker and talker argmax) in the same process,
alternating run by run (``--runs`` each), and speak identical codes:

- ``follow``: ``stream_generate(..., audio_output=True)``: after each token the talker
  takes the rows the thinker has fed and steps, the codec decodes every 24 frames (4
  first);
- ``after``: the answer written with the thinker tap set, then ``speech.pipeline.speak``.

Each run records, from the call's start: the first audio chunk, the text's last token,
the end; and how many text tokens came before the first audio. The load average is
written beside each run (the machine may be shared).

``results/2026-12-06-intel-xeon-2c/omni-streaming-tiny.json`` was taken on the tests'
tiny random checkpoint (``tests/tiny/qwen3_omni_speech.py``, seed 2, saved in the Hub's
layout): at its widths every step is overhead, so it shows the order of events (tokens
written before the first audio; identical codes), not what a real model's seconds are.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

PROMPT = [{"role": "user", "content": "Describe a red circle."}]


def run_follow(model, processor, max_tokens: int, frames: int) -> dict:
    import mlxvlm

    start = time.perf_counter()
    first_audio = text_done = None
    tokens_before_audio = tokens = 0
    codes = None
    for result in mlxvlm.stream_generate(model, processor, PROMPT, max_tokens=max_tokens,
                                         temperature=0.0, audio_output=True,
                                         talker_temperature=0, talker_max_frames=frames):
        now = time.perf_counter() - start
        if result.token is None:
            if first_audio is None and len(result.audio):
                first_audio, tokens_before_audio = now, tokens
            if result.speech is not None:
                codes = result.speech.codes
                audio_seconds = result.speech.audio_seconds
        else:
            tokens += 1
            text_done = now
    return dict(mode="follow", first_audio_s=first_audio, text_done_s=text_done,
                total_s=time.perf_counter() - start, tokens=tokens,
                tokens_before_first_audio=tokens_before_audio, audio_s=audio_seconds,
                codes=codes.tolist())


def run_after(model, processor, max_tokens: int, frames: int) -> dict:
    import mlxvlm
    from mlxvlm.generate.speech import thinker_states
    from mlxvlm.generate.text import eos_token_ids
    from mlxvlm.speech.pipeline import speak

    start = time.perf_counter()
    tokens = []
    with thinker_states(model) as tap:
        for result in mlxvlm.stream_generate(model, processor, PROMPT, max_tokens=max_tokens,
                                             temperature=0.0):
            tokens.append(result.token)
            prompt_tokens = result.prompt_tokens
    text_done = time.perf_counter() - start
    speech = speak(model, tap, prompt_tokens, tokens, eos_token_ids(processor),
                   talker_temperature=0, max_frames=frames, started=start)
    return dict(mode="after", first_audio_s=speech.first_audio_seconds, text_done_s=text_done,
                total_s=time.perf_counter() - start, tokens=len(tokens),
                tokens_before_first_audio=len(tokens), audio_s=speech.audio_seconds,
                codes=speech.codes.tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a full Qwen3-Omni checkpoint")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--frames", type=int, default=96)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    import mlxvlm

    model, processor = mlxvlm.load(args.model)
    run_follow(model, processor, 4, 4)  # warm-up: kernels built, caches allocated
    runs = []
    for _ in range(args.runs):
        for run in (run_follow, run_after):
            result = run(model, processor, args.max_tokens, args.frames)
            result["load_average"] = os.getloadavg()[0]
            runs.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "codes"}))
    same = all(r["codes"] == runs[0]["codes"] for r in runs)
    print(f"identical codes in every run: {same}")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        codes = runs[0]["codes"]
        runs = [{k: v for k, v in run.items() if k != "codes"} for run in runs]
        args.output.write_text(json.dumps(dict(model=args.model, max_tokens=args.max_tokens,
                                               frames=args.frames, identical_codes=same,
                                               runs=runs, codes=codes)))


if __name__ == "__main__":
    main()
