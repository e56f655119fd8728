"""The Markdown pages render as written: every table of README.md, docs/ and benchmarks/
is a table under CommonMark with GitHub's tables (markdown-it-py, the parser behind
Gradio's and many sites' Markdown), with no row left out of it as raw pipes."""

from __future__ import annotations

from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).parent.parent
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("benchmarks/*.md"),
                *ROOT.glob("examples/**/README.md")])


def table_lines(text: str) -> list[int]:
    """Line numbers (0-based) of lines that look like table rows, outside code fences."""
    rows, fenced = [], False
    for number, line in enumerate(text.splitlines()):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.lstrip().startswith("|"):
            rows.append(number)
    return rows


def rendered_table_lines(text: str) -> set[int]:
    """Line numbers that markdown-it puts inside a table (header, separator and rows)."""
    inside: set[int] = set()
    for token in MarkdownIt("commonmark").enable("table").parse(text):
        if token.type == "table_open" and token.map:
            inside.update(range(*token.map))
    return inside


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_renders(page):
    text = page.read_text()
    stray = [n + 1 for n in table_lines(text) if n not in rendered_table_lines(text)]
    assert not stray, f"{page.name}: lines {stray} start with '|' but are not in a table"


def test_pages_were_found():
    assert ROOT / "README.md" in PAGES and len(PAGES) >= 3
