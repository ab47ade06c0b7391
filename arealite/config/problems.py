"""What is wrong with a config: `ConfigProblem` (one field) and `ConfigError` (all of them).

Every check, the loader's own and those of the packages that resolve names in a config
(`ConfigCheck`), reports `ConfigProblem`s; the loader raises them together as one
`ConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import yaml

from arealite.config.yaml12 import Dumper

if TYPE_CHECKING:
    from arealite.config.schema import ArealiteConfig

__all__ = ["ConfigCheck", "ConfigError", "ConfigProblem", "NO_VALUE", "SECRET_FIELDS", "short_value"]

#: Fields whose values are secrets: masked in `dump_config` and in error messages.
SECRET_FIELDS = frozenset({"server.api_key"})

#: `ConfigProblem.value` when there is no value to show (e.g. a YAML syntax error).
NO_VALUE: Any = object()


class ConfigProblem(NamedTuple):
    """One thing wrong with a config: where, what value, what is allowed, from where."""

    path: str
    """Dotted path of the field (`rollout.consumer_batch_size`), or `<file>`/`<override>`."""
    message: str
    """What is wrong and what is allowed."""
    value: Any = NO_VALUE
    """The offending value (absent when there is none, e.g. a YAML syntax error)."""
    source: str | None = None
    """Where the value came from: `cfg.yaml:12` or `override 'a.b=1'`."""

    def format(self) -> str:
        """The problem as one line: `path = value: message  [source]`."""
        head = self.path
        if self.value is not NO_VALUE:
            shown = "***" if self.path in SECRET_FIELDS and self.value is not None else short_value(self.value)
            head = f"{head} = {shown}"
        line = f"{head}: {self.message}"
        if self.source:
            line += f"  [{self.source}]"
        return line.replace("\n", " ")


#: A check of a validated config: ``check(cfg) -> problems`` (empty when all is well).
ConfigCheck = Callable[["ArealiteConfig"], list[ConfigProblem]]


class ConfigError(ValueError):
    """A config that cannot be used; `problems` lists everything found, all at once."""

    def __init__(self, problems: Sequence[ConfigProblem], origin: str | None = None):
        self.problems = list(problems)
        self.origin = origin
        n = len(self.problems)
        where = f" in {origin}" if origin else ""
        lines = [f"{n} config problem{'s' if n != 1 else ''}{where}:"]
        lines += [f"  {p.format()}" for p in self.problems]
        super().__init__("\n".join(lines))


def short_value(value: object, limit: int = 80) -> str:
    """A value as the user would type it, cut to one short line."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (Mapping, list, tuple)):
        try:
            text = yaml.dump(_plain(value), Dumper=Dumper, default_flow_style=True, width=10**6).strip()
        except yaml.YAMLError:
            text = repr(value)
    else:
        text = repr(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plain(value: object) -> object:
    """Mappings and sequences as plain dicts and lists (what the dumper knows), keys as text."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
