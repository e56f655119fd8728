"""mlx-vlm (run with an interpreter that has it installed) on the benchmark checkpoint."""

from __future__ import annotations

import time

import mlx.core as mx
from common import Stopwatch, parse_args
from mlx_vlm import load, stream_generate
from mlx_vlm.prompt_utils import apply_chat_template

args = parse_args()
start = time.perf_counter()
model, processor = load(args.model)
load_s = time.perf_counter() - start
for _ in range(args.runs):
    mx.reset_peak_memory()
    watch = Stopwatch()
    prompt = apply_chat_template(processor, model.config, args.prompt, num_images=1)
    last = None
    for last in stream_generate(model, processor, prompt, image=[args.image], max_tokens=args.max_tokens):
        if last.token is not None:
            watch.token()
    watch.report("mlx-vlm", load_s, last.prompt_tokens, mx.get_peak_memory() / 1e9)
