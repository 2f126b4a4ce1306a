"""The README and the pages of docs/ link to each other by relative paths and heading anchors, as
GitHub renders them: every such link must lead to a file that exists and, where it names one, to a
heading of that file; and the README's map reaches every page."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto: ...: not ours to check


def prose(text: str) -> str:
    """The text with code blocks taken out: a `# comment` there is no heading, `[x](y)` no link."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lowercased, without punctuation other than
    hyphens and underscores, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    kept = (c for c in text if c.isalnum() or c in " -_" or unicodedata.category(c).startswith("M"))
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2... as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(prose(page.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    text = CODE_SPAN.sub("", prose(page.read_text()))
    return [target for target in LINK.findall(text) if not EXTERNAL.match(target)]


def test_the_docs_have_pages_and_links():
    assert len(PAGES) > 5
    assert sum(len(relative_links(page)) for page in PAGES) > 50


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_page_of_docs():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in relative_links(ROOT / "README.md")}
    assert {page.resolve() for page in PAGES[1:]} <= linked


def test_slugs_follow_githubs_rule():
    assert slug("Redis: one server, Sentinel or Cluster") == "redis-one-server-sentinel-or-cluster"
    assert slug("`mili batch`: an OpenAI batch file from a shell") == "mili-batch-an-openai-batch-file-from-a-shell"
    assert slug("Sizing: KV pages and GPU memory") == "sizing-kv-pages-and-gpu-memory"
