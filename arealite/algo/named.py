"""Algorithm pieces named in config: a built-in short name, or ``module:function`` of the user's own.

``algorithm.adv_estimator`` and ``algorithm.policy_loss`` are resolved here, each against
the registry of its own module (``arealite.algo.advantage``, ``arealite.algo.loss``),
which a ``@advantage_estimator("name")`` / ``@policy_loss("name")`` decorator fills.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from arealite.utils.imports import import_callable, is_import_spec


def resolve_named(spec: Any, builtins: Mapping[str, Callable], what: str, field: str,
                  n_args: int, signature: str) -> Callable:
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
    _check_arity(fn, n_args, spec, what, signature)
    return fn


def _check_arity(fn: Callable, n: int, spec: str, what: str, signature: str) -> None:
    """Fail now, not mid-run, when ``fn`` cannot be called with ``n`` positional arguments."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: trust it
        return
    try:
        sig.bind(*([None] * n))
    except TypeError as e:
        raise ValueError(f"{what} {spec!r} cannot be called as {signature}: {e}") from None
