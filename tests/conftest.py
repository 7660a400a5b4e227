"""Every test carries exactly one tier marker (``unit``, ``multiprocess``, ``testbed``, ``packaging``: see
``pytest --markers``), so ``pytest -m unit`` is a complete inner loop and no test slips in untiered."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/ on the path: the shared code is the package ``helpers``, importable here and by name in launched ranks.
sys.path.insert(0, str(Path(__file__).parent))

TIERS = ("unit", "multiprocess", "testbed", "packaging")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            untiered.append(f"{item.nodeid} has {tiers or 'none'}")
    if untiered:
        raise pytest.UsageError(f"every test needs exactly one tier marker of {', '.join(TIERS)}: "
                                f"{'; '.join(untiered[:5])}{' ...' if len(untiered) > 5 else ''}")
