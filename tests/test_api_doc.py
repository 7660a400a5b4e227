"""docs/api.md is the public surface: every name in ``hybrid.__all__`` has its entry there, each documented
signature has the code's parameters (names, kinds, defaults). (That ``import hybrid`` loads no torch until a name is
used: tests/test_attach.py.)"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import hybrid

pytestmark = pytest.mark.unit

API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
ENTRY = re.compile(r"^### `([\w.]+)`\n(.*?)(?=^#{1,3} |\Z)", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"```python\n(.*?)```", re.DOTALL)


def documented(text: str) -> dict[str, str | None]:
    """Each ``### `name``` entry of the doc and the signature in its python block (None: it shows none)."""
    entries = {}
    for name, body in ENTRY.findall(text):
        code = CODE.search(body)
        entries[name] = " ".join(code.group(1).split()) if code else None
    return entries


ENTRIES = documented(API_DOC.read_text())


def parameters_of(signature: str) -> list[tuple[str, Any, Any]]:
    """``f(a: int, *, b: str = "x") -> R`` as [(name, kind, default)], defaults evaluated
    (``4 * 2**20``), ``inspect.Parameter.empty`` where there is none."""
    start, depth = signature.index("("), 0
    for end in range(start, len(signature)):
        depth += {"(": 1, ")": -1}.get(signature[end], 0)
        if depth == 0:
            break
    args = ast.parse(f"def f({signature[start + 1:end]}): pass").body[0].args
    empty = inspect.Parameter.empty

    def value(node: ast.expr | None) -> Any:
        return empty if node is None else eval(compile(ast.Expression(node), "api.md", "eval"), {"__builtins__": {}})

    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    found = [(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, value(d)) for a, d in zip(positional, defaults)]
    if args.vararg:
        found.append((args.vararg.arg, inspect.Parameter.VAR_POSITIONAL, empty))
    found += [(a.arg, inspect.Parameter.KEYWORD_ONLY, value(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        found.append((args.kwarg.arg, inspect.Parameter.VAR_KEYWORD, empty))
    return found


def resolve(dotted: str) -> Any:
    """The object ``hybrid.x.y.Name.method`` names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("hybrid"):
                pytest.skip(f"{dotted} needs {exc.name}, not installed")
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def real_parameters(obj: Any) -> list[tuple[str, Any, Any]]:
    found = [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()]
    return found[1:] if found and found[0][0] == "self" else found  # a method named on its class


def test_every_public_name_is_documented():
    missing = [name for name in hybrid.__all__ if f"hybrid.{name}" not in ENTRIES]
    assert missing == [], f"docs/api.md has no '### `hybrid.NAME`' entry for {missing}"
    for callback in ("hybrid.integrations.lightning.HybridCommCallback",
                     "hybrid.integrations.transformers.HybridCommCallback"):
        assert ENTRIES.get(callback), f"docs/api.md shows no signature for {callback}"


@pytest.mark.parametrize("name", sorted(n for n, sig in ENTRIES.items() if sig))
def test_each_documented_signature_is_the_codes(name):
    assert parameters_of(ENTRIES[name]) == real_parameters(resolve(name))


def test_the_checks_can_fail():
    """A parameter missing, renamed, keyword-only or defaulted differently reads as different."""
    real = real_parameters(hybrid.connect)
    for wrong in ("connect(algorithm: str = 'hierarchical')",
                  "connect(algorithm='flat', *, intra_backend='auto', inter_backend='auto', timeout_s=300.0, "
                  "chunk_bytes=4 * 2**20, inter_compression='none', node_rank=None, counters=None)",
                  "connect(algorithm='hierarchical', intra_backend='auto', inter_backend='auto', timeout_s=300.0, "
                  "chunk_bytes=4 * 2**20, inter_compression='none', node_rank=None, counters=None)"):
        assert parameters_of(wrong) != real
    assert parameters_of("connect(algorithm='hierarchical', *, intra_backend='auto', inter_backend='auto', "
                         "timeout_s=300.0, chunk_bytes=4 * 2**20, inter_compression='none', node_rank=None, "
                         "counters=None) -> Attached") == real
    assert documented("### `a.b`\n\n```python\nb(x)\n```\n\n### `a.c`\n\ntext\n## end\n") == {"a.b": "b(x)", "a.c": None}


def test_the_lightning_callbacks_earlier_name_still_imports_and_says_it_is_deprecated():
    callback = resolve("hybrid.integrations.lightning.HybridCommCallback")
    with pytest.warns(DeprecationWarning, match="HybridCommCallback"):
        from hybrid.integrations.lightning import HybridCommHook
    assert HybridCommHook is callback
