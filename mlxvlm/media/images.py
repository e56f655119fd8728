"""Images: any source (a path, URL, data URL, bytes, a PIL image or an array) to an
upright RGB ``PIL.Image.Image``, the pixel count checked from the header before any pixel
is decoded."""

from __future__ import annotations

import io
import logging
import os
import threading
import warnings
from typing import Any, Iterable, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mlxvlm.media.budget import charge_pixels
from mlxvlm.media.errors import MediaError, describe_source, error, limit_error
from mlxvlm.media.policy import MediaPolicy
from mlxvlm.media.sources import read_source_bytes

logger = logging.getLogger(__name__)


ImageSource = Union[Image.Image, str, "os.PathLike[str]", bytes, bytearray, memoryview, np.ndarray]

_warnings_lock = threading.Lock()
TRUSTED = " if you trust the source"


def _check_pixels(width: int, height: int, max_pixels: int, name: str, raise_it: str) -> None:
    if width <= 0 or height <= 0:
        raise error("image", name, f"the image has no pixels ({width}x{height})",
                    "check the image")
    if width * height > max_pixels:
        raise limit_error(
            "image", name,
            f"the image is {width}x{height} = {width * height:,} pixels, more than the "
            f"limit of {max_pixels:,}",
            f"downscale it{raise_it}", limit="max_image_pixels",
        )



def _decode_image(data: bytes, *, max_pixels: int, name: str, raise_it: str,
                  hint: str = "") -> Image.Image:
    """Decode encoded image bytes, checking the pixel count before decoding any pixels."""
    try:
        with _warnings_lock, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise error("image", name, f"refused as a possible decompression bomb ({e})",
                    "downscale the image") from e
    except UnidentifiedImageError as e:
        if b"%PDF-" in data[:1024]:
            raise error("image", name, "it is a PDF, not an image",
                        "render its pages with mlxvlm.media.load_pdf (the generate command "
                        "reads it as --pdf; the server takes it as a file part)") from e
        reason = "not a recognised image format"
        if hint:
            reason += f" ({hint})"
        raise error("image", name, reason,
                    "use PNG, JPEG, WebP, GIF, BMP or TIFF (for video, pass it as a video)") from e
    except Exception as e:  # plugins raise many types on malformed headers
        raise error("image", name, f"the image header is corrupt ({e.__class__.__name__}: {e})",
                    "check that the file is a complete image") from e
    _check_pixels(image.width, image.height, max_pixels, name, raise_it)
    charge_pixels(image.width * image.height, name)
    try:
        image.load()
    except Image.DecompressionBombError as e:
        raise error("image", name, f"refused as a possible decompression bomb ({e})",
                    "downscale the image") from e
    except Exception as e:
        raise error("image", name,
                    f"the image data is corrupt or truncated ({e.__class__.__name__}: {e})",
                    "check that the file is a complete image") from e
    return image


def _exif_transpose(image: Image.Image, name: str) -> Image.Image:
    """A new image with the EXIF orientation applied (malformed EXIF is ignored)."""
    try:
        return ImageOps.exif_transpose(image)  # a copy when there is nothing to do
    except Exception as e:
        logger.warning("ignoring unreadable EXIF orientation of image %s: %s", name, e)
        return image.copy()


def _to_rgb(image: Image.Image) -> Image.Image:
    """Convert to RGB; transparent pixels are composited over white.

    An RGB image without transparency is returned as is, so pass one the caller owns.
    """
    if image.mode.startswith("I;16"):
        # Pillow's conversion clips 16-bit values at 255; scale them instead.
        pixels = np.asarray(image).astype(np.uint16, copy=False)
        image = Image.fromarray((pixels >> 8).astype(np.uint8))
    if image.has_transparency_data:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        background.alpha_composite(rgba)
        return background.convert("RGB")
    if image.mode == "RGB":
        return image
    return image.convert("RGB")


def _image_from_array(array: np.ndarray, *, max_pixels: int, name: str,
                      raise_it: str) -> Image.Image:
    fix = "pass a uint8 array of shape (H, W), (H, W, 3) or (H, W, 4)"
    if array.dtype != np.uint8:
        raise error("image", name, f"the array has dtype {array.dtype}, not uint8", fix)
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
        raise error("image", name, f"the array has shape {tuple(array.shape)}", fix)
    _check_pixels(array.shape[1], array.shape[0], max_pixels, name, raise_it)
    # This shares the caller's buffer; load_image's _exif_transpose makes the copy.
    return Image.fromarray(np.ascontiguousarray(array))


def load_image(
    source: ImageSource,
    *,
    policy: MediaPolicy | None = None,
    max_bytes: int | None = None,
    max_pixels: int | None = None,
    **access: Any,
) -> Image.Image:
    """Load an image as an RGB ``PIL.Image.Image``, upright and without transparency.

    ``source`` is one of: a PIL image; a local path (``str`` or ``os.PathLike``, ``~`` is
    expanded); an ``http(s)://`` URL; a ``data:image/...;base64,...`` URL; the encoded
    bytes of an image file; or a ``uint8`` numpy array of shape (H, W), (H, W, 3) or
    (H, W, 4).

    - ``policy``: where the image may come from (:class:`MediaPolicy`); ``access``
      keywords (``allow_remote=False``, ``allowed_dir=...``) replace its fields.
    - ``max_bytes``: the largest encoded input accepted (file, body or data URL); None:
      the policy's ``max_image_bytes``.
    - ``max_pixels``: the largest ``width * height`` accepted, checked from the image
      header before any pixels are decoded (None: the policy's ``max_image_pixels``).
      Pillow's own limit (``PIL.Image.MAX_IMAGE_PIXELS``) applies as well.

    The EXIF orientation is applied, pixels with alpha are composited over white, and an
    animated image gives its first frame. The caller's image or array is never modified
    or shared. Every failure raises
    :class:`MediaError`.
    """
    policy = MediaPolicy.of(policy, **access)
    # A fix names the option that set the limit: the argument, or the policy's field.
    bytes_option = "max_image_bytes" if max_bytes is None else "max_bytes"
    max_bytes = policy.max_image_bytes if max_bytes is None else max_bytes
    if max_pixels is None:
        max_pixels = policy.max_image_pixels
        pixels_fix = policy.names.raise_fix("max_image_pixels", TRUSTED)
    else:
        pixels_fix = f", or raise max_pixels{TRUSTED}"
    name = describe_source(source)
    if isinstance(source, Image.Image):
        _check_pixels(source.width, source.height, max_pixels, name, pixels_fix)
        try:
            source.load()
        except Exception as e:
            raise error("image", name, f"the image data is corrupt or truncated ({e})",
                        "check that the file is a complete image") from e
        image = source
    elif isinstance(source, np.ndarray):
        image = _image_from_array(source, max_pixels=max_pixels, name=name,
                                  raise_it=pixels_fix)
    elif isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
        data, hint = read_source_bytes(source, kind="image", policy=policy,
                                       max_bytes=max_bytes, bytes_option=bytes_option)
        image = _decode_image(data, max_pixels=max_pixels, name=name, raise_it=pixels_fix,
                              hint=hint)
    else:
        raise error(
            "image", name, f"unsupported source type {type(source).__name__}",
            "pass a path, an http(s) or data URL, bytes, a PIL image or a numpy array",
        )
    # _exif_transpose returns a new image, so the caller's is never returned or changed.
    return _to_rgb(_exif_transpose(image, name))


def load_images(sources: Iterable[ImageSource], **kwargs: Any) -> list[Image.Image]:
    """:func:`load_image` on each of ``sources``; takes the same keyword arguments.

    A failure names the position of the bad source, e.g. ``sources[2]: cannot load ...``.
    """
    if isinstance(sources, (str, bytes, bytearray, memoryview, os.PathLike, Image.Image,
                            np.ndarray)):
        raise TypeError("load_images expects a list of sources; use load_image for one source")
    images = []
    for i, source in enumerate(sources):
        try:
            images.append(load_image(source, **kwargs))
        except MediaError as e:
            raise MediaError(f"sources[{i}]: {e}") from e
    return images
