"""The generate command's PDFs: the document opened and its pages chosen before the model
loads, then one page answered in one prompt, or several pages each answered in turn (the
OCR use), printed under ``## Page N`` headers or written to ``--output-dir`` as one
Markdown file per page, with a progress bar on stderr.

Pages are rendered one at a time as they are answered, so a long document never sits in
memory as images.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from mlxvlm.errors import MlxvlmError
from mlxvlm.media.pdf import PdfDocument, open_pdf, select_pages
from mlxvlm.progress import progress

# The command line reads its user's own files, and PDFium reads a local file as it needs
# it, not into memory: a large scan is fine (a URL's body is held in memory, though).
CLI_MAX_PDF_BYTES = 2 * 2**30


@dataclass
class CliPdf:
    """A PDF of the command line: the open document and the pages to answer."""

    document: PdfDocument
    pages: list[int]


def open_cli_pdf(source, args: argparse.Namespace, policy) -> CliPdf:
    document = open_pdf(source, policy=policy, max_bytes=CLI_MAX_PDF_BYTES)
    try:
        return CliPdf(document, select_pages(args.pages, document.page_count, document.name))
    except BaseException:
        document.close()
        raise


def check_pdf_arguments(args: argparse.Namespace, media: list[tuple[str, object]]) -> None:
    """One PDF at most; --pages and --output-dir only with one."""
    count = sum(kind == "pdf" for kind, _ in media)
    if count > 1:
        raise MlxvlmError(f"got {count} PDFs; pass one PDF at a time (its pages are answered "
                          "in turn)")
    if not count:
        for flag, value in (("--pages", args.pages), ("--output-dir", args.output_dir)):
            if value is not None:
                raise MlxvlmError(f"{flag} applies to a PDF; pass one with --pdf or --image")


def close_pdfs(media: Iterable[tuple[str, object]]) -> None:
    for kind, value in media:
        if kind == "pdf":
            value.document.close()


# A page file's extension by --output-format (None: the answer's text, Markdown for OCR
# models).
PAGE_FILE_SUFFIXES = {None: ".md", "markdown": ".md", "html": ".html", "json": ".json",
                      "doctags": ".doctags"}


def page_file_name(page: int, page_count: int, suffix: str = ".md") -> str:
    """``page-007.md``: zero-padded so that the files sort in page order."""
    return f"page-{page:0{max(3, len(str(page_count)))}d}{suffix}"


def answer_pages(args: argparse.Namespace, media: list[tuple[str, object]],
                 stream_of: Callable[[list[tuple[str, object]]], Iterable],
                 report: Callable[[object], None] | None = None,
                 convert: Callable[[str, object], str] | None = None) -> None:
    """Answer the PDF's pages: ``stream_of(media)`` streams the answer to one prompt whose
    media are ``media`` with the PDF replaced by one page's image; ``report(last)``, if
    given, after each answer (its statistics); ``convert(answer, page image)``, if given,
    turns each whole answer into what is printed or written (--output-format)."""
    pdf = next(value for kind, value in media if kind == "pdf")
    document, pages = pdf.document, pdf.pages

    def with_page(page: int) -> tuple[object, list[tuple[str, object]]]:
        image = document.render(page, dpi=args.dpi)
        return image, [("image", image) if kind == "pdf" else (kind, value)
                       for kind, value in media]

    if len(pages) == 1 and args.output_dir is None and convert is None:
        last = None
        for last in stream_of(with_page(pages[0])[1]):
            print(last.text, end="", flush=True)
        print()
        if report is not None and last is not None:
            report(last)
        return
    out_dir = None
    if args.output_dir is not None:
        out_dir = Path(args.output_dir).expanduser()
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MlxvlmError(f"cannot create --output-dir {str(out_dir)!r}: "
                              f"{e.strerror or e}") from e
    suffix = PAGE_FILE_SUFFIXES[getattr(args, "output_format", None)]
    with progress(total=len(pages), desc=f"PDF {document.name}", unit="page",
                  plain_every_s=0) as bar:
        for page in pages:
            last, pieces = None, []
            image, page_media = with_page(page)
            for last in stream_of(page_media):
                pieces.append(last.text)
            answer = "".join(pieces).strip()
            if convert is not None:
                answer = convert(answer, image).strip()
            if len(pages) == 1 and out_dir is None:
                print(answer, flush=True)
            elif out_dir is not None:
                path = out_dir / page_file_name(page, document.page_count, suffix)
                try:
                    path.write_text(answer + "\n", encoding="utf-8")
                except OSError as e:
                    raise MlxvlmError(f"cannot write {str(path)!r}: {e.strerror or e}") from e
            else:
                print(f"## Page {page}\n\n{answer}\n", flush=True)
            if report is not None and last is not None:
                report(last)
            bar.update(1)
    if out_dir is not None:
        print(f"[mlxvlm] wrote {len(pages)} page{'s' * (len(pages) != 1)} to {out_dir}",
              file=sys.stderr)
