"""A rendered document page for OCR benchmarks: lines of text on a letter-sized sheet
(8.5 x 11 in) at the pixel size a model reads, drawn with Pillow's own font."""

from __future__ import annotations

from PIL import Image, ImageDraw, ImageFont

LINES = (
    "Invoice 4471                                    Date: 2026-03-14",
    "Bill to: Northwind Traders, 12 Harbour Road, Leith EH6 7LQ",
    "",
    "Item   Description                    Qty    Unit      Amount",
    "1      Printer paper, A4, 500 sheets   40    4.20      168.00",
    "2      Toner cartridge, black           6   38.50      231.00",
    "3      Office chair, mesh back          2  119.00      238.00",
    "4      Desk lamp, LED                   5   24.90      124.50",
    "",
    "Subtotal 761.50    Tax (20%) 152.30    Total 913.80",
    "Payment due within 30 days to account 0042 7781 5530.",
    "Late payments accrue interest at 1.5% per month.",
)


def letter_size(width: int) -> tuple[int, int]:
    """(width, height) of a letter page ``width`` pixels wide."""
    return width, round(width * 11 / 8.5)


def document_page(width: int, height: int) -> Image.Image:
    """Black text on white, margins of 1/12 of the width, the paragraph repeated down the
    page at a size of about 70 characters to a line (a dense typed page)."""
    page = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(page)
    margin = width // 12
    size = max(8, round((width - 2 * margin) / 70 * 1.6))
    font = ImageFont.load_default(size=size)
    y, line = margin, 0
    while y + size < height - margin:
        draw.text((margin, y), LINES[line % len(LINES)], fill="black", font=font)
        y, line = y + round(size * 1.4), line + 1
    return page
