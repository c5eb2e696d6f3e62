"""The README and docs/*.md: every relative link and picture points at a file of the repository (and a heading
that exists, where the link names one), the README stays short, and every picture in docs/ is shown somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets are code, not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text()))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_picture_exists(document):
    broken = []
    for target in links(document):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ... (not checked: no network in the tests)
            continue
        file_part, _, anchor = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with this anchor in {linked.name}")
    assert not broken, f"{document.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_stays_short_and_links_the_documents():
    readme = ROOT / "README.md"
    lines = readme.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, at most {README_MAX_LINES}: move detail to docs/"
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(readme)}
    assert set(DOCUMENTS[1:]) <= linked, "every document in docs/ is linked from the README"


def test_every_picture_in_docs_is_shown():
    shown = {(doc.parent / target.partition("#")[0]).resolve() for doc in DOCUMENTS for target in links(doc)}
    orphans = [
        p.name
        for p in sorted([*(ROOT / "docs").glob("*.png"), *(ROOT / "docs").glob("*.jpg")])
        if p.resolve() not in shown
    ]
    assert not orphans, f"pictures in docs/ that no document shows: {orphans}"


def test_the_anchor_rule_is_githubs():
    assert slug("The skip_when_slower rule") == "the-skip_when_slower-rule"
    assert slug("Scope: the whole transformer block") == "scope-the-whole-transformer-block"
    assert slug("torch.compile, dtypes, devices") == "torchcompile-dtypes-devices"
    assert slug("DiT models (Flux, SD3.5, Wan)") == "dit-models-flux-sd35-wan"
