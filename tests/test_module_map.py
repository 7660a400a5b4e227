"""docs/architecture.md's module map names every module under hybrid/, and names no module that is not there.

The map is the first code block under "## Modules". A line that starts with a folder (``hybrid/core/``,
``comm/``... ending in ``/``) opens it for the lines indented deeper below it; a line that starts with module
names (``topology.py``, or several sharing one line: ``comm/flat.py, hierarchical.py, sharded.py``) names
them relative to the folder it sits in, and each bare name after the first on a line takes the first one's
folder (``hierarchical.py`` there is ``comm/hierarchical.py``). What follows the names on a line is their
description. ``__init__.py`` and ``__main__.py`` files are exempt: the map names a package by its folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
EXEMPT = {"__init__.py", "__main__.py"}
# The names column: one module path, then bare module names after commas.
NAMES = re.compile(r"[\w./-]+\.py(?:, [\w.-]+\.py)*")


def map_block(text: str) -> str:
    """The first ``` block after the "## Modules" heading of ``text``."""
    after = text.split("\n## Modules\n", 1)[1]
    return after.split("```", 2)[1]


def named_modules(block: str) -> set[str]:
    """The module paths (from the repository root) that the map ``block`` names."""
    folders: list[tuple[int, str]] = []  # (indent, path) of the folders the current line sits in
    named = set()
    for line in block.splitlines():
        text = line.lstrip()
        if not text:
            continue
        indent = len(line) - len(text)
        while folders and folders[-1][0] >= indent:
            folders.pop()
        base = folders[-1][1] if folders else ""
        first = text.split()[0]
        if first.endswith("/"):
            folders.append((indent, base + first))
        elif names := NAMES.match(text):
            head, *rest = names.group().split(", ")
            prefix = head.rpartition("/")[0] + "/" if "/" in head else ""
            named |= {base + head} | {base + prefix + name for name in rest}
    return named


def map_mismatch(text: str, modules: set[str]) -> tuple[list[str], list[str]]:
    """(modules the map of ``text`` leaves out, names in it under hybrid/ that are no module); ``modules``:
    paths from the repository root."""
    named = named_modules(map_block(text))
    listed = {m for m in modules if Path(m).name not in EXEMPT}
    return sorted(listed - named), sorted(n for n in named - modules if n.startswith("hybrid/"))


def test_the_module_map_names_every_module():
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "hybrid").rglob("*.py")}
    missing, unknown = map_mismatch((ROOT / "docs" / "architecture.md").read_text(), modules)
    assert missing == [], f"docs/architecture.md's module map does not name: {', '.join(missing)}"
    assert unknown == [], f"docs/architecture.md's module map names modules that do not exist: {', '.join(unknown)}"


EXAMPLE = """# x

## Modules

```
hybrid/core/                   the core
  topology.py                  who is where
  comm/flat.py, sharded.py     two algorithms
hybrid/app/                    the trainer
  state/                       what a run carries
    checkpoint.py              checkpoints; mentions held.py only in its description
  loop.py                      the loop
hybrid/train.py, bench.py      entry points
```
"""


def test_the_map_check_can_fail():
    """Shared lines inherit the first name's folder, folders nest by indentation, and a name in a description
    does not count."""
    modules = {"hybrid/core/__init__.py", "hybrid/core/topology.py", "hybrid/core/comm/flat.py",
               "hybrid/core/comm/sharded.py", "hybrid/app/state/checkpoint.py", "hybrid/app/loop.py",
               "hybrid/train.py", "hybrid/bench.py"}
    assert map_mismatch(EXAMPLE, modules) == ([], [])
    assert map_mismatch(EXAMPLE, modules | {"hybrid/app/state/held.py", "hybrid/core/comm/groups.py"}) == (
        ["hybrid/app/state/held.py", "hybrid/core/comm/groups.py"], [])
    assert map_mismatch(EXAMPLE, modules - {"hybrid/core/comm/sharded.py"}) == ([], ["hybrid/core/comm/sharded.py"])
    # A bare name after the first takes its folder: comm/, not the core's top level.
    assert map_mismatch(EXAMPLE, modules - {"hybrid/core/comm/sharded.py"} | {"hybrid/core/sharded.py"}) == (
        ["hybrid/core/sharded.py"], ["hybrid/core/comm/sharded.py"])


def test_every_package_ships_in_the_wheel():
    """pyproject.toml names the packages a wheel carries one by one: a sub-package missing there imports from a
    checkout and fails installed (tests/test_wheel.py finds it too, minutes later)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "hybrid").rglob("__init__.py")}
    assert sorted(packages - listed) == [], "add them to [tool.setuptools] packages in pyproject.toml"
