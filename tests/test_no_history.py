"""The package speaks of itself only: no work dates, session numbers or pointers to run records
in flashcore's code, comments, docstrings or shipped data. History lives in git; measured
tables live in benchmarks/README.md (with their date and command) and design reasons in docs/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flashcore"

# what dates a text as a diary entry: an ISO date, a run record's time stamp, a "session" (the
# word has no other use in the package), or a pointer to the records that left the tree
HISTORY = [
    (re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"), "a date"),
    (re.compile(r"\b20\d\d[01]\d[0-3]\dT\d{4}"), "a run record's time stamp"),
    (re.compile(r"\bsessions?\b", re.IGNORECASE), "a session"),
    (re.compile(r"benchmarks/(NOTES\.md|results)"), "a pointer to run records"),
]


def history_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, line) for each line of ``text`` that carries dated history."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, what in HISTORY:
            if pattern.search(line):
                found.append((n, what, line.strip()))
                break
    return found


def shipped_files() -> list[Path]:
    return sorted(p for ext in ("*.py", "*.json") for p in PACKAGE.rglob(ext)
                  if "__pycache__" not in p.parts)


def test_the_package_carries_no_dated_history():
    assert shipped_files(), "no package files found"
    bad = [f"{p.relative_to(PACKAGE.parent)}:{n}: {what}: {line[:100]}"
           for p in shipped_files()
           for n, what, line in history_lines(p.read_text(encoding="utf-8"))]
    assert not bad, ("dated history in the package (state the invariant or the reason; the "
                     "record belongs in git history or benchmarks/README.md):\n" + "\n".join(bad))


@pytest.mark.parametrize("line", [
    "# H100, 2026-11-26, graph us with 16 / 32 / 64-row tiles:",
    '"note": "from the 2026-11-23 tenth-session run"',
    "(the twenty-eighth session: 891 against 924 us)",
    "a record (bench-sm_90-20261126T062942.json)",
    "see benchmarks/NOTES.md",
    "Sessions of measured attempts",
])
def test_the_check_finds_a_diary_line(line):
    assert history_lines(f"x = 1\n{line}\n") and history_lines(line)[0][0] == 1


@pytest.mark.parametrize("line", [
    "# the tuned table's entry wins at 4096 keys",
    "DTYPE_BYTES = 2  # fp16 and bf16",
    "version = '4.8.1-cu12'",
    "shape = (1, 8, 512, 64)  # 2048 rows of 20 heads",
])
def test_the_check_leaves_plain_lines_alone(line):
    assert not history_lines(line)
