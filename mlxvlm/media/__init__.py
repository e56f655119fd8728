"""Loading media -- images, video frames and audio -- from user input.

Every loader takes the same kinds of *source*, reads it under one :class:`MediaPolicy`
(where it may come from), and fails with a one-line :class:`MediaError` that names the
input (shortened), says what was wrong and what to do about it.

The package is layered so that video and audio reuse the lower half:

- ``errors``     -- :class:`MediaError`, :func:`describe_source`
- ``policy``     -- :class:`MediaPolicy`; ``options`` -- :class:`MediaOptions` (a
                    ``generate`` call's video sampling and policy); ``option_names`` -- what each entry point calls
                    its options, for the fixes errors suggest
- ``sources``    -- a path, http(s) URL (``public_net``: public addresses only), data URL
                    or bytes to encoded bytes, under the policy
- ``budget``     -- :class:`PixelBudget`, a server's pixels across the requests it prepares
- ``decode_work`` -- what decoding a request's video and audio costs (frames, pixels, CPU
                    seconds) against the policy, and its cancellation (``preparing``)
- ``images``     -- :func:`load_image`, :func:`load_images`
- ``containers`` -- PyAV's containers opened safely over any source
- ``audio``, ``video`` -- :func:`load_audio`, :func:`load_video` (frames sampled at ``fps``
                    within a pixel budget, plus the sound track)
- ``pdf``        -- :func:`load_pdf`, :func:`open_pdf`: a PDF's pages rendered to images
                    (pypdfium2), one page at a time, under a page count and pixel cap

Decoding untrusted input is the risky part, so the limits are enforced as early as
possible: ``max_bytes`` before a body is read in full (Content-Length, file size, base64
length), ``max_pixels`` from the image header before any pixel data is decoded, a video's
frame size (``max_image_pixels``, as for an image), frame count and decoded pixels from
its container before decoding and again while decoding, the CPU time of decoding and an
audio's length while it is decoded.
"""

from mlxvlm.media.audio import (
    DEFAULT_AUDIO_RATE,
    DEFAULT_MAX_AUDIO_BYTES,
    DEFAULT_MAX_AUDIO_SECONDS,
    Audio,
    load_audio,
    resample_audio,
)
from mlxvlm.media.budget import PixelBudget, PixelBudgetError, default_pixel_budget
from mlxvlm.media.decode_work import PreparationCancelled, preparing
from mlxvlm.media.errors import MediaError, MediaLimitError, describe_source
from mlxvlm.media.images import ImageSource, load_image, load_images
from mlxvlm.media.option_names import NO_NAMES, OptionNames
from mlxvlm.media.options import MediaOptions
from mlxvlm.media.pdf import DEFAULT_DPI, load_pdf, looks_like_pdf, open_pdf
from mlxvlm.media.policy import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_PIXELS,
    DEFAULT_TIMEOUT,
    SERVED_MAX_DECODE_SECONDS,
    SERVED_MAX_VIDEO_DECODE_PIXELS,
    SERVED_MAX_VIDEO_FRAMES,
    MediaPolicy,
)
from mlxvlm.media.video import (
    DEFAULT_FPS,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MAX_VIDEO_BYTES,
    DEFAULT_MAX_VIDEO_PIXELS,
    Video,
    fit_pixel_budget,
    load_video,
    sample_frame_indices,
)

__all__ = [
    "MediaError", "MediaLimitError", "MediaOptions", "MediaPolicy", "OptionNames", "NO_NAMES",
    "PreparationCancelled", "preparing", "SERVED_MAX_VIDEO_FRAMES",
    "SERVED_MAX_VIDEO_DECODE_PIXELS", "SERVED_MAX_DECODE_SECONDS", "ImageSource", "load_image", "load_images",
    "describe_source", "Video", "Audio", "load_video", "load_audio", "resample_audio",
    "fit_pixel_budget", "sample_frame_indices", "PixelBudget", "PixelBudgetError",
    "default_pixel_budget", "DEFAULT_TIMEOUT", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_PIXELS",
    "DEFAULT_FPS", "DEFAULT_MAX_FRAMES", "DEFAULT_MAX_VIDEO_BYTES",
    "DEFAULT_MAX_VIDEO_PIXELS", "DEFAULT_AUDIO_RATE", "DEFAULT_MAX_AUDIO_BYTES",
    "DEFAULT_MAX_AUDIO_SECONDS", "load_pdf", "open_pdf", "looks_like_pdf", "DEFAULT_DPI",
]
