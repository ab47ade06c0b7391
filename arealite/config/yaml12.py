"""PyYAML with the YAML 1.2 core rules for plain scalars, and duplicate keys as errors.

PyYAML implements YAML 1.1, where `no`/`on` are booleans, `1e-5` is a string, `010` is
octal and `1:30` is 90: all surprises in a config file. `Loader` reads configs and
override values; `Dumper` writes what `Loader` reads back the same.
"""

from __future__ import annotations

import math
import re

import yaml

__all__ = ["Dumper", "Loader", "error_text"]


def _yaml12_resolvers(cls: type) -> None:
    """Give a PyYAML loader or dumper class the YAML 1.2 core rules for plain scalars."""
    keep = {"tag:yaml.org,2002:null", "tag:yaml.org,2002:merge"}
    cls.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in rules if tag in keep]
        for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    cls.add_implicit_resolver(
        "tag:yaml.org,2002:bool",
        re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
        list("tTfF"),
    )
    cls.add_implicit_resolver(
        "tag:yaml.org,2002:int",
        re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
        list("-+0123456789"),
    )
    cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?"
            r"|[-+]?[0-9]+[eE][-+]?[0-9]+"
            r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
        ),
        list("-+.0123456789"),
    )


class Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core scalars and an error on duplicate keys."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[object, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key; the base class reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key!r} (first given on line {first}); "
                        "remove one of them",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        sign = -1 if text.startswith("-") else 1
        digits = text.lstrip("+-")
        if digits.startswith("0x"):
            return sign * int(digits[2:], 16)
        if digits.startswith("0o"):
            return sign * int(digits[2:], 8)
        return sign * int(digits, 10)

    def construct_yaml_float(self, node):
        text = self.construct_scalar(node).lower()
        if text.endswith(".inf"):
            return -math.inf if text.startswith("-") else math.inf
        if text.endswith(".nan"):
            return math.nan
        return float(text)


_yaml12_resolvers(Loader)
Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
Loader.add_constructor("tag:yaml.org,2002:float", Loader.construct_yaml_float)


class Dumper(yaml.SafeDumper):
    """SafeDumper that quotes exactly the strings `Loader` would not read as strings."""


_yaml12_resolvers(Dumper)


def error_text(err: yaml.YAMLError) -> str:
    """A YAML error as one short line: its context (with the line) and its problem."""
    context, mark = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and mark is not None:
        context += f" (line {mark.line + 1})"
    parts = [context, getattr(err, "problem", None)]
    text = "; ".join(p for p in parts if p)
    return text or str(err).splitlines()[0]
