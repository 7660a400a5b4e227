"""Run a shared multi-process job once per argument, and remember a failure as well as a result.

Several tests read one launched job (workers start once per layout). With
``functools.cache`` a job that raised would be launched again by every
later test that reads it, minutes each; here the first test gets the job's
own error and the others fail at once, naming it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest


def once(fn: Callable[..., Any]) -> Callable[..., Any]:
    outcomes: dict[tuple, tuple[bool, Any]] = {}

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        if args in outcomes:
            ok, value = outcomes[args]
            if ok:
                return value
            pytest.fail(f"{fn.__name__}{args} failed in an earlier test: {value}", pytrace=False)
        try:
            value = fn(*args)
        except (Exception, pytest.fail.Exception) as exc:  # pytest-timeout's failure is not an Exception
            outcomes[args] = (False, f"{type(exc).__name__}: {str(exc)[:500]}")
            raise
        outcomes[args] = (True, value)
        return value

    return wrapper
