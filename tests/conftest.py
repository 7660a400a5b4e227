"""Every test carries exactly one tier marker (``unit``, ``multiprocess``, ``testbed``, ``packaging``: see
``pytest --markers``), so ``pytest -m unit`` is a complete inner loop and no test slips in untiered.

The one-process tiers run first (unit, then packaging), and the jobs the selected tests declared in
:mod:`helpers.background` start beside them, on the core they leave free."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/ on the path: the shared code is the package ``helpers``, importable here and by name in launched ranks.
sys.path.insert(0, str(Path(__file__).parent))

from helpers import background  # noqa: E402 (after the path above)

TIERS = ("unit", "multiprocess", "testbed", "packaging")
FIRST = {"unit": 0, "packaging": 1}  # then the rest, in file order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            untiered.append(f"{item.nodeid} has {tiers or 'none'}")
    if untiered:
        raise pytest.UsageError(f"every test needs exactly one tier marker of {', '.join(TIERS)}: "
                                f"{'; '.join(untiered[:5])}{' ...' if len(untiered) > 5 else ''}")


class _FirstTiersThenBackground:
    """After deselection (-m, -k): the one-process tiers first, and the selected tests' background jobs started."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        items.sort(key=lambda item: min((FIRST.get(m.name, 2) for m in item.iter_markers() if m.name in TIERS),
                                        default=2))
        if not config.option.collectonly:
            background.start([item.nodeid for item in items])


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_FirstTiersThenBackground(), "hybrid-first-tiers")


def pytest_sessionfinish(session: pytest.Session) -> None:
    background.stop()
