"""The README and docs/*.md: every relative link and picture points at a file of the repository (and a heading
that exists, where the link names one), the README stays short, starts installing early and keeps one figure a
table cell, and every picture in docs/ is shown somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150
INSTALL_WITHIN_LINES = 30  # the first heading that says "Install" is on one of the README's first lines

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A figure: a measured value, 1.66x, 0.963, 12%, or a range of them, 2.1-2.6x (one figure). A number glued to a
# name (SD1.5, Flux.2, 1.3B) is no figure, nor a whole number without x or % (25 steps, 512 px, a version's 2).
NUMBER = r"\d+(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.]){NUMBER}(?:-{NUMBER})?(?:x|%)?(?![\w.])")
TWO_NUMBERS_SLASHED = re.compile(r"\d\s*/\s*\d")  # 1.13x / 1.04x, 1 / 1: two figures in one cell


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


def lines_outside_code(text: str) -> list[tuple[int, str]]:
    """(line number from 1, line) for every line that is not inside a fenced code block."""
    result, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            result.append((number, line))
    return result


def install_heading_line(text: str) -> int | None:
    """The line of the first heading whose text says "Install" (any case), or None."""
    for number, line in lines_outside_code(text):
        if re.match(r"#{1,6} ", line) and "install" in line.lower():
            return number
    return None


def figures(cell: str) -> list[str]:
    return [m for m in FIGURE.findall(cell) if "." in m or m.endswith(("x", "%"))]


def crowded_cells(text: str) -> list[str]:
    """The table cells that hold more than one figure, or two numbers with a slash between them."""
    crowded = []
    for number, line in lines_outside_code(text):
        if not line.startswith("|") or re.fullmatch(r"[|\s:-]+", line):  # not a table row, or its --- row
            continue
        for cell in line.strip().strip("|").split("|"):
            if len(figures(cell)) > 1 or TWO_NUMBERS_SLASHED.search(cell):
                crowded.append(f"line {number}: {cell.strip()}")
    return crowded


def test_the_readme_starts_installing_within_its_first_lines():
    line = install_heading_line((ROOT / "README.md").read_text())
    assert line is not None, "README.md has no heading that says Install"
    assert line <= INSTALL_WITHIN_LINES, f"installation begins on line {line}, at most {INSTALL_WITHIN_LINES}"


def test_every_readme_table_cell_holds_one_figure_at_most():
    crowded = crowded_cells((ROOT / "README.md").read_text())
    assert not crowded, "README.md: split these cells into columns or rows, one figure each: " + "; ".join(crowded)


@pytest.mark.parametrize(
    ("cell", "found"),
    [
        ("2.17x", ["2.17x"]),
        ("**0.963**", ["0.963"]),
        ("2.1-2.6x", ["2.1-2.6x"]),
        ("SD1.5, 512 px, 25 Euler steps", []),
        ("Wan 2.1 (1.3B), 33 frames", ["2.1"]),
        ("1.13x / 1.04x, 1.13x", ["1.13x", "1.04x", "1.13x"]),
    ],
)
def test_what_counts_as_a_figure(cell, found):
    assert figures(cell) == found


def test_the_readme_checks_fail_on_a_crowded_table_and_a_late_install():
    table = "| run | speed | SSIM |\n|---|---|---|\n| off | 1.00x | 1 / 1 |\n| on | **2.17x / 1.66x** | 0.963 (0.872) |"
    assert crowded_cells(table) == ["line 3: 1 / 1", "line 4: **2.17x / 1.66x**", "line 4: 0.963 (0.872)"]
    assert install_heading_line("# T\n```\n# install\n```\n## Installing\n") == 5  # not the line in the code block
    assert install_heading_line("# T\n## ComfyUI\n") is None


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
