"""The docs say what the software does and what was measured, where and with which command: no
issue numbers, no words about how the project was made; the quickstart's config files load."""

import os
import re
from pathlib import Path

import pytest

from services.run.config import load_config
from tests.launching import REPO

DOCS = sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "docs" / "guide").glob("*.md")) + [REPO / "README.md"]
ISSUE_REF = re.compile(r"\bissues?[ -]?#?\d+|(?<![\w&/])#\d+(?![\w-])", re.IGNORECASE)
# a folder beside a developer's checkout, which users do not have: docs must not point there
OUTSIDE_FOLDER = os.path.join("..", "shared")
PROCESS_WORDS = (
    "this session",
    "other helpers",
    "helpers' tests",
    "dev/ci vm",
    "the user's split",
    "threaded design",
    OUTSIDE_FOLDER,
)


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
    for fine in (
        "[τ](#tau-and-real-acceptance)",
        "[8](#8-walkthrough-your-own-model)",
        "&#8212;",
        "github.com/x/y/pull/12",
        "8 × 128 heads",
    ):
        assert not ISSUE_REF.search(fine), fine


@pytest.mark.parametrize("first_line", ["# run.toml:", "# run-cpu.toml:"])
def test_the_quickstarts_config_files_load(tmp_path, first_line):
    path = tmp_path / "run.toml"
    path.write_text(quickstart_block(first_line))
    cfg = load_config(path, [])
    assert cfg.target.model_path and cfg.data.path


# --- links and anchors -----------------------------------------------------------------------------
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)


def without_code(text: str) -> str:
    """The text less its fenced blocks and inline code spans (a link or heading there is not one)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: its rendered text lowercased, punctuation dropped except '-'
    and '_', spaces turned into '-'; letters outside ASCII (τ) are kept."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its words
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")  # html tags, code marks
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    found, seen = set(EXPLICIT_ANCHOR.findall(text)), {}
    for m in HEADING.finditer(re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)):
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")  # a repeated heading: -1, -2, ...
    return found


def broken_links(path: Path) -> list[str]:
    bad = []
    for m in LINK.finditer(without_code(path.read_text())):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            bad.append(f"{path.name}: {target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            bad.append(f"{path.name}: {target}: no heading or <a id> with that anchor in {linked.name}")
    return bad


def test_github_slugs_and_the_link_check_catch_what_they_are_for(tmp_path):
    assert github_slug("τ and real acceptance") == "τ-and-real-acceptance"
    assert github_slug("8. Walkthrough: your own model") == "8-walkthrough-your-own-model"
    assert (
        github_slug("Target precision: bf16 against FP8 (`bench/target_precision.py`)")
        == "target-precision-bf16-against-fp8-benchtarget_precisionpy"
    )
    doc = tmp_path / "a.md"
    doc.write_text(
        '# Top\n\n<a id="tau-x"></a>\n## τ x\n\n[ok](#top) [ok](#tau-x) [ok](#τ-x) [bad](#nope) '
        "[bad](missing.md) `[code](#not-a-link)`\n```\n[code](#nor-this)\n```\n"
    )
    assert broken_links(doc) == [
        "a.md: #nope: no heading or <a id> with that anchor in a.md",
        "a.md: missing.md: no such file",
    ]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_link_between_the_docs_resolves(path):
    assert not broken_links(path)


# --- claims users tried ----------------------------------------------------------------------------
def paragraph_with(text: str, needle: str) -> str:
    return next(p for p in text.split("\n\n") if needle in p)


def test_what_users_tried_from_the_docs_is_so():
    from services.run.config import TARGET_DTYPES

    texts = {p.name: p.read_text() for p in DOCS}
    sources = [p.read_text() for p in (REPO / "launcher").glob("*.py")]
    # huggingface-hub's command line is `hf` (`huggingface-cli` is gone from the versions installed)
    assert not [n for n, t in texts.items() if "huggingface-cli" in t] and not any(
        "huggingface-cli" in s for s in sources
    )
    # `eval --help` calls --eval-device the older name
    assert not [n for n, t in texts.items() if "--eval-device" in t]
    # every capture path the target can log (services/target/model/model.py)
    capture = paragraph_with(texts["README.md"], "capture path at start")
    assert all(f"`{name}`" in capture for name in ("packed", "packed-varlen", "packed-reference", "per-document"))
    # every target.dtype the config accepts
    row = next(line for line in texts["config.md"].splitlines() if line.startswith("| `target.dtype`"))
    assert all(re.search(rf"\b{d}\b", row) for d in TARGET_DTYPES), row
    # target labels are the default: the quickstart says so where it names them
    assert load_config(None, []).target.labels_from_target is True
    assert "default" in paragraph_with(texts["quickstart.md"], "labels_from_target = true")
    # the fast test set takes minutes, not one
    assert "about a minute" not in paragraph_with(texts["README.md"], '-m "not slow"')


def test_the_readmes_test_command_is_the_one_ci_runs():
    """README's "Run the tests" block is, word for word, the pytest line of .ci/run (its time is CI's)."""
    readme = (REPO / "README.md").read_text()
    command = readme.split("Run the tests:", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()
    assert command.startswith("python3 -m pytest ") and "\n" not in command, command
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, f"README runs `{command}`; .ci/run does not"
