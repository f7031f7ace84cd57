"""The README and docs/ hold what a test checks by naming the test, and link to each other and to
benchmarks/RESULTS.md by anchor: every named test must exist and every link must land (a renamed
test or a retitled section would otherwise leave a claim pointing nowhere). Pure Python."""

import re
from collections import Counter

import pytest

from conftest import ROOT

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def anchors(path):
    """The anchors of a Markdown page as GitHub makes them: explicit <a id>, and each heading
    lower-cased, punctuation dropped, spaces as dashes, a repeated one suffixed -1, -2, ..."""
    text = path.read_text()
    found = set(re.findall(r'<a id="([^"]+)"', text))
    seen = Counter()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        found.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_named_test_exists(page):
    missing = []
    for path, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", page.read_text()):
        source = ROOT / path
        if not source.exists() or not re.search(rf"def {name}\b", source.read_text()):
            missing.append(f"{path}::{name}")
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_lands(page):
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(link)
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(link)
    assert broken == []
