"""Relative links in README.md, docs/*.md and the benchmark log reach a file that exists and, with #anchor, a
heading or an `<a id>` in it (GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens)."""
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "log.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)
HTML_ID = re.compile(r'<a id="([^"]+)">')
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def heading_anchor(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    found, seen = set(HTML_ID.findall(text)), {}
    for title in HEADING.findall(text):
        anchor = heading_anchor(title)
        count = seen.get(anchor, 0)
        found.add(anchor if count == 0 else f"{anchor}-{count}")  # GitHub numbers repeated headings
        seen[anchor] = count + 1
    return found


def local_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


def test_heading_anchor_follows_github():
    assert heading_anchor("bench_swap.py, scenario rtx4070") == "bench_swappy-scenario-rtx4070"
    assert heading_anchor("Session 16: the decode phase's power (runs AZ-BF)") == \
        "session-16-the-decode-phases-power-runs-az-bf"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve(page: Path):
    for link in local_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.relative_to(ROOT)}: link {link!r}: {path} does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target), f"{page.relative_to(ROOT)}: link {link!r}: no such anchor in {path}"
