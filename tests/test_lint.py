"""The code passes the linter: ruff with pyproject.toml's [tool.ruff] settings (the same check .pre-commit-config.yaml
runs before a commit)."""

import importlib.util
import subprocess
import sys

import pytest

from helpers import REPO

PATHS = ["qexp", "hydra_plugins", "tests", "benchmarks", "diagnostics", "scripts"]


def test_ruff_reports_nothing():
    if importlib.util.find_spec("ruff") is None:
        # a failure, not a skip: ruff is a pinned test tool (requirements-test.txt), so its absence is a broken setup
        pytest.fail(f"ruff is not installed in {sys.executable}: run `make setup-test`")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", *PATHS], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"ruff check {' '.join(PATHS)} failed:\n{out.stdout}{out.stderr}"


def test_the_package_declares_its_dependencies():
    """pyproject.toml takes its dependencies from requirements.txt, so `pip install -e .` into an existing environment
    states what is missing (the installed metadata lists the pins)."""
    from importlib.metadata import requires

    declared = requires("qexp") or []
    for pin in ("torch==2.13.0", "executorch==1.5.1", "mlflow==3.17.2", "hydra-core==1.3.2"):
        assert pin in declared, f"{pin} not in qexp's declared dependencies (re-run `make setup`): {declared}"


def _import_graph() -> dict:
    """qexp's modules -> the qexp modules each imports, module-level and function-level imports alike (a
    `from package import name` counts as importing the submodule `name` where there is one, else the package)."""
    import ast

    modules = {}
    for path in (REPO / "qexp").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            edges |= {resolve(n) for n in names if n.startswith("qexp")} - {None, module}
        graph[module] = edges
    return graph


def test_no_import_cycles():
    """No two qexp modules import each other, directly or through others, lazy imports inside functions included:
    each module can be read (and imported) after the ones it needs."""
    graph = _import_graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not cycles, "modules that import each other (directly or through others): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def _package(module: str, packages: set) -> str:
    """A module's package: qexp.<sub> for a module inside a subpackage, "qexp" for the root's modules (the run and its
    commands), "command" for a `__main__` (a command sits above everything it runs: `python -m qexp.tasks` lives in
    tasks/ only because `-m` puts it there)."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return "command"
    return ".".join(parts[:2]) if ".".join(parts[:2]) in packages else "qexp"


def test_no_import_cycles_between_packages():
    """The packages are layered (core at the bottom, then upstream, cache, models, data, eval, quant, ... the run,
    sensitivity, search, report at the top): no package imports, at any depth and inside functions too, a package
    that imports it back."""
    graph = _import_graph()
    packages = {".".join(m.split(".")[:2]) for m in graph if m.count(".") >= 2}
    edges: dict = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = _package(module, packages), _package(target, packages)
            if a != b and a != "command":
                edges.setdefault(a, {}).setdefault(b, []).append(f"{module} -> {target}")

    def reaches(start, goal):
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(edges.get(node, {}))
        return False

    back = sorted(f"{a} -> {b} ({edges[a][b][0]})" for a in edges for b in edges[a] if reaches(b, a))
    assert not back, "packages that import each other (directly or through others): " + "; ".join(back)


def test_core_imports_no_other_package():
    """qexp/core/ is the bottom layer: every package may import it because it imports none of them."""
    upward = sorted(f"{module} -> {target}" for module, targets in _import_graph().items() for target in targets
                    if module.startswith("qexp.core") and not target.startswith("qexp.core"))
    assert not upward, "qexp/core/ imports another qexp package: " + "; ".join(upward)


def test_the_quantization_grid_and_the_speed_model_sit_below_the_algorithms():
    """quant/ (the grid, the recipe, calibration), speed/ and sensitivity/ import nothing from transforms/ (the
    algorithms): the algorithms build on the grid, and the analysis reaches them through the run (qexp.pipeline)."""
    graph = _import_graph()
    upward = sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                    if module.startswith(("qexp.quant", "qexp.speed", "qexp.sensitivity"))
                    and target.startswith("qexp.transforms"))
    assert not upward, "imports from a lower package into transforms/: " + "; ".join(upward)


MODULE_MAX_LINES, FUNCTION_MAX_LINES = 300, 60


def test_modules_and_functions_stay_small():
    """Every qexp module fits in one sitting (at most 300 lines) and every function on a screen (60)."""
    import ast

    too_long = []
    for path in sorted((REPO / "qexp").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(REPO).as_posix()
        if len(text.splitlines()) > MODULE_MAX_LINES:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > FUNCTION_MAX_LINES:
                    too_long.append(f"{name}: {node.name}() {length} lines")
    assert not too_long, (f"over {MODULE_MAX_LINES} lines a module or {FUNCTION_MAX_LINES} a function (split it "
                          f"where a reader expects a seam): " + "; ".join(too_long))
