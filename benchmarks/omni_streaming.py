"""A spoken answer's time to first audio with the talker following the thinker, against
the talker started after the whole answer (how mlxvlm spoke before), on one full
Qwen3-Omni checkpoint (thinker, talker and code2wav).

    python benchmarks/omni_streaming.py --model PATH [--max-tokens 48] [--frames 96]
    python benchmarks/omni_streaming.py --real-shapes [--text-layers 28] [--max-tokens 48] \\
        [--frames 64] [--runs 2] [--transformers-frames 16] --output r.json

Both modes run the same greedy answer (thinker and talker argmax) through the public API
(``mlxvlm.load``, ``stream_generate``), alternating run by run (``--runs`` each), and
speak identical codes:

- ``follow``: ``stream_generate(..., audio_output=True)``: after each token the talker
  takes the rows the thinker has fed and steps, the codec decodes every 24 frames (4
  first);
- ``after``: the answer written with the thinker tap set, then ``speech.pipeline.speak``.

Each run records, from the call's start: the first token, the first audio chunk, the
text's last token, the end (the audio complete); how many text tokens came before the
first audio; the audio's seconds and the real-time factor (the talker and codec's own
seconds over the audio's). The load average is written beside each run (the machine may
be shared).

``--model``: the runs share one process (one load, a warm-up first). The tests' tiny
random checkpoint (``tests/tiny/qwen3_omni_speech.py``, seed 2, saved in the Hub's
layout) gave ``results/2026-12-06-intel-xeon-2c/omni-streaming-tiny.json``: at its widths
every step is overhead, so it shows the order of events (tokens written before the first
audio; identical codes), not what a real model's seconds are.

``--real-shapes``: the whole pipeline at Qwen3-Omni-30B-A3B-Instruct's shapes
(``checkpoints.py``'s ``qwen3-omni-30b-a3b``: random bf16 weights, the experts a token
uses, ``--text-layers`` of the thinker's 48 decoder layers, built on first use), with the
checkpoint's picture and 80-word prompt. Each run is a fresh process (its peak RSS is its
own), warmed up by a 2-token answer of 4 frames to the same prompt; the answer is exactly
``--max-tokens`` tokens (end of sequence ignored, as ``mlxvlm.benchmark --ignore-eos``)
and the talker speaks exactly ``--frames`` frames (the checkpoint's end-of-speech row is
zero). ``--transformers-frames N`` adds one run of transformers' whole model (bfloat16,
``generate(..., return_audio=True)``, greedy, the same prompt, N frames): its first audio
is its whole waveform, after the text and every frame.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = [{"role": "user", "content": "Describe a red circle."}]
REAL_SHAPES = "qwen3-omni-30b-a3b"


def run_follow(model, processor, max_tokens: int, frames: int, prompt=PROMPT,
               image=None) -> dict:
    import mlxvlm

    start = time.perf_counter()
    first_token = first_audio = text_done = None
    tokens_before_audio = tokens = 0
    speech = None
    for result in mlxvlm.stream_generate(model, processor, prompt, image, max_tokens=max_tokens,
                                         temperature=0.0, audio_output=True,
                                         talker_temperature=0, talker_max_frames=frames):
        now = time.perf_counter() - start
        if result.token is None:
            if first_audio is None and len(result.audio):
                first_audio, tokens_before_audio = now, tokens
            if result.speech is not None:
                speech = result.speech
        else:
            tokens += 1
            text_done = now
            first_token = first_token if first_token is not None else now
    return dict(mode="follow", first_token_s=first_token, first_audio_s=first_audio,
                text_done_s=text_done, total_s=time.perf_counter() - start, tokens=tokens,
                tokens_before_first_audio=tokens_before_audio, **spoken(speech))


def run_after(model, processor, max_tokens: int, frames: int, prompt=PROMPT,
              image=None) -> dict:
    import mlxvlm
    from mlxvlm.generate.speech import thinker_states
    from mlxvlm.generate.text import eos_token_ids
    from mlxvlm.speech.pipeline import speak

    start = time.perf_counter()
    first_token = None
    tokens = []
    with thinker_states(model) as tap:
        for result in mlxvlm.stream_generate(model, processor, prompt, image,
                                             max_tokens=max_tokens, temperature=0.0):
            if first_token is None:
                first_token = time.perf_counter() - start
            tokens.append(result.token)
            prompt_tokens = result.prompt_tokens
    text_done = time.perf_counter() - start
    speech = speak(model, tap, prompt_tokens, tokens, eos_token_ids(processor),
                   talker_temperature=0, max_frames=frames, started=start)
    return dict(mode="after", first_token_s=first_token, first_audio_s=speech.first_audio_seconds,
                text_done_s=text_done, total_s=time.perf_counter() - start, tokens=len(tokens),
                tokens_before_first_audio=len(tokens), **spoken(speech))


def spoken(speech) -> dict:
    """What a run's speech is: its seconds, frames, codes, and the talker and codec's own
    seconds over the audio's (the real-time factor)."""
    return dict(audio_s=speech.audio_seconds, frames=len(speech.codes),
                speech_work_s=speech.seconds,
                real_time_factor=speech.seconds / speech.audio_seconds if len(speech.audio) else None,
                codes=speech.codes.tolist())


@contextmanager
def eos_ignored(processor):
    """Exactly max_tokens whatever a random checkpoint samples (mlxvlm.benchmark's way)."""
    from mlxvlm.text.tokenization import processor_state

    state = processor_state(processor)
    saved, state.eos_token_ids = state.eos_token_ids, {-1}
    try:
        yield
    finally:
        state.eos_token_ids = saved


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def real_shapes_checkpoint(text_layers: int) -> Path:
    """checkpoints.py's Qwen3-Omni-30B-A3B-shaped checkpoint, built if missing."""
    sys.path.insert(0, str(HERE))
    from checkpoints import OUT

    directory = OUT / f"{REAL_SHAPES}-t{text_layers}-bf16"
    if not (directory / "benchmark.json").exists():
        subprocess.run([sys.executable, str(HERE / "checkpoints.py"), "--only", REAL_SHAPES,
                        "--text-layers", str(text_layers), "--no-quantized"], check=True)
    return directory


def real_prompt(directory: Path):
    """The checkpoint's picture and prompt, as chat messages."""
    saved = json.loads((directory / "benchmark.json").read_text())
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": saved["prompt"]}]}]
    return messages, str(directory / saved["image"])


def child_mlxvlm(mode: str, directory: Path, max_tokens: int, frames: int) -> dict:
    import mlxvlm

    start = time.perf_counter()
    model, processor = mlxvlm.load(str(directory))
    load_s = time.perf_counter() - start
    messages, image = real_prompt(directory)
    run = run_follow if mode == "follow" else run_after
    with eos_ignored(processor):
        # warm-up, with the picture: kernels built, caches allocated, every weight read
        run_follow(model, processor, 2, 4, messages, [image])
        result = run(model, processor, max_tokens, frames, messages, [image])
    return dict(result, engine="mlxvlm", load_s=load_s, peak_rss_gb=peak_rss_gb())


class TokenTimes:
    """A streamer for transformers' thinker: when its first new token and its last come."""

    def __init__(self):
        self.start = time.perf_counter()
        self.puts = 0
        self.first = self.last = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:  # the first put is the prompt
            self.first = time.perf_counter() - self.start
        self.last = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def child_transformers(directory: Path, max_tokens: int, frames: int) -> dict:
    import torch
    from transformers import (AutoTokenizer, Qwen2VLImageProcessorPil,
                              Qwen3OmniMoeForConditionalGeneration, Qwen3OmniMoeProcessor,
                              WhisperFeatureExtractor)
    from PIL import Image

    from mlxvlm.models.processor_utils import image_only

    torch.set_grad_enabled(False)
    start = time.perf_counter()
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        str(directory), dtype=torch.bfloat16).eval()
    load_s = time.perf_counter() - start
    # transformers' processor from the checkpoint's parts (its video processor needs
    # torchvision, which this host lacks)
    processor = image_only(Qwen3OmniMoeProcessor)(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(str(directory)),
        video_processor=None,
        feature_extractor=WhisperFeatureExtractor.from_pretrained(str(directory)),
        tokenizer=AutoTokenizer.from_pretrained(str(directory)),
        chat_template=(directory / "chat_template.jinja").read_text())
    messages, image = real_prompt(directory)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[Image.open(image).convert("RGB")],
                       return_tensors="pt")
    times = TokenTimes()
    output = model.generate(
        **inputs, return_audio=True, speaker="Ethan", thinker_max_new_tokens=max_tokens,
        thinker_do_sample=False, thinker_streamer=times, thinker_eos_token_id=None,
        talker_max_new_tokens=frames + 1, talker_do_sample=False,
        talker_repetition_penalty=1.0)
    total = time.perf_counter() - times.start
    sequences, audio = output
    audio_s = audio.numel() / 24000 if audio is not None else 0.0
    return dict(engine="transformers", mode="after", load_s=load_s,
                first_token_s=times.first, text_done_s=times.last, first_audio_s=total,
                total_s=total, tokens=int(sequences.shape[-1] - inputs["input_ids"].shape[-1]),
                audio_s=audio_s, frames=round(audio_s * 12.5),
                real_time_factor=(total - times.last) / audio_s if audio_s else None,
                peak_rss_gb=peak_rss_gb())


def run_child(mode: str, args) -> dict:
    load_average = os.getloadavg()[0]
    child = subprocess.run([sys.executable, __file__, "--child", mode, "--text-layers",
                            str(args.text_layers), "--max-tokens", str(args.max_tokens),
                            "--frames", str(args.transformers_frames if mode == "transformers"
                                            else args.frames)],
                           capture_output=True, text=True)
    if child.returncode != 0:
        raise SystemExit(f"error: the {mode} run failed:\n{child.stderr[-3000:]}")
    result = json.loads(child.stdout.strip().splitlines()[-1])
    result["load_average"] = [load_average, os.getloadavg()[0]]  # at its start and end
    codes = result.pop("codes", None)
    result["codes_sha1"] = (hashlib.sha1(json.dumps(codes).encode()).hexdigest()
                            if codes is not None else None)
    return result


def table(runs: list[dict]) -> str:
    """The runs as a Markdown table, in the order they ran; seconds from the call's start."""
    lines = ["| engine, speech | load average | first token s | first audio s | first audio "
             "after first token s | tokens before it | text done s | audio done s | audio s "
             "| real-time factor | peak RSS GB |", "|" + "---|" * 11]
    for r in runs:
        mode = "talker follows" if r["mode"] == "follow" else "talker after the text"
        lines.append(
            f"| {r['engine']}, {mode} | {r['load_average'][0]:.1f}-{r['load_average'][1]:.1f} "
            f"| {r['first_token_s']:.1f} | {r['first_audio_s']:.1f} "
            f"| {r['first_audio_s'] - r['first_token_s']:.1f} "
            f"| {r.get('tokens_before_first_audio', r['tokens'])} | {r['text_done_s']:.1f} "
            f"| {r['total_s']:.1f} | {r['audio_s']:.2f} | {r['real_time_factor']:.1f} "
            f"| {r['peak_rss_gb']:.2f} |")
    return "\n".join(lines)


def real_shapes(args) -> None:
    directory = real_shapes_checkpoint(args.text_layers)
    runs = []
    for _ in range(args.runs):
        for mode in ("follow", "after"):
            runs.append(run_child(mode, args))
            print(json.dumps(runs[-1]), flush=True)
    if args.transformers_frames:
        runs.append(run_child("transformers", args))
        print(json.dumps(runs[-1]), flush=True)
    mlx_runs = [r for r in runs if r["engine"] == "mlxvlm"]
    same = all(r["codes_sha1"] == mlx_runs[0]["codes_sha1"] for r in mlx_runs) if mlx_runs else None
    print(f"identical codes in every mlxvlm run: {same}")
    print(table(runs))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(dict(
            checkpoint=directory.name, text_layers=args.text_layers,
            max_tokens=args.max_tokens, frames=args.frames,
            transformers_frames=args.transformers_frames, identical_codes=same,
            runs=runs), indent=2))


def tiny(args) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="a full Qwen3-Omni checkpoint")
    where.add_argument("--real-shapes", action="store_true",
                       help="checkpoints.py's Qwen3-Omni-30B-A3B-shaped checkpoint")
    where.add_argument("--child", choices=("follow", "after", "transformers"),
                       help=argparse.SUPPRESS)  # one --real-shapes run
    parser.add_argument("--text-layers", type=int, default=28,
                        help="--real-shapes: the thinker's decoder layers kept (of 48)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--frames", type=int, default=None,
                        help="talker frames (default 96, or 64 with --real-shapes)")
    parser.add_argument("--runs", type=int, default=None,
                        help="runs of each mode (default 3, or 2 with --real-shapes; 0 with "
                             "--transformers-frames: transformers only)")
    parser.add_argument("--transformers-frames", type=int, default=0,
                        help="--real-shapes: also one run of transformers with this many frames")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    real = args.real_shapes or args.child is not None
    args.frames = args.frames or (64 if real else 96)
    args.runs = args.runs if args.runs is not None else (2 if real else 3)
    if args.child is not None:
        directory = real_shapes_checkpoint(args.text_layers)
        if args.child == "transformers":
            result = child_transformers(directory, args.max_tokens, args.frames)
        else:
            result = child_mlxvlm(args.child, directory, args.max_tokens, args.frames)
        print(json.dumps(result))
    elif args.real_shapes:
        real_shapes(args)
    else:
        tiny(args)


if __name__ == "__main__":
    main()
