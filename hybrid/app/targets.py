"""The pluggable parts of a run (model, data, loss, optimizer), given as Hydra ``_target_`` nodes.

Every research codebase on Hydra plugs its parts this way: a config node names
a class or function by its import path (``_target_``) and holds its keyword
arguments; ``hydra.utils.instantiate`` builds it. hybrid's built-in models,
datasets, loss and optimizers are configs of this same mechanism, so a user's
own ``--config-dir`` can add a ``model/mynet.yaml`` beside ``model/mlp.yaml``
and sweep over both.

A node may also hold a few keys that are hybrid's, not the target's (the data
loader's ``batch_size``, the optimizer's LR schedule): they are split off here,
at the edge, into typed settings, and never passed to the target.

Building fails with one line that names the node, the target and the reason
(an unimportable path, a missing or unexpected argument, the target's own
error), so ``hybrid.train`` can refuse a bad config before anything starts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate

__all__ = ["Component", "ComponentError", "component_of", "current_target", "first_line", "label_of", "require_int"]

# Built-in components named directly under hybrid.app, as older configs, sweeps and checkpoints name them:
# they keep working, read as the same names under hybrid.app.components.
MOVED_MODULES = {
    "hybrid.app.models.": "hybrid.app.components.models.",
    "hybrid.app.datasets.": "hybrid.app.components.datasets.",
    "hybrid.app.losses.": "hybrid.app.components.losses.",
}

# Keys of a node that instantiate reads itself (besides _target_); they stay with the target's arguments.
HYDRA_KEYS = ("_partial_", "_recursive_", "_convert_", "_args_")


class ComponentError(ValueError):
    """A component that cannot be built or used; its message is one line naming the node."""


def label_of(target: str) -> str:
    """A short name for reports and TensorBoard: the target's last part, lower case (``torch.optim.SGD`` ->
    ``sgd``, ``mypkg.MyNet`` -> ``mynet``)."""
    return target.rsplit(".", 1)[-1].lower()


@dataclass(frozen=True)
class Component:
    """One ``_target_`` node: where it sits in the config (``key``), what it builds and with which arguments.

    ``args`` are the target's keyword arguments as composed (interpolations resolved), including Hydra's own
    ``_partial_`` and friends; hybrid's keys of the node are not among them."""

    key: str
    target: str
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return label_of(self.target)

    @property
    def node(self) -> dict[str, Any]:
        """The node as it would be written in a config (without hybrid's keys)."""
        return {"_target_": self.target, **self.args}

    def get(self, name: str, default: Any = None) -> Any:
        return self.args.get(name, default)

    def build(self, *args: Any) -> Any:
        """``instantiate`` the node; with ``args``, call what it built with them (a ``_partial_`` optimizer class
        with the parameters)."""
        try:
            built = instantiate(self.node)
        except InstantiationException as exc:
            raise ComponentError(self._why(exc)) from exc
        except Exception as exc:  # raised by the target itself, outside instantiate's wrapping
            raise ComponentError(self._failed(exc)) from exc
        if not args:
            return built
        try:
            return built(*args)
        except Exception as exc:
            raise ComponentError(self._failed(exc)) from exc

    def _failed(self, exc: BaseException) -> str:
        if isinstance(exc, ComponentError):
            return str(exc)
        if isinstance(exc, ValueError) and str(exc).startswith(f"{self.key}."):
            return first_line(exc)  # a built-in's own check names its key already
        line = f"{self.key}._target_={self.target}: {type(exc).__name__}: {first_line(exc)}"
        if isinstance(exc, TypeError) and self.args:  # often a value of the wrong type: show what was given
            given = ", ".join(f"{k}={v!r}" for k, v in self.args.items() if k not in HYDRA_KEYS)
            line += f" (given {given})" if given else ""
        return line

    def _why(self, exc: InstantiationException) -> str:
        problem = import_problem(self.key, self.target)
        if problem is not None:
            return problem
        if exc.__cause__ is not None:
            return self._failed(exc.__cause__)
        return f"{self.key}._target_={self.target}: {first_line(exc)}"


def first_line(exc: BaseException | None) -> str:
    """The first line of an error's message (its type's name where it has none): what a one-line error quotes."""
    text = str(exc).strip() if exc is not None else ""
    return text.splitlines()[0] if text else type(exc).__name__


def require_int(key: str, value: Any, low: int) -> None:
    """The built-in components' size check: ``key`` (``model.width``, ``data.seq_len``) an integer >= ``low``."""
    if not isinstance(value, int) or value < low:
        raise ValueError(f"{key}={value!r} must be an integer >= {low}")


def current_target(target: Any) -> Any:
    """``target`` with a built-in component's path under ``hybrid.app`` replaced by its path under
    ``hybrid.app.components`` (anything else as is)."""
    if isinstance(target, str):
        for old, new in MOVED_MODULES.items():
            if target.startswith(old):
                return new + target[len(old):]
    return target


def locate_problem(target: str) -> str | None:
    """Why ``target`` (``pkg.module.Name``) cannot be found, or None when it can: the module that does not
    exist, the name a module lacks, or the error importing a module raised."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                continue  # this prefix is not a module: try a shorter one
            return f"importing {module} raised ModuleNotFoundError: {first_line(exc)}"
        except Exception as exc:
            return f"importing {module} raised {type(exc).__name__}: {first_line(exc)}"
        for depth, attr in enumerate(parts[i:], start=i):
            if not hasattr(obj, attr):
                return f"{'.'.join(parts[:depth])} has no attribute {attr!r}"
            obj = getattr(obj, attr)
        return None
    return f"no module named {parts[0]!r}"


def import_problem(key: str, target: str) -> str | None:
    """The one line for a ``_target_`` that cannot be imported, naming the module first; None if it can."""
    problem = locate_problem(target)
    if problem is None:
        return None
    return (f"{key}._target_={target} cannot be imported ({problem}): give the import path of a class or function, "
            "with its package on PYTHONPATH")


def _as_type_of(key: str, value: Any, default: Any) -> Any:
    """A hybrid key of an open node, typed as its default is (the schema cannot type an open node)."""
    kind = type(default)
    if kind is str and isinstance(value, (int, float)):
        return str(value)  # then checked against the allowed choices
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    try:
        if kind is int and float(value) == int(float(value)):
            return int(float(value))
        if kind is float and not isinstance(value, bool):
            return float(value)
    except (TypeError, ValueError):
        pass
    raise ComponentError(f"{key}={value!r} is not a{'n' if kind is int else ''} {kind.__name__}")


def component_of(key: str, node: Any, own: dict[str, Any] | None = None) -> tuple[Component, dict[str, Any]]:
    """Split a composed node into the component and hybrid's keys (``own``: their names and defaults).

    Raises one line when the node is not a ``_target_`` node."""
    if not isinstance(node, dict):
        raise ComponentError(f"{key}={node!r} is not a config node: give {key}._target_ and its arguments")
    own = own or {}
    target = current_target(node.get("_target_"))
    if not isinstance(target, str) or not target:
        raise ComponentError(f"{key} has no _target_: give {key}._target_=<import path of a class or function> "
                             f"(or pick one of the shipped {key} configs)")
    # Before anything that depends on the target (data.kind=auto asks what a model takes): a module that does not
    # exist is the first thing to fix, and would otherwise be reported only after following other advice.
    problem = import_problem(key, target)
    if problem is not None:
        raise ComponentError(problem)
    mine = {name: _as_type_of(f"{key}.{name}", node.get(name, default), default) for name, default in own.items()}
    args = {k: v for k, v in node.items() if k != "_target_" and k not in own}
    return Component(key, target, args), mine
