"""Every ``assert`` under tests/ can fail: none tests a conditional expression, a constant, a non-empty tuple,
``something or <a true constant>`` or a value compared with itself.

``assert a == 4 if c else 8`` parses as ``assert (a == 4) if c else 8``: when ``c`` is false it asserts the
constant 8, and ``a`` is never checked. ``assert (x, "msg")`` asserts a two-element tuple, which is always true
(``assert x, "msg"`` was meant). Read from the source with ``ast``, so helpers and launched ranks' code count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent


def _never_fails(test: ast.expr) -> str | None:
    """Why an assert of ``test`` cannot do its job, or None."""
    if isinstance(test, ast.IfExp):
        return ("a conditional expression: `assert a == b if c else d` asserts d when c is false; "
                "parenthesise the expected value: `assert a == (b if c else d)`")
    if isinstance(test, ast.Constant):
        if test.value:
            return "a true constant: it never fails"
        return "a false constant: it always fails (and `python -O` drops it); use pytest.fail(...)"
    if isinstance(test, ast.Tuple) and test.elts:
        return "a non-empty tuple is always true: `assert (x, msg)` was meant as `assert x, msg`"
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or) and any(
            isinstance(v, ast.Constant) and v.value for v in test.values):
        return "`or` with a true constant: it never fails"
    if isinstance(test, ast.Compare):
        for left, right in zip([test.left, *test.comparators], test.comparators):
            # f(x) == f(x) is a real check (the same answer twice); x == x compares a value with itself.
            if ast.dump(left) == ast.dump(right) and not any(isinstance(n, ast.Call) for n in ast.walk(left)):
                return "compares a value with itself"
    return None


def cannot_fail(source: str, filename: str) -> list[str]:
    """``file:line: why: the assert's source`` for each assert in ``source`` that cannot do its job."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Assert) and (why := _never_fails(node.test)):
            found.append(f"{filename}:{node.lineno}: {why}: {ast.get_source_segment(source, node)}")
    return sorted(found, key=lambda line: int(line.split(":")[1]))


def test_no_assert_in_the_tests_is_one_that_cannot_fail():
    files = sorted(TESTS.rglob("*.py"))
    assert Path(__file__).resolve() in files and (TESTS / "helpers" / "workers.py") in files  # the scan sees them
    found = [line for path in files
             for line in cannot_fail(path.read_text(), str(path.relative_to(TESTS.parent)))]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("source", [
    'assert a if b else c',
    'assert metrics["world_size"] == 4 if layout == "2x2" else 8',
    'assert 1',
    'assert True',
    'assert "msg"',
    'assert False, "unreachable"',
    'assert (x, "msg")',
    'assert (x == y, f"{x} != {y}")',
    'assert x or True',
    'assert x == x',
    'assert a.b[0] <= a.b[0]',
    'assert 0 < y < y',
    'def f():\n    if c:\n        assert 8\n',
])
def test_the_scanner_flags_an_assert_that_cannot_fail(source):
    found = cannot_fail(source, "example.py")
    line = source.count("\n", 0, source.index("assert")) + 1
    assert len(found) == 1 and found[0].startswith(f"example.py:{line}: "), found
    assert found[0].endswith(source.strip().splitlines()[-1].strip()), found  # names the assert's source


@pytest.mark.parametrize("source", [
    'assert a == (b if c else d)',
    'assert (a if b else c) == d',
    'assert x, "msg"',
    'assert x, (a, b)',
    'assert x or y',
    'assert x == y',
    'assert f(x) == f(x) != f(z)',  # the same answer twice: a real check
    'assert ()',  # always fails, but it fails
    'assert [x for x in y]',
])
def test_the_scanner_passes_an_assert_that_can_fail(source):
    assert cannot_fail(source, "example.py") == []
