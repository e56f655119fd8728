"""MiniCPM-OCR (``minicpm_ocr``; OpenBMB, 2026): a document reader built as MiniCPM-V 4.6
is (``minicpmv4_6.py``: the picture and its slices through the SigLIP tower, the merger,
Qwen3.5's hybrid text model; transformers' modeling file is MiniCPM-V 4.6's under
another name), with other defaults:

- ``downsample_mode`` ``"4x"``: the tower's window merger is skipped, so every 2 x 2
  patches give one token (four times MiniCPM-V 4.6's), which dense text needs;
- tied input and output embeddings unless the config says otherwise;
- its image processor (``minicpm_ocr_images.py``, torchvision's in transformers) sizes
  views for the ``"4x"`` grid and may keep small pictures at their own size
  (``small_image_upsize``).

The processor is transformers' ``MiniCPMOcrProcessor`` (MiniCPM-V 4.6's under its own
name): images, video (``minicpm_video.py``, ``"4x"``) and text.
"""

from __future__ import annotations

from pathlib import Path

from mlxvlm.models import minicpmv4_6

MODEL_TYPE = "minicpm_ocr"


class Model(minicpmv4_6.Model):
    @classmethod
    def from_config(cls, config: dict) -> "Model":
        return cls(minicpmv4_6.ModelArgs.from_hf(config, MODEL_TYPE))

    @classmethod
    def load_processor(cls, model_path: str | Path, config: dict):
        from mlxvlm.models.minicpm_ocr_images import MiniCPMOcrImageProcessorPil
        from mlxvlm.models.minicpm_video import MiniCPMOcrVideoProcessor

        return minicpmv4_6.load_minicpm_processor(
            model_path, MiniCPMOcrImageProcessorPil, MiniCPMOcrVideoProcessor,
            "MiniCPMOcrProcessor")


# Module names for callers outside the models package (tests, tools).
is_hf_checkpoint = Model.is_hf_checkpoint
load_processor = Model.load_processor
