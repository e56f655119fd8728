"""A spoken conversation's turns with and without the prompt cache: how many prompt tokens
each spoken turn prefills, its time to first token and to first audio, in process on the
batching engine (as the server and the chat UI run it).

    python benchmarks/spoken_prefix_reuse.py --model PATH
    python benchmarks/spoken_prefix_reuse.py --model PATH --turns 4 --runs 3 --output r.json
    MLXVLM_ALLOW_TORCH=1 python benchmarks/spoken_prefix_reuse.py --build DIR  # then --model DIR

``--build DIR`` writes a mid-sized random speaking Qwen3-Omni: the tests' tiny one
(``tests/tiny/qwen3_omni_speech.py``, seed 2: its talker and code2wav) with a wider and
deeper thinker (``MID_TEXT``, ``MID_VISION``: a 12-layer 1024-wide MoE of 8 experts, 2 a
token; a 4-layer vision tower), float32, about 1 GB: big enough that a prefill's tokens
cost what they cost, small enough for a shared 2-core machine.

Variants, alternating run by run: ``reuse``, an engine with a ``PrefixCache`` (a spoken
turn reuses the entry the previous spoken turn left, its tap's records with it);
``none``, an engine without one -- every spoken turn prefills the whole conversation,
which is what a spoken turn did before its entry kept its tap's records, whatever the
cache. One run is one conversation of ``--turns`` spoken turns (greedy thinker and
talker), the first with an image (``--image-size`` px); each later turn is the earlier
ones, the previous answer's text as the assistant's message, then a new question, as a
chat client sends it. Both variants must say the same (checked). The load average is
written beside each run (the machine may be shared).

It also prints what a spoken entry's tap records cost per token at
Qwen/Qwen3-Omni-30B-A3B-Instruct's thinker widths beside its KV cache's (measured from
``TapRecords`` and mlx-lm's ``KVCache`` holding such arrays).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

import mlxvlm  # first: it sets up the CPU backend before MLX loads

import mlx.core as mx
import numpy as np
from PIL import Image

from mlxvlm.batching import BatchAudio, BatchEngine, BatchStep, SamplingOptions
from mlxvlm.batching.prefix_cache import PrefixCache, image_hash
from mlxvlm.generate.speech import SpeechRequest
from mlxvlm.models.layers.hidden_tap import TapRecords
from mlxvlm.prompt import prepare_inputs

QUESTIONS = ["What do you see in this picture?", "What colours are in it?",
             "Which shape is the largest?", "Describe it again in one sentence.",
             "Is there anything round?", "Say it once more."]

# Qwen/Qwen3-Omni-30B-A3B-Instruct's thinker (its config.json's thinker_config.text_config):
# 48 layers of 2048, 4 KV heads of 128; its talker reads layer 24 (accept_hidden_layer).
THINKER_WIDTH, THINKER_LAYERS, KV_HEADS, HEAD_DIM = 2048, 48, 4, 128

# --build's thinker, over the tiny one's config
MID_TEXT = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=12,
                num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768)
MID_ROPE_SECTION = [24, 20, 20]
MID_VISION = dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4,
                  out_hidden_size=1024)


def build(directory: str) -> Path:
    """The mid-sized speaking checkpoint, written to ``directory``."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny import qwen3_omni, qwen3_omni_speech

    tiny_config = qwen3_omni._config

    def mid_config(tokenizer):
        config = tiny_config(tokenizer)
        for name, value in MID_TEXT.items():
            setattr(config.text_config, name, value)
        config.text_config.rope_parameters["mrope_section"] = MID_ROPE_SECTION
        for name, value in MID_VISION.items():
            setattr(config.vision_config, name, value)
        return config

    qwen3_omni._config = mid_config
    try:
        model = qwen3_omni_speech.build_tiny_model("qwen3_omni_moe_speech", seed=2)
    finally:
        qwen3_omni._config = tiny_config
    return qwen3_omni_speech.save_checkpoint(model, directory, "hub")


def picture(size: int) -> Image.Image:
    ys, xs = np.mgrid[0:size, 0:size] / size
    pixels = np.stack([xs, ys, (xs + ys) / 2], axis=-1) * 255
    pixels[(xs - 0.5) ** 2 + (ys - 0.5) ** 2 < 0.05] = [200, 30, 30]
    return Image.fromarray(pixels.astype(np.uint8))


def bytes_per_token(dtype: mx.Dtype, tokens: int = 256) -> dict:
    """A spoken entry's tap records and its KV cache, per token, at the 30B-A3B widths."""
    from mlx_lm.models.cache import KVCache

    records = TapRecords(24, mx.zeros((1, tokens), mx.int32),
                         mx.zeros((1, tokens, THINKER_WIDTH), dtype),
                         mx.zeros((1, tokens, THINKER_WIDTH), dtype))
    kv = 0
    for _ in range(THINKER_LAYERS):
        cache = KVCache()
        keys = mx.zeros((1, KV_HEADS, tokens, HEAD_DIM), dtype)
        cache.update_and_fetch(keys, keys)
        kv += cache.nbytes
    return dict(dtype=str(dtype), tap_records=records.nbytes / tokens, kv_cache=kv / tokens,
                records_over_kv=records.nbytes / kv)


def one_turn(engine: BatchEngine, processor, model, messages, image, args) -> dict:
    inputs = prepare_inputs(processor, messages, image=[image],
                            feature_names=getattr(model, "feature_names", None))
    items: list = []
    done = threading.Event()
    times: dict[str, float] = {}

    def deliver(item):
        now = time.perf_counter()
        if isinstance(item, BatchStep):
            times.setdefault("first_token_s", now - start)
        elif isinstance(item, BatchAudio) and len(item.chunk):
            times.setdefault("first_audio_s", now - start)
        items.append(item)
        if isinstance(item, BaseException) or (isinstance(item, BatchAudio)
                                               and item.speech is not None):
            times["end_s"] = now - start
            done.set()

    start = time.perf_counter()
    engine.submit(inputs, SamplingOptions(max_tokens=args.max_tokens, temperature=0.0),
                  deliver, image_hashes=[image_hash(image)],
                  speech=SpeechRequest(None, 0, args.frames))
    if not done.wait(1800):
        raise RuntimeError("a turn did not end in 30 minutes")
    if isinstance(items[-1], BaseException):
        raise items[-1]
    steps = [item for item in items if isinstance(item, BatchStep)]
    speech = items[-1].speech
    return dict(prompt_tokens=steps[0].prompt_tokens, cached_tokens=steps[0].cached_tokens,
                prefilled_tokens=steps[0].prompt_tokens - steps[0].cached_tokens, **times,
                text="".join(step.text for step in steps),
                codes=np.asarray(speech.codes).tolist(), audio_seconds=len(speech.audio)
                / speech.sample_rate)


def conversation(model, processor, prefix_cache: PrefixCache | None, args) -> dict:
    engine = BatchEngine(model, processor, prefix_cache=prefix_cache,
                         prefill_step_size=args.prefill_step_size)
    engine.start()
    image = picture(args.image_size)
    turns, messages = [], []
    try:
        for turn in range(args.turns):
            question = QUESTIONS[turn % len(QUESTIONS)]
            content = ([{"type": "image"}] if turn == 0 else []) + [{"type": "text",
                                                                       "text": question}]
            messages.append({"role": "user", "content": content})
            result = one_turn(engine, processor, model, messages, image, args)
            messages.append({"role": "assistant", "content": result["text"]})
            result["cache_bytes"] = prefix_cache.nbytes if prefix_cache is not None else 0
            turns.append(result)
    finally:
        engine.close()
    return dict(load_average=os.getloadavg(), turns=turns)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a speaking checkpoint (Qwen3-Omni, Qwen2.5-Omni)")
    parser.add_argument("--build", metavar="DIR", help="write the mid-sized checkpoint to DIR")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--prefill-step-size", type=int, default=2048)
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    if args.build:
        print(build(args.build))
        return 0
    widths = [bytes_per_token(mx.bfloat16), bytes_per_token(mx.float32)]
    for row in widths:
        print(f"30B-A3B widths, {row['dtype']}: tap records {row['tap_records']:.0f} B/token, "
              f"KV cache {row['kv_cache']:.0f} B/token ({100 * row['records_over_kv']:.1f}%)")
    if args.model is None:
        return 0
    model, processor = mlxvlm.load(args.model)
    runs: dict[str, list] = {"reuse": [], "none": []}
    reference = None
    for run in range(args.runs):
        for name in runs:
            result = conversation(model, processor, PrefixCache() if name == "reuse" else None,
                                  args)
            said = [(t["text"], t["codes"]) for t in result["turns"]]
            reference = reference or said
            if said != reference:
                raise RuntimeError(f"{name} said other text or codes than the first run")
            for turn in result["turns"]:
                del turn["codes"], turn["text"]
            runs[name].append(result)
            print(f"run {run + 1} {name} (load {result['load_average'][0]:.2f}): "
                  + "; ".join(f"turn {i + 1} prefilled {t['prefilled_tokens']}/"
                              f"{t['prompt_tokens']}, first token {t['first_token_s']:.3f} s, "
                              f"first audio {t.get('first_audio_s', float('nan')):.3f} s"
                              for i, t in enumerate(result["turns"])), flush=True)
    summary = {name: [dict(prefilled_tokens=results[0]["turns"][i]["prefilled_tokens"],
                           prompt_tokens=results[0]["turns"][i]["prompt_tokens"],
                           first_token_s=statistics.median(
                               r["turns"][i]["first_token_s"] for r in results),
                           first_audio_s=statistics.median(
                               r["turns"][i].get("first_audio_s", float("nan"))
                               for r in results))
                      for i in range(args.turns)]
               for name, results in runs.items()}
    print(json.dumps(summary, indent=1))
    if args.output:
        Path(args.output).write_text(json.dumps(
            dict(args=vars(args), widths=widths, summary=summary, runs=runs), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
