"""What reading a long PDF costs mlxvlm (issue 43): pages rendered per second at a DPI,
and how much the process's resident memory grows while a document's pages are rendered
one at a time (as ``python -m mlxvlm.generate --pdf ... --output-dir`` does) -- against what
holding every page as an image would take.

    python benchmarks/pdf_pages.py --pages 500 --dpi 144 --output pdf-pages.json

The document is made here: a letter-size page (612 x 792 points) of drawn text lines
(Pillow, saved as a JPEG image page), repeated ``--pages`` times with pypdfium2 (pages
share the one image, so the file stays small while each page is rendered in full).
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlxvlm.media.pdf import DEFAULT_MAX_PAGE_PIXELS, iter_pdf_pages, open_pdf  # noqa: E402

LETTER_POINTS = (612, 792)
# The generate command's limit (mlxvlm/generate/pdf_pages.py; importing it would load MLX
# and count its memory as the rendering's).
CLI_MAX_PDF_BYTES = 2 * 2**30


def text_page() -> bytes:
    """One letter page of text lines, as a one-page PDF (the image at 144 DPI)."""
    image = Image.new("RGB", (LETTER_POINTS[0] * 2, LETTER_POINTS[1] * 2), "white")
    draw = ImageDraw.Draw(image)
    for line in range(60):
        draw.text((100, 80 + line * 24), f"Line {line + 1}: the quick brown fox jumps over "
                  "the lazy dog, 0123456789.", fill="black")
    out = io.BytesIO()
    image.save(out, "PDF", resolution=144)
    return out.getvalue()


def long_pdf(pages: int) -> bytes:
    import pypdfium2

    single = pypdfium2.PdfDocument(text_page())
    document = pypdfium2.PdfDocument.new()
    for _ in range(pages):
        document.import_pages(single, [0])
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def rss_mib() -> float:
    """The process's resident memory now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def render(path: Path, dpi: float) -> dict:
    """Every page of ``path`` rendered in turn, each dropped before the next (in a process
    of its own, so that its peak memory is the rendering's)."""
    before = highest = rss_mib()
    started, cpu_started = time.perf_counter(), time.process_time()
    pixels, pages, size = 0, 0, None
    with open_pdf(path, max_bytes=CLI_MAX_PDF_BYTES) as document:
        for _, image in iter_pdf_pages(document, list(range(1, document.page_count + 1)),
                                       dpi=dpi, max_pixels=DEFAULT_MAX_PAGE_PIXELS):
            pixels += image.width * image.height
            pages, size = pages + 1, image.size
            highest = max(highest, rss_mib())
            del image  # as the command does: a page's image is dropped once answered
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return {
        "pages": pages, "dpi": dpi, "page_pixels": list(size),
        "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
        "pages_per_s": round(pages / wall, 1),
        "rss_before_mib": round(before, 1),
        # sampled after each page, while its image is held
        "rss_growth_while_rendering_mib": round(highest - before, 1),
        "all_pages_as_images_mib": round(pixels * 3 / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=500)
    parser.add_argument("--dpi", type=float, default=144)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--render", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.render is not None:  # the child process
        print(json.dumps(render(args.render, args.dpi)))
        return

    # Read from a file, as the command reads a local PDF (PDFium reads what it needs).
    path = Path(tempfile.mkdtemp()) / "long.pdf"
    path.write_bytes(long_pdf(args.pages))
    try:
        child = subprocess.run([sys.executable, __file__, "--render", str(path), "--dpi",
                                str(args.dpi)], capture_output=True, text=True, check=True)
        result = {"machine": platform.processor() or platform.machine(),
                  "pdf_bytes": path.stat().st_size, **json.loads(child.stdout)}
    finally:
        path.unlink()
    print(json.dumps(result, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
