"""Test PDFs made in the tests: Pillow's PDF writer (one example picture per page), and a
hand-written encrypted one (no PDF library here encrypts)."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def pdf_of(*names: str, resolution: float = 72) -> bytes:
    """A PDF with one example picture per page (at 72 DPI a page is as many points as
    the picture has pixels)."""
    images = [Image.open(EXAMPLES / "images" / name).convert("RGB") for name in names]
    out = io.BytesIO()
    images[0].save(out, "PDF", save_all=True, append_images=images[1:], resolution=resolution)
    return out.getvalue()


def encrypted_pdf() -> bytes:
    """A one-page PDF under the standard security handler whose user password is not
    empty (its /U entry matches no password), written by hand: no PDF library here
    encrypts."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 100 100] >>",
               b"<< /Filter /Standard /V 1 /R 2 /O <" + b"11" * 32 + b"> /U <" + b"22" * 32
               + b"> /P -4 >>"]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    file_id = b"<" + b"ab" * 16 + b">"
    out += (b"trailer\n<< /Size %d /Root 1 0 R /Encrypt 4 0 R /ID [%s %s] >>\n"
            % (len(objects) + 1, file_id, file_id) + b"startxref\n%d\n%%%%EOF\n" % xref)
    return bytes(out)
