"""The engine's prose stays short: comments and docstrings are at most 15% of ``tome_core``'s non-blank lines, and
none holds a date (measurements and history live in docs/). Read from the source with ``tokenize``."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOST = 0.15
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def prose_lines(source: str) -> set[int]:
    """The line numbers of ``source`` that hold a comment or a docstring (a string that is a statement alone)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines = set()
    for index, token in enumerate(tokens):
        if token.type == tokenize.COMMENT:
            lines.add(token.start[0])
        elif token.type == tokenize.STRING:
            before = index - 1
            while before >= 0 and tokens[before].type in (tokenize.NL, tokenize.COMMENT):
                before -= 1
            alone = before < 0 or tokens[before].type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
            if alone and tokens[index + 1].type == tokenize.NEWLINE:
                lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def share(paths) -> tuple[int, int]:
    prose = code = 0
    for path in paths:
        source = path.read_text()
        text = source.splitlines()
        prose += sum(1 for n in prose_lines(source) if text[n - 1].strip())
        code += sum(1 for line in text if line.strip())
    return prose, code


def test_the_engine_is_at_most_15_percent_prose():
    prose, lines = share(sorted((ROOT / "tome_core").rglob("*.py")))
    assert prose / lines <= MOST, f"{prose} of {lines} non-blank lines are comments or docstrings"


def test_no_date_in_the_engines_prose():
    dated = []
    for path in sorted((ROOT / "tome_core").rglob("*.py")):
        source = path.read_text()
        text = source.splitlines()
        dated += [f"{path.name}:{n}" for n in sorted(prose_lines(source)) if DATE.search(text[n - 1])]
    assert dated == []


def test_the_count_finds_comments_and_docstrings_only(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Doc."""\n\nX = "not prose"  # prose\n\n\ndef f():\n    """Two\n    lines."""\n    return X\n')
    assert share([module]) == (4, 6)
