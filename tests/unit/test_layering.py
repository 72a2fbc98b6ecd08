"""The layers of the code, checked on its source: the two roles are peers, the shared layer sits under
both, and only services/eval (the in-process `launcher eval`) and services/tools (the launcher's jobs)
may use a role's code.

    services/{run,data,net,process,decoding}
                        shared: imports no role package, nor services.eval or services.tools; and
                        inside it, no package imports one above it (SHARED_ORDER, bottom to top:
                        run < data, decoding < net < process)
    services/target     imports no services.drafter, no services.eval
    services/drafter    imports no services.target, no services.eval
    launcher/           imports the shared layer only; it runs the roles, `launcher eval` and the
                        tools as child processes, each a job of services/process/jobs.py's table, and names
                        no services module itself

No two modules of launcher/ and services/ import each other, directly or through others.

Every import counts, also one inside a function: a lazy import loads the module all the same.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import REPO

ABOVE_SHARED = ("services.drafter", "services.target", "services.eval", "services.tools")
FORBIDDEN = {  # the layer of a module -> the packages it must not import
    "services.drafter": ("services.target", "services.eval"),
    "services.target": ("services.drafter", "services.eval"),
    "launcher": ABOVE_SHARED,
    "services": ABOVE_SHARED,  # the shared modules, in SHARED's packages
}
# the shared layer's packages, by what their modules are: what a run is, the data, the wire, the
# process, speculative decoding's shared parts
SHARED = ("services.run", "services.data", "services.net", "services.process", "services.decoding")
# the shared layer's order, bottom to top: a package imports only packages of a lower rank (peers of one
# rank import neither). run: what a run is, and the atomic file writes its runspec.json needs; data and
# decoding: what passes between the roles; net: the wire, health's probe and Drops; process: a worker
# as a process (its bootstrap wires the sockets, its health responder drives sd_notify)
SHARED_ORDER = {
    "services.run": 0,
    "services.data": 1,
    "services.decoding": 1,
    "services.net": 2,
    "services.process": 3,
}


def layer_of(module: str) -> str | None:
    """The layer a module (dotted name) belongs to, or None when it has no rule (services.eval,
    services.tools: each may import what it runs)."""
    parts = module.split(".")
    if parts[0] == "launcher":
        return "launcher"
    if parts[0] != "services":
        return None
    if len(parts) <= 2:
        return "services"
    sub = f"services.{parts[1]}"
    if sub in SHARED:
        return "services"
    return sub if sub in FORBIDDEN else None


def imported(source: str, module: str) -> list[tuple[int, str]]:
    """(line, module) of every import in a source, at any depth; relative imports resolved against
    `module` (the importing module's dotted name)."""
    package = module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            # the module itself first; `from services import target` imports services.target
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def names_any(name: str, modules) -> bool:
    """An imported name is one of `modules` or inside one."""
    return any(name == banned or name.startswith(banned + ".") for banned in modules)


def violations(source: str, module: str) -> list[str]:
    layer = layer_of(module)
    if layer is None:
        return []
    bad = {}  # one line per import statement: its first forbidden name
    for line, name in imported(source, module):
        if names_any(name, FORBIDDEN[layer]):
            bad.setdefault(line, name)
    return [f"{module}:{line}: imports {name}" for line, name in sorted(bad.items())]


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def product_modules() -> list[Path]:
    return sorted([*(REPO / "services").rglob("*.py"), *(REPO / "launcher").rglob("*.py")])


def test_no_module_imports_across_roles_or_upward():
    found = [v for path in product_modules() for v in violations(path.read_text(), module_name(path))]
    assert not found, "\n".join(found)


def test_the_check_sees_every_layer():
    names = {module_name(p) for p in product_modules()}
    assert {layer_of(n) for n in names} >= {"services", "services.drafter", "services.target", "launcher"}
    assert layer_of("services.run.schedule") == "services" and layer_of("services.eval.launcher_eval") is None
    assert layer_of("services.tools.demo") is None and layer_of("services.drafter.worker") == "services.drafter"
    # every module of the shared layer sits in one of its packages: no flat services/*.py besides __init__
    packages = {f"services.{p.name}" for p in (REPO / "services").iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(SHARED) | {"services.drafter", "services.target", "services.eval", "services.tools"}
    assert [p.name for p in (REPO / "services").glob("*.py")] == ["__init__.py"]
    for package in SHARED:
        modules = {module_name(p) for p in (REPO / Path(*package.split("."))).glob("*.py")}
        assert modules and {layer_of(n) for n in modules} == {"services"}, package


def shared_package(module: str) -> str | None:
    """The shared package ("services.net") a dotted name lies in, or None."""
    package = ".".join(module.split(".")[:2])
    return package if package in SHARED_ORDER else None


def upward(source: str, module: str) -> list[str]:
    """The imports by which a shared module reaches a shared package above its own, or beside it
    (a peer of the same rank)."""
    own = shared_package(module)
    if own is None:
        return []
    bad = {}
    for line, name in imported(source, module):
        other = shared_package(name)
        if other and other != own and SHARED_ORDER[other] >= SHARED_ORDER[own]:
            bad.setdefault(line, name)
    return [
        f"{module}:{line}: imports {name} (rank {SHARED_ORDER[shared_package(name)]})"
        for line, name in sorted(bad.items())
    ]


def test_no_shared_package_imports_one_above_it():
    assert set(SHARED_ORDER) == set(SHARED)
    found = [v for path in product_modules() for v in upward(path.read_text(), module_name(path))]
    assert not found, (
        "the shared layer's order is "
        + " < ".join(sorted(SHARED_ORDER, key=SHARED_ORDER.get))
        + (":\n" + "\n".join(found))
    )


@pytest.mark.parametrize(
    "module, source, bad",
    [
        ("services.net.x", "from services.process.health import HealthServer\n", True),
        ("services.run.x", "def f():\n    from services.process import files\n", True),
        ("services.data.x", "from ..net import wire\n", True),
        ("services.data.x", "import services.decoding.lossless\n", True),  # peers import neither
        (
            "services.process.x",
            "from services.net.sockets import secure_socket\nfrom services.run import config\n",
            False,
        ),
        ("services.net.x", "from .wire import pack\nfrom services.data.batch import Batch\n", False),
        ("services.drafter.x", "from services.process.health import HealthServer\n", False),  # not shared: no rank
    ],
)
def test_the_order_check_catches_an_upward_import(module, source, bad):
    assert bool(upward(source, module)) == bad, upward(source, module)


def is_module(name: str) -> bool:
    path = REPO / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_imports(source: str, module: str) -> set[str]:
    """The product modules a module imports, at any depth: `from a.b import c` is a.b.c when c is a
    module, else a.b; relative imports resolved (a package's __init__ is its own package)."""
    package = module.split(".") if module_name_is_package(module) else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base)
    return {name for name in found if name.split(".")[0] in FOLDERS and is_module(name) and name != module}


FOLDERS = ("launcher", "services")


def module_name_is_package(module: str) -> bool:
    return (REPO / Path(*module.split(".")) / "__init__.py").is_file()


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a graph (module -> the modules it imports): each strongly connected set
    of two or more modules, as one cycle through it, smallest name first (Tarjan, iterative)."""
    index, low, on_stack, stack, groups, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(path_through(graph, group) for group in groups)


def path_through(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """One cycle inside a strongly connected group, from its first module back to it (breadth first)."""
    start, members = group[0], set(group)
    came_from, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child in members and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    return group


def test_no_import_cycle_between_modules():
    graph = {module_name(path): module_imports(path.read_text(), module_name(path)) for path in product_modules()}
    assert sum(map(len, graph.values())) > 300, "the check sees no imports"
    found = cycles(graph)
    assert not found, "import cycles (each a -> b -> ... -> a):\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_check_finds_cycles_of_any_length():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    # a lazy import inside a function and a relative import both count
    lazy = module_imports("def f():\n    from services.net import wire\n", "services.data.batch")
    relative = module_imports("from .wire import pack\nfrom . import curve\n", "services.net.sockets")
    assert lazy == {"services.net.wire"} and relative == {"services.net.wire", "services.net.curve"}


def services_strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal (f-strings' literal parts too) that names a services module."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("services.")
    ]


def test_the_launcher_starts_children_only_through_the_job_table():
    found = [
        f"{path.relative_to(REPO)}:{line}: {text!r}"
        for path in sorted((REPO / "launcher").rglob("*.py"))
        for line, text in services_strings(path.read_text())
    ]
    assert not found, "a child the launcher starts goes through services.process.jobs.argv:\n" + "\n".join(found)
    assert services_strings('argv = [sys.executable, "-m", f"services.{role}"]\n')  # the check sees f-strings


def test_every_job_of_the_table_runs_as_a_program():
    """Each job's module is a product module that `python -m` runs: a package with __main__.py, or a
    module with its `if __name__ == "__main__":` block; the roles' jobs are named as the roles."""
    from services.process.jobs import JOBS

    for job, (module, what) in JOBS.items():
        path = REPO / Path(*module.split("."))
        main = path / "__main__.py" if path.is_dir() else path.with_suffix(".py")
        assert main.is_file(), f"{job}: {module} has no {main.relative_to(REPO)}"
        assert main.name == "__main__.py" or '__name__ == "__main__"' in main.read_text(), f"{job}: {module}"
        assert what, job
    assert {"target", "drafter"} <= set(JOBS) and JOBS["target"][0] == "services.target"


@pytest.mark.parametrize(
    "module, source",
    [
        ("services.drafter.x", "from services.target.decode import Step\n"),
        ("services.drafter.x", "def f():\n    import services.target.model as m\n    return m\n"),
        ("services.drafter.x", "def f():\n    from services.target import packing\n"),
        ("services.drafter.x", "from services import target\n"),
        ("services.drafter.x", "from ..target import decode\n"),
        ("services.drafter.x", "from services.eval.launcher_eval import main\n"),
        ("services.target.x", "from services.drafter.prompts import prompt_sets\n"),
        ("services.x", "from services.drafter.schedule import Plan\n"),
        ("services.x", "from .eval import spec_eval\n"),
        ("launcher.x", "class A:\n    def f(self):\n        from services.drafter import checkpoint_compat\n"),
        ("launcher.x", "import services.target.regenerate\n"),
        ("launcher.x", "from services.tools.gguf_model import load\n"),
    ],
)
def test_the_check_catches_a_violation(module, source):
    assert violations(source, module), source


@pytest.mark.parametrize(
    "module, source",
    [
        ("services.drafter.x", "from services.decoding.decode_step import Step\nfrom services.drafter import model\n"),
        ("services.target.x", "from services.run import runspec\nfrom .hybrid import ROLLBACKS\n"),
        ("launcher.x", "from services.run.schedule import Plan\nimport services.run.config\n"),
        ("services.eval.x", "from services.target.model import load_target\nfrom services.drafter import spec_eval\n"),
        ("services.x", "from services.drafter_like import thing\n"),
    ],
)
def test_the_check_lets_allowed_imports_be(module, source):
    assert not violations(source, module), violations(source, module)


@pytest.mark.processes
def test_a_drafter_process_loads_no_transformers_model_code():
    """What a drafter worker imports at startup (its entry module and the worker, which imports the
    training loop, the bookkeeping and real acceptance) holds no transformers module at all: none of
    the target's model code (`transformers.models.*`, `transformers.modeling_*`, the KV cache of
    `transformers.cache_utils`). Real acceptance imports transformers' AutoTokenizer and
    GenerationConfig lazily, at its first evaluation: a tokenizer and a config, never a model
    (remote_eval.models_in_process counts the models; test_verify_wire checks that
    transformers.modeling_utils stays out). A fresh process, as the drafter worker is."""
    code = (
        "import sys\n"
        "import services.drafter.__main__, services.drafter.worker\n"
        "print('\\n'.join(m for m in sys.modules if m.startswith('transformers')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == []


# A role's core works with no sockets, signals or health: its process shell (worker.py) owns those.
CORES = (
    "services/target/core.py",
    "services/target/replies.py",
    "services/target/verify/verifying.py",
    "services/drafter/training/core.py",
)
SHELL_ONLY = (
    "zmq",
    "signal",
    "services.process.health",
    "services.process.lifecycle",
    "services.process.worker_main",
    "services.net.transport.BatchServer",
    "services.net.batch_client",
    "services.drafter.training.source",
    "services.drafter.training.pick_source",
)


def shell_imports(source: str, module: str) -> list[str]:
    return [
        f"{module}:{line}: imports {name}" for line, name in imported(source, module) if names_any(name, SHELL_ONLY)
    ]


def test_the_cores_import_no_socket_signal_or_health():
    found = [v for path in CORES for v in shell_imports((REPO / path).read_text(), module_name(REPO / path))]
    assert not found, "\n".join(found)
    assert shell_imports("from services.net.transport import BatchServer, Request", "services.target.core")
    assert not shell_imports("from services.net.transport import Request", "services.target.core")


# Functions that take the whole Config. The config's boundary may: the config and the run spec that
# resolves it, the launcher (preflight, supervisor), the workers' shells, the jobs that run as their own
# programs (`launcher eval`'s, the tools) and the builders that turn the config into a component's
# settings (from_config, build, load, prepare). Every other function takes its settings.
SHELLS = ("services/target/worker.py", "services/drafter/worker.py")
JOBS = ("services/eval/", "services/tools/")
BOUNDARY_MODULES = ("services/run/config/", "services/run/runspec.py", "launcher/", *SHELLS, *JOBS)
BOUNDARY_FUNCTIONS = ("setup", "from_config", "build", "load", "prepare")


def functions_taking_config() -> set[str]:
    found = set()
    for path in product_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(a.annotation is not None and ast.unparse(a.annotation).strip("'\"") == "Config" for a in args):
                    found.add(f"{path.relative_to(REPO)} {node.name}")
    return found


def test_components_take_their_settings_not_the_whole_config():
    found = functions_taking_config()
    assert "services/drafter/worker.py setup" in found, "the check sees nothing"
    components = sorted(
        f for f in found if not f.startswith(BOUNDARY_MODULES) and f.split(" ")[1] not in BOUNDARY_FUNCTIONS
    )
    assert not components, "take the component's settings, not the whole Config:\n" + "\n".join(components)


def test_no_worker_shell_keeps_the_whole_config():
    """setup(cfg) builds the components from it; nothing after setup reads it."""
    for path in SHELLS:
        tree = ast.parse((REPO / path).read_text())
        kept = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr in ("cfg", "config")
        ]
        assert not kept, f"{path}: self.cfg at lines {kept}"
