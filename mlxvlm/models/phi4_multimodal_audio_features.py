"""Phi-4-multimodal's audio features without torch: transformers'
``Phi4MultimodalFeatureExtractor`` computes its log-mel filter bank with torch only; this
subclass computes the same numbers in numpy.

Each clip (16 kHz mono) is cut into 25 ms frames every 10 ms (frames past the clip's end
are left out; in a batch, the padded clips' frames that reach into the padding are
zeroed as transformers zeroes them), pre-emphasized (0.97, the first sample against the
second) and scaled to 16-bit range, windowed (Hamming), transformed (a 512-point real
FFT in float64, its magnitudes in float32), and its power put through the 80 Kaldi mel
filters, floored at 1 and logged. A clip of ``n`` frames takes ``ceil(n / 8)`` audio
tokens (the encoder's time reduction), then ``audio_downsample_rate``'s.
"""

from __future__ import annotations

import numpy as np
from transformers import Phi4MultimodalFeatureExtractor
from transformers.feature_extraction_utils import BatchFeature

from mlxvlm.errors import MlxvlmError


def _ceil_div(value: np.ndarray, divisor: int) -> np.ndarray:
    return value // divisor + (value % divisor > 0)


class Phi4MultimodalFeatureExtractorNumpy(Phi4MultimodalFeatureExtractor):
    """transformers' ``Phi4MultimodalFeatureExtractor`` (settings, keyword arguments and
    outputs) on numpy."""

    def __call__(self, raw_speech, sampling_rate=None, pad_to_multiple_of=None,
                 padding="longest", max_length=None, truncation=False, return_tensors=None,
                 return_attention_mask=True, **kwargs) -> BatchFeature:
        if sampling_rate is not None and sampling_rate != self.sampling_rate:
            raise ValueError(
                f"{type(self).__name__} takes audio at {self.sampling_rate} Hz, not {sampling_rate}"
            )
        clips = raw_speech if isinstance(raw_speech, (list, tuple)) else [raw_speech]
        if not isinstance(raw_speech, (list, tuple)) and np.asarray(raw_speech).ndim > 1:
            clips = list(np.asarray(raw_speech))
        clips = [np.asarray(c, dtype=np.float32) for c in clips]
        clips = [c.mean(-1) if c.ndim > 1 else c for c in clips]  # mono
        for clip in clips:
            if len(clip) < self.win_length:  # transformers fails on it with no word why
                raise MlxvlmError(
                    f"an audio clip of {len(clip)} samples is shorter than one "
                    f"{1000 * self.win_length // self.sampling_rate} ms analysis frame "
                    f"({self.win_length} samples at {self.sampling_rate} Hz); send a longer clip")
        padded = self.pad(
            BatchFeature({"audio_input_features": [c[:, None] for c in clips],
                          "audio_lengths": [len(c) for c in clips]}),
            padding=padding, max_length=max_length, truncation=truncation,
            pad_to_multiple_of=pad_to_multiple_of, return_tensors="np",
        )
        waveform = np.asarray(padded["audio_input_features"], dtype=np.float32)[..., 0]
        lengths = np.asarray(padded["audio_lengths"], dtype=np.int64)
        features = self.log_mel(waveform, lengths)
        frames = (lengths - self.win_length) // self.hop_length + 1
        frames = frames * self.audio_feat_stride
        sizes = _ceil_div(_ceil_div(frames, self.audio_compression_rate), self.audio_downsample_rate)
        data = {"audio_input_features": features, "audio_embed_sizes": sizes}
        if len(frames) > 1 and return_attention_mask:
            data["audio_attention_mask"] = np.arange(frames.max())[None, :] < frames[:, None]
        return BatchFeature(data=data, tensor_type=return_tensors)

    def log_mel(self, waveform: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """(B, samples) float32 waveforms of ``lengths`` -> (B, frames, mel bins)."""
        win, hop = self.win_length, self.hop_length
        count = (waveform.shape[1] - win) // hop + 1
        starts = np.arange(count) * hop
        frames = waveform[:, starts[:, None] + np.arange(win)[None, :]]  # (B, frames, win)
        if len(waveform) > 1:
            # A shorter clip's frames that reach past its end read padding: transformers
            # zeroes those between the first such frame and the last one any clip has.
            shorter = np.nonzero(lengths != lengths.max())[0]
            if len(shorter):
                down = (lengths[shorter] - win) // hop + 1
                up = lengths[shorter] // hop - 1
                low, high = down.min(), up.max()
                index = np.arange(high - low)[None, :]
                hide = ((down - low)[:, None] <= index) & (index < (up - low)[:, None])
                for row, clip in enumerate(shorter):
                    window = frames[clip, low:high]
                    window[hide[row]] = 0
        previous = np.roll(frames, 1, axis=-1)
        previous[:, :, 0] = previous[:, :, 1]
        frames = (frames - np.float32(self.preemphasis) * previous) * np.float32(32768)
        window = np.hamming(win)  # float64, symmetric: torch's periodic=False
        spectrum = np.fft.rfft(window * frames.reshape(-1, win), n=self.n_fft, axis=1)
        magnitude = np.abs(spectrum.astype(np.complex64))
        power = (magnitude**2).reshape(frames.shape[0], frames.shape[1], -1)
        mel = power @ self.mel_filters.astype(np.float32)
        return np.log(np.maximum(mel, np.float32(1.0)))
