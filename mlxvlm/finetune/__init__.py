"""Fine-tuning: LoRA, DoRA (QLoRA on quantized checkpoints) and full fine-tuning of a
vision-language model on conversations with images, saving PEFT-format adapters.

    python -m mlxvlm.finetune --model Qwen/Qwen2-VL-2B-Instruct --data data/ --iters 600

From Python: ``finetune(FinetuneConfig(model=..., data=..., ...))``. The pieces:
``data`` (records from JSONL or Hugging Face datasets), ``masking`` (assistant tokens
through the chat template), ``dataset`` (checked examples and their order), ``tuning``
(LoRA/DoRA/full), ``trainer`` (the loop), ``checkpoints`` (atomic save, resume),
``progress`` (a bar on a terminal, plain lines in a log), ``run``.
"""

from mlxvlm.finetune.config import FinetuneConfig
from mlxvlm.finetune.run import FinetuneResult, finetune

__all__ = ["FinetuneConfig", "FinetuneResult", "finetune"]
