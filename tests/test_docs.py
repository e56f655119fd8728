"""The Markdown pages render as written: every table of README.md, docs/ and benchmarks/
is a table under CommonMark with GitHub's tables (markdown-it-py, the parser behind
Gradio's and many sites' Markdown), with no row left out of it as raw pipes; every
relative link leads to a file that exists and, into a Markdown page, to one of its
headings; the files under examples/ that a command names exist, and the Python examples
on the offline demo model run as printed."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

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


# Links: every relative link of a page names a file (or folder) of the repository, and an
# ``#anchor`` into a Markdown page names one of its headings, slugged as GitHub slugs them.

SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto: ...


def heading_slugs(text: str) -> set[str]:
    """The anchors GitHub gives the page's headings: the heading's text lower-cased, every
    character but letters, digits, '-', '_' and spaces dropped, spaces turned into '-';
    a repeated slug gets '-1', '-2' ..."""
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    slugs: set[str] = set()
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type != "heading_open":
            continue
        words = "".join(child.content for child in inline.children or []
                        if child.type in ("text", "code_inline"))
        slug = re.sub(r"[^\w\- ]", "", words.lower()).replace(" ", "-")
        unique, n = slug, 0
        while unique in slugs:
            n += 1
            unique = f"{slug}-{n}"
        slugs.add(unique)
    return slugs


def link_targets(text: str) -> list[str]:
    """Every link and image target of the page as markdown-it reads it (code is not
    scanned: a fence or an inline code span holds no links)."""
    targets = []
    for token in MarkdownIt("commonmark").enable("table").parse(text):
        for child in token.children or []:
            if child.type == "link_open":
                targets.append(child.attrs["href"])
            elif child.type == "image":
                targets.append(child.attrs["src"])
    return targets


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that lead nowhere, each with the reason."""
    broken = []
    for target in link_targets(page.read_text()):
        if SCHEME.match(target) or target.startswith("//"):
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / unquote(path)).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and destination.is_file():
            if anchor not in heading_slugs(destination.read_text()):
                broken.append(f"{target}: no heading #{anchor} in {destination.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_somewhere(page):
    broken = broken_links(page)
    assert not broken, f"{page.name}: {broken}"


def test_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The `--port` flag (TCP)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title, with: punctuation\n\n"
        "[fine](other.md#the---port-flag-tcp) [fine](#title-with-punctuation) "
        "[web](https://example.com/x.md#nowhere) `[code](missing.md)`\n\n"
        "[gone](missing.md) [no heading](other.md#no-such-heading) [self](#nothing)\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#no-such-heading: no heading #no-such-heading in other.md",
        "#nothing: no heading #nothing in page.md",
    ]


def test_repeated_headings_get_numbered_slugs():
    assert heading_slugs("# Flags\n\n## Flags\n\n## Flags\n") == {"flags", "flags-1", "flags-2"}


# The offline examples: the files the pages' commands name exist, and the Python examples
# on the demo model run as printed, describing each picture as its file name says.

DEMO_PATH = re.compile(r"examples/[\w./-]*[\w/]")


def code_blocks(text: str, language: str | None = None) -> list[str]:
    return [token.content for token in MarkdownIt("commonmark").parse(text)
            if token.type == "fence" and (language is None or token.info.strip() == language)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_example_path_in_a_command_exists(page):
    named = {m.group(0) for block in code_blocks(page.read_text())
             for m in DEMO_PATH.finditer(block)}
    assert all((ROOT / path).exists() for path in named), \
        f"{page.name}: {sorted(p for p in named if not (ROOT / p).exists())}"


def demo_snippets() -> list[tuple[str, int, str]]:
    return [(page.relative_to(ROOT).as_posix(), n, block)
            for page in (ROOT / "README.md", ROOT / "docs" / "python-api.md")
            for n, block in enumerate(code_blocks(page.read_text(), "python"))
            if 'load("examples/shapes-vlm")' in block]


def test_the_api_pages_have_demo_snippets():
    assert {page for page, _, _ in demo_snippets()} == {"README.md", "docs/python-api.md"}


@pytest.mark.parametrize("snippet", demo_snippets(), ids=lambda s: f"{s[0]}-{s[1]}")
def test_python_demo_snippet_runs(snippet, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    exec(compile(snippet[2], snippet[0], "exec"), {"__name__": "__docs__"})
    printed = capsys.readouterr().out
    for picture in re.findall(r"examples/images/([a-z]+)-([a-z]+)\.png", snippet[2]):
        assert "a {} {} on a".format(*picture) in printed, (picture, printed)
