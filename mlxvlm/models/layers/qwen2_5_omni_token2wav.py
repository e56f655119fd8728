"""Qwen2.5-Omni's token2wav (``token2wav`` in checkpoints): codec codes -> 24 kHz
samples, the DiT's mel (``layers/qwen2_5_omni_dit.py``) through BigVGAN
(``layers/qwen2_5_omni_bigvgan.py``), in a voice given by its conditioning vector and
reference mel.

It stays float32 whatever the checkpoint's dtype, as transformers runs it
(``token2wav.float()``), and ``convert -q`` leaves it unquantized: the ODE integrates the
DiT's output ten times over and BigVGAN's errors reach the waveform directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlxvlm.models.layers.qwen2_5_omni_bigvgan import BigVGAN, BigVGANConfig
from mlxvlm.models.layers.qwen2_5_omni_dit import DiT, DiTConfig


@dataclass(frozen=True)
class Token2WavConfig:
    dit: DiTConfig
    bigvgan: BigVGANConfig

    @classmethod
    def from_hf(cls, config: dict) -> "Token2WavConfig":
        return cls(DiTConfig.from_hf(config.get("dit_config") or {}),
                   BigVGANConfig.from_hf(config.get("bigvgan_config") or {}))

    @property
    def samples_per_code(self) -> int:
        return self.dit.repeats * self.bigvgan.samples_per_frame


class Token2Wav(nn.Module):
    def __init__(self, config: Token2WavConfig):
        super().__init__()
        self.config = config
        self.code2wav_dit_model = DiT(config.dit)
        self.code2wav_bigvgan_model = BigVGAN(config.bigvgan)

    def __call__(self, codes: mx.array, conditioning: mx.array, reference_mel: mx.array,
                 noise: mx.array | None = None, **sampling) -> mx.array:
        """``codes`` (1, frames) -> samples (1, frames x samples_per_code); ``sampling``:
        the DiT's ``num_steps``, ``guidance_scale``, ``sway_coefficient``, ``seed``."""
        mel = self.code2wav_dit_model.sample(codes, conditioning.astype(mx.float32),
                                             reference_mel.astype(mx.float32), noise, **sampling)
        return self.code2wav_bigvgan_model(mel)

    @staticmethod
    def sanitize(name: str, value: mx.array) -> mx.array | None:
        """A Hugging Face tensor (``name`` after ``token2wav.``) in this module's layout:
        convolution weights (out, in, k) -> (out, k, in), the transposed ones (BigVGAN's
        ``ups``; (in, out, k)) -> (out, k, in); recomputed buffers dropped."""
        if name.endswith(("inv_freq", ".filter")):
            return None
        if value.ndim != 3:
            return value
        if ".ups." in f".{name}":
            return value.transpose(1, 2, 0)
        return value.transpose(0, 2, 1)
