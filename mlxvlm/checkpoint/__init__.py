"""Reading and writing checkpoints: ``loading`` (a local folder or a Hub repo -> model and
processor: config, family, weights, quantization, processor, sampling defaults, the CPU
fast paths), ``quantization`` (what a checkpoint's quantization config says, and
quantizing a model), ``adapters`` (LoRA/DoRA adapters in PEFT's format)."""
