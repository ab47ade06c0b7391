"""Algorithm pieces named in config: a built-in short name, or ``module:function`` of the user's own.

``algorithm.adv_estimator`` and ``algorithm.policy_loss`` are resolved here, each against
the registry of its own module (``arealite.algo.advantage``, ``arealite.algo.loss``),
which a ``@advantage_estimator("name")`` / ``@policy_loss("name")`` decorator fills. Each of
those modules also checks its config name before a run starts (``estimator_problems``,
``policy_loss_problems``, run by ``arealite.check``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TypeVar

from arealite.utils.imports import import_callable, is_import_spec

_F = TypeVar("_F", bound=Callable[..., object])


def resolve_named(spec: str | _F, builtins: Mapping[str, _F], what: str, field: str,
                  n_args: int, signature: str) -> _F:
    """The function ``spec`` names: itself if callable, a key of ``builtins``, or ``module:function``.

    ``what`` (``advantage estimator``) and ``field`` (``algorithm.adv_estimator``) shape the
    messages; an imported function must accept ``n_args`` positional arguments, as
    ``signature`` (``fn(a, b) -> c``) shows. Raises ``ValueError`` naming the value and the
    built-in names.
    """
    if callable(spec):
        return spec
    if spec in builtins:
        return builtins[spec]
    names = ", ".join(sorted(builtins))
    if not isinstance(spec, str) or not is_import_spec(spec):
        raise ValueError(f"{spec!r} is neither a built-in {what} ({names}) nor 'module:function' "
                         f"naming your own ({field})")
    try:
        fn = import_callable(spec, f"{what} ({field})")
    except (ImportError, AttributeError, TypeError, SyntaxError) as e:
        raise ValueError(f"{e}; the built-in {what}s are {names}") from None
    _check_arity(fn, n_args, f"{what} {spec!r} ({field})", signature)
    return fn


def _check_arity(fn: Callable[..., object], n: int, named: str, signature: str) -> None:
    """Fail now, not mid-run, when ``fn`` (``named`` in messages) cannot be called with ``n``
    positional arguments."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: trust it
        return
    try:
        sig.bind(*([None] * n))
    except TypeError as e:
        raise ValueError(f"{named} cannot be called as {signature}: {e}") from None
