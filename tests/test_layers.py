"""The package's layers import only downward, with no cycle, counting imports made inside functions too.

tools -> app -> integrations -> runtime -> core (integrations: hybrid inside Lightning and the Hugging Face
Trainer; nothing of ours imports it). The core imports neither Hydra nor TensorBoard (any training loop can use
it), and nothing imports the ``python -m hybrid.*`` entry points. Read from the source with ``ast``, so an
import hidden in a function (which Python resolves only when it runs) counts like one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "hybrid"
LAYERS = ("core", "runtime", "integrations", "app", "tools")  # lowest first
ENTRY_POINTS = {"hybrid.train", "hybrid.bench", "hybrid.report", "hybrid.costmodel", "hybrid.testbed"}
CORE_MUST_NOT_IMPORT = ("hydra", "omegaconf", "tensorboard", "torch.utils.tensorboard")
# Inside the app, lowest first: the two base modules, then the sub-packages. Each imports only from itself and
# what comes before it; the app's other top-level modules (the entry point, worker, set-up, loop, checks) run
# the job and may import any of them, and none of these imports those.
APP_LEVELS = ("hybrid.app.targets", "hybrid.app.config", "hybrid.app.components", "hybrid.app.state",
              "hybrid.app.replicas", "hybrid.app.observability")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str:
    """The module of ours that ``name`` (a module, or a module's attribute) lives in."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(module: str) -> tuple[set[str], set[str]]:
    """(modules of ours, other top-level names) that ``module`` imports anywhere in its source."""
    ours, others = set(), set()
    package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            if name == "hybrid" or name.startswith("hybrid."):
                ours.add(_resolve(name))
            else:
                others.add(name)
    ours.discard(module)
    return ours, others


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


GRAPH = {m: imports_of(m)[0] for m in MODULES}


def test_every_module_is_in_a_layer_or_is_an_entry_point():
    loose = sorted(m for m in MODULES if layer_of(m) is None and m not in ENTRY_POINTS | {"hybrid", "hybrid.conf"})
    assert loose == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m)))
def test_imports_go_only_downward(module):
    rank = LAYERS.index(layer_of(module))
    upward = sorted(dep for dep in GRAPH[module]
                    if dep in ENTRY_POINTS or (layer_of(dep) and LAYERS.index(layer_of(dep)) > rank))
    assert upward == [], f"{module} ({layer_of(module)}) imports from above: {upward}"


def app_level_of(module: str) -> int | None:
    """The index of ``module``'s base module or sub-package in APP_LEVELS; len(APP_LEVELS) for the app's other
    top-level modules; None outside the app."""
    if layer_of(module) != "app" or module == "hybrid.app":
        return None
    for i, level in enumerate(APP_LEVELS):
        if module == level or module.startswith(level + "."):
            return i
    return len(APP_LEVELS)


def test_every_app_module_is_in_a_sub_package_or_runs_the_job():
    """Modules of the app's top level are few and named; everything else is a base module or sits in a
    sub-package."""
    top = sorted(m for m in MODULES if app_level_of(m) == len(APP_LEVELS))
    assert top == ["hybrid.app.checks", "hybrid.app.loop", "hybrid.app.setup", "hybrid.app.slurm_launcher",
                   "hybrid.app.slurm_wait", "hybrid.app.train", "hybrid.app.worker"]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if app_level_of(m) is not None))
def test_app_sub_packages_import_only_from_those_before_them(module):
    level = app_level_of(module)
    upward = sorted(dep for dep in GRAPH[module] if app_level_of(dep) is not None and app_level_of(dep) > level)
    assert upward == [], f"{module} imports from a sub-package after its own: {upward}"


def test_nothing_of_ours_imports_the_integrations():
    """They import Lightning or transformers on import: the trainer and tools must not pay for them."""
    importers = sorted(m for m, deps in GRAPH.items() if layer_of(m) != "integrations"
                       and any(layer_of(d) == "integrations" for d in deps))
    assert importers == []


def test_the_core_imports_neither_hydra_nor_tensorboard():
    offenders = {m: sorted(n for n in imports_of(m)[1] if n.startswith(CORE_MUST_NOT_IMPORT))
                 for m in MODULES if layer_of(m) == "core"}
    assert {m: names for m, names in offenders.items() if names} == {}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
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
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_there_is_no_import_cycle():
    assert _cycles(GRAPH) == []


def test_the_checks_can_fail():
    """The walker sees a function-level import (bench_train imports the trainer inside a function, to keep
    ``--help`` fast), and the cycle finder finds a cycle."""
    top_level = {n.module for n in ast.parse(MODULES["hybrid.tools.bench_train"].read_text()).body
                 if isinstance(n, ast.ImportFrom)}
    assert "hybrid.app.worker" not in top_level and "hybrid.app.worker" in GRAPH["hybrid.tools.bench_train"]
    assert app_level_of("hybrid.app.components.models") < app_level_of("hybrid.app.replicas.base") < app_level_of("hybrid.app.worker")
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_function_is_longer_than_60_lines():
    """A long function is where set-up, stepping and reporting get tangled: each stays short enough to read whole."""
    long = sorted((node.end_lineno - node.lineno + 1, f"{module}.{node.name}")
                  for module, path in MODULES.items() for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60)
    assert long == []
