"""Every test carries exactly one tier marker (``unit``, ``multiprocess``, ``testbed``, ``packaging``, ``slurm``,
``etcd``: see ``pytest --markers``), so ``pytest -m unit`` is a complete inner loop and no test slips in untiered.
The ``slurm`` and ``etcd`` tiers run only with ``--slurm`` and ``--etcd`` (``.ci/run`` runs them after the suite,
where it can install Debian's packages they need).

The one-process tiers run first (unit, then packaging), and the jobs the selected tests declared in
:mod:`helpers.background` start beside them, on the core they leave free."""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import pytest

# tests/ on the path: the shared code is the package ``helpers``, importable here and by name in launched ranks.
sys.path.insert(0, str(Path(__file__).parent))

from helpers import background  # noqa: E402 (after the path above)
from helpers.processes import SESSION_ENV, SESSION_VAR  # noqa: E402

# Every process this session starts inherits it, before any is started: what tells this session's jobs from those
# of another session running meanwhile (the slurm and etcd tiers, when run by hand meanwhile).
os.environ[SESSION_VAR] = uuid.uuid4().hex
# The environment the suite's jobs start with, as it is now: a background job that starts while a test beside it
# has monkeypatched a variable (TORCHELASTIC_RUN_ID: "under torchrun") must not inherit that.
SESSION_ENV.update(os.environ)

TIERS = ("unit", "multiprocess", "testbed", "packaging", "slurm", "etcd")
# Tiers that need Debian's packages: run only with their option (.ci/run installs the packages and runs them).
OPT_IN = {"slurm": "a real Slurm cluster on the testbed: root and Debian's Slurm packages",
          "etcd": "a real etcd cluster: Debian's etcd-server and the python-etcd client"}
FIRST = {"unit": 0, "packaging": 1}  # then the rest, in file order


def pytest_addoption(parser: pytest.Parser) -> None:
    for tier, needs in OPT_IN.items():
        parser.addoption(f"--{tier}", action="store_true", help=f"run the {tier} tier ({needs})")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    untiered = []
    for item in items:
        for tier in OPT_IN:
            if item.get_closest_marker(tier) and not config.getoption(f"--{tier}"):
                item.add_marker(pytest.mark.skip(reason=f"the {tier} tier runs with --{tier} (.ci/run runs it after "
                                                        "the suite)"))
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            untiered.append(f"{item.nodeid} has {tiers or 'none'}")
    if untiered:
        raise pytest.UsageError(f"every test needs exactly one tier marker of {', '.join(TIERS)}: "
                                f"{'; '.join(untiered[:5])}{' ...' if len(untiered) > 5 else ''}")


class _FirstTiersThenBackground:
    """After deselection (-m, -k): the one-process tiers first, tests that wait for the background lane last, and
    the selected tests' background jobs started."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        # A test that waits for the background lane goes last: waiting earlier would idle while the lane runs.
        items.sort(key=lambda item: (item.get_closest_marker("after_background") is not None,
                                     min((FIRST.get(m.name, 2) for m in item.iter_markers() if m.name in TIERS),
                                         default=2)))
        if config.option.collectonly:
            return
        for item in items:
            if item.get_closest_marker("background") and not _skipped(item):
                _declare_test(item)
        background.start([item.nodeid for item in items])


def _skipped(item: pytest.Item) -> bool:
    """A test that pytest will skip (``skip``, or ``skipif`` with a true condition, as this suite writes them): its
    function must not run in the lane, where the skip would only hide what it did."""
    conditions = [c for mark in item.iter_markers("skipif") for c in (*mark.args, mark.kwargs.get("condition", False))]
    return item.get_closest_marker("skip") is not None or any(not isinstance(c, str) and c for c in conditions)


def _declare_test(item: pytest.Item) -> None:
    """Run a ``background`` test's function in the background lane; its item then reports what it raised."""
    params = dict(item.callspec.params) if hasattr(item, "callspec") else {}
    kwargs = {}
    for name in item._fixtureinfo.argnames:
        if name in params:
            kwargs[name] = params[name]
        elif name == "tmp_path":
            kwargs[name] = item.config._tmp_path_factory.mktemp("background", numbered=True)
        else:
            raise pytest.UsageError(f"{item.nodeid} is marked background but asks for fixture {name!r}: "
                                    "background tests take only tmp_path and their parameters")
    background.declare(item.nodeid, lambda test_id: test_id == item.nodeid, lambda: item.obj(**kwargs))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if pyfuncitem.get_closest_marker("background") and background.started(pyfuncitem.nodeid):
        background.result(pyfuncitem.nodeid)  # what the function raised in the background, raised here
        return True
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_FirstTiersThenBackground(), "hybrid-first-tiers")


_SESSION_START = time.monotonic()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Where each background lane ended beside the session's end: the suite is CPU-bound on 2 cores, so a lane that
    ends long before the main one (or after it) says which way tests should move."""
    ended = background.lanes_ended()
    if ended:
        now = time.monotonic() - _SESSION_START
        terminalreporter.write_line("background lanes: " + ", ".join(
            f"the {lane} ended at {at - _SESSION_START:.0f} s" for lane, at in sorted(ended.items()))
            + f" of the session's {now:.0f} s")


def pytest_sessionfinish(session: pytest.Session) -> None:
    background.stop()
