"""The docs say what the software does and what was measured, where and with which command: no
issue numbers, no words about how the project was made; the quickstart's config files load."""
import os
import re
from pathlib import Path

import pytest

from services.config import load_config

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
ISSUE_REF = re.compile(r"\bissues?[ -]?#?\d+|(?<![\w&/])#\d+(?![\w-])", re.IGNORECASE)
# a folder beside a developer's checkout, which users do not have: docs must not point there
OUTSIDE_FOLDER = os.path.join("..", "shared")
PROCESS_WORDS = ("this session", "other helpers", "helpers' tests", "dev/ci vm", "the user's split",
                 "threaded design", OUTSIDE_FOLDER)


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of every ``` block of a markdown file, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", path.read_text(), re.M | re.S)]


def quickstart_block(first_line: str) -> str:
    """The quickstart's fenced block whose first line is `first_line` (a comment naming it)."""
    found = [text for _, text in fenced_blocks(REPO / "docs" / "quickstart.md") if text.startswith(first_line)]
    assert len(found) == 1, f"docs/quickstart.md: expected one block starting {first_line!r}, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_issue_numbers_and_no_words_about_how_it_was_made(path):
    text = path.read_text()
    hits = [f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in ISSUE_REF.finditer(text)]
    lower = text.lower()
    hits += [f"{path.name}:{lower.count(chr(10), 0, lower.index(w)) + 1}: {w}" for w in PROCESS_WORDS if w in lower]
    assert not hits, hits


def test_the_checks_catch_what_they_are_for():
    for bad in ("see issue 12", "(#12)", "issue-17", "Issues 3"):
        assert ISSUE_REF.search(bad), bad
    for fine in ("[τ](#tau-and-real-acceptance)", "[8](#8-walkthrough-your-own-model)", "&#8212;", "github.com/x/y/pull/12", "8 × 128 heads"):
        assert not ISSUE_REF.search(fine), fine


@pytest.mark.parametrize("first_line", ["# run.toml:", "# run-cpu.toml:"])
def test_the_quickstarts_config_files_load(tmp_path, first_line):
    path = tmp_path / "run.toml"
    path.write_text(quickstart_block(first_line))
    cfg = load_config(path, [])
    assert cfg.target.model_path and cfg.data.path
