"""transformers + PyTorch (CPU, float32 unless --dtype says otherwise) on the benchmark checkpoint."""

from __future__ import annotations

import time

import torch
from common import Stopwatch, parse_args
from PIL import Image
from transformers import AutoModelForImageTextToText
from transformers.generation.streamers import BaseStreamer


class TokenTimes(BaseStreamer):
    """generate() calls put() once with the prompt, then once per new token."""

    def __init__(self, watch: Stopwatch):
        self.watch, self.seen_prompt = watch, False

    def put(self, value):
        if self.seen_prompt:
            self.watch.token()
        self.seen_prompt = True

    def end(self):
        pass




def load_processor(path: str):
    import json
    from pathlib import Path

    from mlxvlm.models import get_family

    config = json.loads((Path(path) / "config.json").read_text())
    return get_family(config["model_type"]).load_processor(Path(path), config)


args = parse_args()
torch.set_grad_enabled(False)
start = time.perf_counter()
# transformers' own processor class for the family, built from its PIL image processor
# (AutoProcessor needs torchvision for some families' video processors).
processor = load_processor(args.model)
model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
load_s = time.perf_counter() - start
image = Image.open(args.image).convert("RGB")
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": args.prompt}]}]
for _ in range(args.runs):
    watch = Stopwatch()
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    # Pixels in the weights' dtype, as the model cards do (some towers, DeepSeek-OCR 2's SAM
    # convolution, do not cast float32 pixels to bfloat16 weights themselves)
    inputs = {key: value.to(model.dtype) if value.is_floating_point() else value
              for key, value in inputs.items()}
    model.generate(**inputs, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                   do_sample=False, streamer=TokenTimes(watch))
    watch.report("transformers", load_s, int(inputs["input_ids"].shape[1]), 0.0)
