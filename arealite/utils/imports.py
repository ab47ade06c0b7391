"""Import an object named ``module:name`` (``name`` may be dotted: ``module:Class.method``).

The one way config values name user code: reward functions, workflows, advantage
estimators and policy losses. Errors say which config field named what and why it failed.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable, TypeVar

SPEC_RE = re.compile(r"^[\w.]+:[\w.]+$")


def is_import_spec(value: str) -> bool:
    """Whether `value` has the ``module:name`` form (it may still fail to import)."""
    return bool(SPEC_RE.match(value))


def import_object(spec: str, what: str = "object") -> Any:
    """The object ``spec`` = ``module:name`` names; raises ImportError/AttributeError/TypeError
    with a message that quotes `spec` and says what it was meant to be (`what`)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TypeError(f"{what} {spec!r} must be written 'module:name' (e.g. mypkg.rewards:exact_match)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_name!r} of {what} {spec!r}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r} ({what} {spec!r})")
        obj = getattr(obj, part)
    return obj


def import_callable(spec: str, what: str = "function") -> Any:
    """`import_object`, and the object must be callable (a function or a class)."""
    obj = import_object(spec, what)
    if not callable(obj):
        raise TypeError(f"{what} {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


_F = TypeVar("_F", bound=Callable)


def register_into(registry: dict[str, _F], name: str, what: str) -> Callable[[_F], _F]:
    """A decorator that adds a function or class to ``registry`` under ``name`` (one name,
    one object): how built-ins that config names by a short name are declared."""

    def register(obj: _F) -> _F:
        if name in registry and registry[name] is not obj:
            raise ValueError(f"two built-in {what}s are named {name!r}: "
                             f"{registry[name].__qualname__} and {obj.__qualname__}")
        registry[name] = obj
        return obj

    return register
