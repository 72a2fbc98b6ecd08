"""docs/design.md's file map names every module of launcher/ and services/ (and nothing that is gone),
each under the folder it lives in: the map is how a newcomer finds their way, so a module added or
moved without its line fails here."""

import re

from tests.launching import REPO

FOLDERS = ("launcher", "services")


def listed_in_map(text: str) -> set[str]:
    """The map's modules as paths: folder lines ('services/', '  run/', 'services/drafter/books/') nest by
    indentation; a module line ('  config.py   what it is') belongs to the folder above it."""
    found, stack = set(), []  # stack: (indent, folder path)
    for block in re.findall(r"```\n(.*?)```", text, re.S):
        stack.clear()
        for line in block.splitlines():
            m = re.match(r"^( {0,6})(\S+)\s", line + " ")
            if not m or not (m.group(2).endswith("/") or m.group(2).endswith(".py")):
                continue  # a description's continuation line
            indent, name = len(m.group(1)), m.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            if name.endswith("/"):
                stack.append((indent, (stack[-1][1] if stack and indent else "") + name))
            elif stack:
                found.add(stack[-1][1] + name)
    return found


def modules_in_tree() -> set[str]:
    return {
        str(p.relative_to(REPO))
        for folder in FOLDERS
        for p in (REPO / folder).rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def test_the_design_map_lists_every_module_where_it_lives():
    listed = {p for p in listed_in_map((REPO / "docs" / "design.md").read_text()) if p.startswith(FOLDERS)}
    tree = modules_in_tree()
    assert not tree - listed, f"modules missing from docs/design.md's map: {sorted(tree - listed)}"
    assert not listed - tree, f"docs/design.md's map names modules that are not there: {sorted(listed - tree)}"


def test_the_map_reader_nests_folders_and_skips_continuation_lines():
    text = (
        "```\nservices/              shared\n  run/                   a run\n    config.py            the config\n"
        "                         services/wrong.py in a description\n  data/                  data\n"
        "    batch.py             the batch\nservices/drafter/books/ books\n  ledger.py            the ledger\n```\n"
    )
    assert listed_in_map(text) == {
        "services/run/config.py",
        "services/data/batch.py",
        "services/drafter/books/ledger.py",
    }
