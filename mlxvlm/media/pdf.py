"""PDFs: a document's pages rendered into RGB ``PIL`` images with pypdfium2 (PDFium, the
renderer Chrome uses), one page at a time.

A PDF is read under the same :class:`MediaPolicy` as an image (where it may come from,
``max_image_bytes``); each page is rendered at a DPI, scaled down to stay within a pixel
cap, and charged to the request's pixel budget before it is rendered. Pages are chosen
with a 1-based spec (``"1-3,5"``, ``"4-"``), and ``max_pages`` refuses a document whose
selection is longer rather than rendering it. Encrypted and malformed files fail with a
one-line :class:`MediaError`.

PDFium is not thread-safe: every call into it holds one process-wide lock, taken per
page so that several requests' documents interleave and a cancelled one stops between
pages.
"""

from __future__ import annotations

import io
import math
import os
import re
import threading
from typing import Any, Iterator

from PIL import Image

from mlxvlm.media.budget import charge_pixels
from mlxvlm.media.decode_work import check_cancelled
from mlxvlm.media.errors import MediaError, describe_source, error, limit_error
from mlxvlm.media.policy import MediaPolicy
from mlxvlm.media.sources import open_regular_file, read_source_bytes

KIND = "PDF"
DEFAULT_DPI = 144
# A page's pixels after rendering (a letter page at 144 DPI is 1.9 M): a poster-sized
# page is rendered smaller rather than into gigabytes; the processor resizes it again.
DEFAULT_MAX_PAGE_PIXELS = 4096 * 4096
# PDF points per inch: a page's size in PDFium is in points.
_POINTS_PER_INCH = 72
# The header may start anywhere in the first kilobyte (PDF 1.7, annex H).
_HEADER_WINDOW = 1024
MEDIA_TYPES = ("application/pdf", "application/x-pdf")

_pdfium_lock = threading.Lock()
_SPEC_ITEM = re.compile(r"^\s*(\d+)\s*(?:(-)\s*(\d*)\s*)?$")


def parse_page_spec(spec: str) -> list[tuple[int, int | None]]:
    """``"1-3,5,8-"`` -> ``[(1, 3), (5, 5), (8, None)]`` (1-based, inclusive; None: to the
    last page). Raises ``ValueError`` with a one-line reason for a malformed spec."""
    ranges = []
    if not spec.strip():
        raise ValueError("the page list is empty; write pages like 1-3,5")
    for item in spec.split(","):
        match = _SPEC_ITEM.match(item)
        if not match:
            raise ValueError(f"{item.strip()!r} is not a page or a range; write pages like "
                             "1-3,5 or 4- (to the last page)")
        first = int(match.group(1))
        last = first if not match.group(2) else (int(match.group(3)) if match.group(3)
                                                 else None)
        if first < 1 or (last is not None and last < 1):
            raise ValueError(f"{item.strip()!r}: pages are numbered from 1")
        if last is not None and last < first:
            raise ValueError(f"{item.strip()!r}: a range goes from a lower page to a higher one")
        ranges.append((first, last))
    return ranges


def select_pages(spec: str | None, page_count: int, name: str = "the PDF") -> list[int]:
    """The 1-based page numbers ``spec`` names in a document of ``page_count`` pages, in
    the spec's order, each once (None: every page). A page past the end is an error."""
    if spec is None:
        return list(range(1, page_count + 1))
    pages: list[int] = []
    for first, last in parse_page_spec(spec):
        if first > page_count or (last is not None and last > page_count):
            asked = last if last is not None and last > page_count else first
            raise error(KIND, name, f"it has {page_count} page{'s' * (page_count != 1)}, and "
                        f"the page list asks for page {asked}", "choose pages within the document")
        for page in range(first, (last or page_count) + 1):
            if page not in pages:
                pages.append(page)
    return pages


def looks_like_pdf(source: Any) -> bool:
    """Whether ``source`` is a PDF: a data URL of a PDF media type, a path or URL ending
    in ``.pdf``, a local file or bytes starting with the PDF header."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return b"%PDF-" in bytes(source[:_HEADER_WINDOW])
    if not isinstance(source, (str, os.PathLike)):
        return False
    text = os.fsdecode(source)
    if text[:5].lower() == "data:":
        return text[5:].split(",", 1)[0].split(";", 1)[0].strip().lower() in MEDIA_TYPES
    if text.split("?", 1)[0].split("#", 1)[0].lower().endswith(".pdf"):
        return True
    try:
        with open(os.path.expanduser(text), "rb") as f:
            return b"%PDF-" in f.read(_HEADER_WINDOW)
    except (OSError, ValueError):
        return False


def _pdfium():
    import pypdfium2

    return pypdfium2


class PdfDocument:
    """An open PDF: ``page_count``, and :meth:`render` of one page. Close it (or use it
    as a context manager) to free PDFium's copy."""

    def __init__(self, document, name: str, stream=None):
        self._document, self.name, self._stream = document, name, stream
        with _pdfium_lock:
            self.page_count = len(document)

    def __enter__(self) -> "PdfDocument":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with _pdfium_lock:
            if self._document is not None:
                self._document.close()
                self._document = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def render(self, page_number: int, *, dpi: float = DEFAULT_DPI,
               max_pixels: int = DEFAULT_MAX_PAGE_PIXELS) -> Image.Image:
        """Page ``page_number`` (1-based) as an RGB image at ``dpi``, scaled down so that
        its pixels stay within ``max_pixels`` (charged to the request's pixel budget
        before it is rendered)."""
        pdfium = _pdfium()
        check_cancelled(f"rendering PDF {self.name} at page {page_number}")
        try:
            with _pdfium_lock:
                page = self._document[page_number - 1]
                try:
                    width_pt, height_pt = page.get_size()
                    scale = dpi / _POINTS_PER_INCH
                    area = width_pt * height_pt
                    if area <= 0:
                        raise error(KIND, self.name, f"page {page_number} has no area",
                                    "check the document")
                    if area * scale * scale > max_pixels:
                        scale = math.sqrt(max_pixels / area)
                    width = max(1, round(width_pt * scale))
                    height = max(1, round(height_pt * scale))
                    charge_pixels(width * height, f"PDF {self.name} page {page_number}")
                    bitmap = page.render(scale=scale, may_draw_forms=True)
                    try:
                        image = bitmap.to_pil()
                    finally:
                        bitmap.close()
                finally:
                    page.close()
        except pdfium.PdfiumError as e:
            raise error(KIND, self.name, f"page {page_number} cannot be rendered ({e})",
                        "check that the file is a complete PDF") from e
        # An owned RGB copy: the bitmap's buffer is gone, and it may be BGRA or grey.
        return image.convert("RGB") if image.mode != "RGB" else image.copy()


def open_pdf(source: Any, *, policy: MediaPolicy | None = None, max_bytes: int | None = None,
             **access: Any) -> PdfDocument:
    """Open ``source`` (a path, http(s) URL, ``data:application/pdf`` URL or bytes) under
    ``policy`` (``max_bytes`` None: its ``max_image_bytes``). A local file is read by
    PDFium as it needs it rather than into memory."""
    policy = MediaPolicy.of(policy, **access)
    bytes_option = "max_image_bytes" if max_bytes is None else "max_bytes"
    max_bytes = policy.max_image_bytes if max_bytes is None else max_bytes
    name = describe_source(source)

    def open_local(path, **kwargs) -> io.BufferedReader:
        return os.fdopen(open_regular_file(path, **kwargs), "rb")

    data, hint = read_source_bytes(source, kind=KIND, policy=policy, max_bytes=max_bytes,
                                   bytes_option=bytes_option, local_reader=open_local)
    stream = data if isinstance(data, io.IOBase) else None
    try:
        head = stream.read(_HEADER_WINDOW) if stream is not None else data[:_HEADER_WINDOW]
        if stream is not None:
            stream.seek(0)
        if b"%PDF-" not in head:
            reason = "it is not a PDF (no %PDF- header)" + (f" ({hint})" if hint else "")
            raise error(KIND, name, reason, "pass a PDF file")
        pdfium = _pdfium()
        try:
            with _pdfium_lock:
                document = pdfium.PdfDocument(stream if stream is not None else data)
        except pdfium.PdfiumError as e:
            if "password" in str(e).lower():
                raise error(KIND, name, "it is encrypted (password-protected)",
                            "decrypt it first, e.g. qpdf --decrypt --password=... in.pdf "
                            "out.pdf") from e
            raise error(KIND, name, f"it is corrupt or not a PDF ({e})",
                        "check that the file is a complete PDF") from e
        return PdfDocument(document, name, stream)
    except BaseException:
        if stream is not None:
            stream.close()
        raise


def iter_pdf_pages(document: PdfDocument, pages: list[int], *, dpi: float = DEFAULT_DPI,
                   max_pixels: int = DEFAULT_MAX_PAGE_PIXELS) -> Iterator[tuple[int, Image.Image]]:
    """``(page number, image)`` for each of ``pages``, rendered only when asked for."""
    for page in pages:
        yield page, document.render(page, dpi=dpi, max_pixels=max_pixels)


def load_pdf(source: Any, *, pages: str | None = None, dpi: float = DEFAULT_DPI,
             max_pages: int | None = None, max_page_pixels: int | None = None,
             policy: MediaPolicy | None = None, max_bytes: int | None = None,
             pages_option: str = "raise max_pages", **access: Any) -> list[Image.Image]:
    """The pages ``pages`` selects (a spec like ``"1-3,5"``; None: all) as RGB images.

    ``max_pages``: the most pages rendered; a longer selection is refused before any page
    is rendered (``pages_option``: the fix's second half, e.g. ``"raise --max-pdf-pages"``).
    ``max_page_pixels``: each page's pixel cap (None: ``DEFAULT_MAX_PAGE_PIXELS``, and at
    most the policy's ``max_image_pixels``).
    """
    policy = MediaPolicy.of(policy, **access)
    cap = min(max_page_pixels or DEFAULT_MAX_PAGE_PIXELS, policy.max_image_pixels)
    with open_pdf(source, policy=policy, max_bytes=max_bytes) as document:
        try:
            selected = select_pages(pages, document.page_count, document.name)
        except ValueError as e:
            if isinstance(e, MediaError):
                raise
            raise error(KIND, document.name, f"bad page list: {e}") from e
        if max_pages is not None and len(selected) > max_pages:
            raise limit_error(
                KIND, document.name,
                f"it has {len(selected)} pages to read, more than the limit of {max_pages}",
                f"send fewer pages, or {pages_option}", limit="max_pdf_pages")
        return [image for _, image in iter_pdf_pages(document, selected, dpi=dpi,
                                                     max_pixels=cap)]
