"""Load an arealite config: a YAML file, dotted command-line overrides, validation.

    cfg = load_config("examples/configs/default.yaml", ["actor.optimizer.lr=1e-5"])

Every problem is reported at once, before anything starts, as a `ConfigError`
whose message has one line per problem: the dotted path of the field, the bad
value, what is allowed, and where the value came from (file and line, or the
override). YAML is read with the YAML 1.2 core rules (only `true`/`false` are
booleans, `1e-5` is a float, `no`, `on` and `2024-01-01` stay strings), both in
files and in override values, and duplicate keys are an error.

The loader judges what the config alone can tell: the fields' own rules (the sections'
classes), the rules across them (`cross_field_checks`, `algo_checks`) and the paths
(`path_checks`). Names that only the packages above it can resolve (advantage estimator,
policy loss, reward function, workflow) are checked by their owners: `arealite.check`
passes those checks in as `extra_checks`, so that they are reported in the same round.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from arealite.config.cross_field_checks import CROSS_FIELD_CHECKS, config_problems
from arealite.config.path_checks import PATH_FIELDS, path_problems
from arealite.config.problems import NO_VALUE, SECRET_FIELDS, ConfigCheck, ConfigError, ConfigProblem, short_value
from arealite.config.schema import ArealiteConfig
from arealite.config.yaml12 import Dumper, Loader, error_text

__all__ = [
    "ConfigCheck",
    "ConfigError",
    "ConfigProblem",
    "SECRET_FIELDS",
    "dump_config",
    "load_config",
    "parse_args",
    "parse_override_value",
    "split_config_args",
]

# --------------------------------------------------------------------------- reading YAML


def _read_yaml_file(path: Path) -> tuple[Any, dict[str, int]]:
    """Parse a YAML file; return the data and the line of every mapping key (dotted)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([ConfigProblem("<file>", f"config file {str(path)!r} does not exist")], str(path)) from None
    except IsADirectoryError:
        raise ConfigError([ConfigProblem("<file>", f"config path {str(path)!r} is a directory, not a YAML file")], str(path)) from None
    except UnicodeDecodeError as e:
        raise ConfigError([ConfigProblem("<file>", f"{path} is not UTF-8 text ({e.reason} at byte {e.start})")], str(path)) from None
    loader = Loader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(
            [ConfigProblem("<file>", f"invalid YAML: {error_text(e)}", source=where)], str(path)
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError([ConfigProblem("<file>", f"invalid YAML: {e}", source=str(path))], str(path)) from None
    finally:
        loader.dispose()
    lines: dict[str, int] = {}
    _record_key_lines(node, "", lines)
    return data, lines


def _record_key_lines(node: yaml.Node | None, prefix: str, out: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                path = prefix + str(key_node.value)
                out.setdefault(path, key_node.start_mark.line + 1)
                _record_key_lines(value_node, path + ".", out)


def parse_override_value(text: str) -> Any:
    """Parse the value of `key=value` with YAML 1.2 flow rules.

    `1e-5` -> float, `8` -> int, `true` -> bool, `null` or nothing -> None,
    `[1, 2]` -> list, `{a: 1}` -> dict, anything else -> the string itself.
    """
    loader = Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


# --------------------------------------------------------------------------- schema walking


def _section_model(annotation: object) -> type[BaseModel] | None:
    """The section class of a field annotation (`ActorConfig`, `X | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None


def _is_mapping_field(annotation: object) -> bool:
    return typing.get_origin(annotation) in (dict, Mapping)


def _model_at(path: Sequence[str]) -> type[BaseModel] | None:
    """The section class at a dotted path of section names (`[]` is the root)."""
    model: type[BaseModel] | None = ArealiteConfig
    for part in path:
        if model is None or part not in model.model_fields:
            return None
        model = _section_model(model.model_fields[part].annotation)
    return model


def _unknown_key_message(model: type[BaseModel], section: str, key: str) -> str:
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    what = f"keys of {section}" if section else "sections"
    return f"unknown key {key!r}; {hint}allowed {what}: {', '.join(allowed)}"


def _check_override_path(parts: list[str]) -> tuple[str, str] | None:
    """(dotted path, why) when `parts` names no settable field of the schema, else None."""
    model: type[BaseModel] = ArealiteConfig
    for i, part in enumerate(parts):
        section = ".".join(parts[:i])
        if part not in model.model_fields:
            return ".".join(parts[: i + 1]), _unknown_key_message(model, section, part)
        annotation = model.model_fields[part].annotation
        rest = parts[i + 1 :]
        if not rest:
            return None
        sub = _section_model(annotation)
        if sub is not None:
            model = sub
            continue
        here = ".".join(parts[: i + 1])
        if _is_mapping_field(annotation) and len(rest) == 1:
            return None  # one entry of a mapping field, e.g. launch.trainer_env.NAME
        return ".".join(parts), (
            f"{here} is a value, not a section: it has no key {'.'.join(rest)!r}; "
            f"set the value itself ({here}=...)"
        )
    return None


# --------------------------------------------------------------------------- loading


def _source_of(path: str, sources: Mapping[str, str]) -> str | None:
    """The source of the longest recorded prefix of a dotted path."""
    parts = path.replace("[", ".[").split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n]).replace(".[", "[")
        if key in sources:
            return sources[key]
    return None


def _loc_to_path(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _string_keys(obj: object) -> object:
    """Mapping keys as the text the user wrote (`1: x` is key '1'), so errors name them."""
    if isinstance(obj, dict):
        return {(k if isinstance(k, str) else short_value(k)): _string_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_string_keys(v) for v in obj]
    return obj


def _drop_empty_sections(raw: dict, model: type[BaseModel]) -> None:
    """Treat a section written with no keys (`actor:` -> None in YAML) as empty."""
    for name in list(raw):
        if name not in model.model_fields:
            continue
        sub = _section_model(model.model_fields[name].annotation)
        if sub is None:
            continue
        if raw[name] is None:
            del raw[name]
        elif isinstance(raw[name], dict):
            _drop_empty_sections(raw[name], sub)


def _apply_override(raw: dict, override: str, sources: dict[str, str]) -> ConfigProblem | None:
    """Set one `a.b.c=value` in the raw config dict; return a problem instead if it is bad."""
    key, sep, text = override.partition("=")
    key = key.strip()
    src = f"override {override!r}" if key not in SECRET_FIELDS else f"override '{key}=***'"
    if not sep or not key:
        return ConfigProblem(
            "<override>",
            f"{override!r} is not `dotted.key=value` (e.g. actor.optimizer.lr=1e-5)",
        )
    parts = key.split(".")
    if any(not p for p in parts):
        return ConfigProblem(key, "empty name in dotted key (two dots, or a leading/trailing dot)", source=src)
    bad = _check_override_path(parts)
    if bad:
        return ConfigProblem(bad[0], bad[1], source=src)
    try:
        value = parse_override_value(text)
    except yaml.YAMLError as e:
        shown = repr(text) if key not in SECRET_FIELDS else "***"
        return ConfigProblem(
            key, f"cannot parse the value {shown} as YAML: {error_text(e)}; "
            "quote strings with special characters", source=src,
        )
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            return ConfigProblem(
                key, f"cannot be set: {where} is {short_value(child)} in the config, not a mapping",
                source=src,
            )
        node = child
    last = parts[-1]
    if isinstance(node.get(last), dict) and isinstance(value, dict):
        node[last] = _deep_merge(node[last], value)
    else:
        node[last] = value
    # The override now owns this path and everything under it.
    for k in [k for k in sources if k == key or k.startswith(key + ".")]:
        del sources[k]
    sources[key] = src
    return None


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _deep_merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def _validation_problems(err: ValidationError, sources: Mapping[str, str]) -> list[ConfigProblem]:
    """pydantic errors -> problems with dotted paths, the bad input and the rule."""
    problems = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        path = _loc_to_path(loc)
        value = e.get("input", NO_VALUE)
        kind = e["type"]
        # pydantic says "Input should be ..."; name the rule as the field's own.
        msg = e["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
        str_loc = [str(p) for p in loc]
        if kind == "extra_forbidden":
            parent = _model_at(str_loc[:-1])
            if parent is not None:
                msg = _unknown_key_message(parent, ".".join(str_loc[:-1]), str_loc[-1])
        elif kind in ("list_type", "tuple_type", "set_type"):
            msg = "must be a list, written [a, b] ([] for none)"
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            section = _model_at(str_loc)
            if section is not None:
                what = f"the section {path}" if path else "the top level of a config"
                msg = (
                    f"{what} must be a mapping of keys to values (got {type(value).__name__}); "
                    f"allowed keys: {', '.join(section.model_fields)}"
                )
        problems.append(ConfigProblem(path or "<config>", msg, value, _source_of(path, sources)))
    return problems


def load_config(
    path: str | os.PathLike | None,
    overrides: Sequence[str] = (),
    *,
    check_paths: bool = True,
    extra_checks: Sequence[ConfigCheck] = (),
) -> ArealiteConfig:
    """Load a YAML config (defaults when `path` is None), apply overrides, validate.

    `overrides` are `dotted.key=value` strings; values follow YAML flow rules.
    With `check_paths`, model and data paths must exist (turn it off to inspect
    a config before its model is built). `extra_checks` run beside the cross-field
    checks: the checks of names that only the packages above config can resolve
    (`arealite.check.RUN_CHECKS`). Raises `ConfigError` listing every problem.
    """
    sources: dict[str, str] = {}
    origin = str(path) if path is not None else None
    raw: Any = {}
    if path is not None:
        file_path = Path(path)
        data, lines = _read_yaml_file(file_path)
        sources.update({k: f"{file_path}:{n}" for k, n in lines.items()})
        if data is None:
            data = {}  # an empty file (or only comments) means all defaults
        if not isinstance(data, dict):
            raise ConfigError(
                [ConfigProblem(
                    "<config>",
                    "the top level of a config must be a mapping of sections "
                    f"({', '.join(ArealiteConfig.model_fields)})",
                    value=data, source=str(file_path),
                )],
                origin,
            )
        raw = data
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
    problems = []
    for override in overrides:
        problem = _apply_override(raw, str(override), sources)
        if problem is not None:
            problems.append(problem)
    raw = _string_keys(raw)
    _drop_empty_sections(raw, ArealiteConfig)
    try:
        cfg = ArealiteConfig.model_validate(raw)
    except ValidationError as e:
        problems += _validation_problems(e, sources)
        # Report missing model/data paths in the same round, when they can be read.
        invalid = {p.path for p in problems}
        values = _raw_path_values(raw, invalid) if check_paths else None
        if values is not None:
            problems += [p._replace(source=_source_of(p.path, sources)) for p in path_problems(values)]
        problems += [
            p._replace(source=p.source or _source_of(p.path, sources))
            for p in _cross_field_problems_around(raw, invalid, extra_checks)
        ]
        raise ConfigError(problems, origin) from None
    problems += [
        p._replace(source=p.source or _source_of(p.path, sources))
        for p in config_problems(cfg, check_paths=check_paths, extra_checks=extra_checks)
    ]
    if problems:
        raise ConfigError(problems, origin)
    return cfg


# --------------------------------------------------------------------------- problems around invalid fields


def _raw_path_values(raw: object, invalid: set[str]) -> dict[str, str | None] | None:
    """The path fields of a config that failed validation, when all of them are usable."""
    defaults = ArealiteConfig()
    values = {}
    for dotted in PATH_FIELDS:
        section, field = dotted.split(".")
        if dotted in invalid or section in invalid:
            return None
        node = raw.get(section) if isinstance(raw, dict) else None
        if isinstance(node, dict) and field in node:
            value = node[field]
        else:
            value = getattr(getattr(defaults, section), field)
        if value is not None and not isinstance(value, str):
            return None
        values[dotted] = value
    return values


def _cross_field_problems_around(raw: object, invalid: set[str],
                                 extra_checks: Sequence[ConfigCheck]) -> list[ConfigProblem]:
    """Cross-field problems of a config whose fields are not all valid, so that one round reports both.

    Each invalid value is put back to its default; a rule whose message or
    path names an invalid field is left out (it would judge a value the user
    did not write).
    """
    if not isinstance(raw, dict) or "<config>" in invalid:
        return []
    patched = copy.deepcopy(raw)
    for path in invalid:
        # Drop the value: down the sections as far as they go, then the key there.
        node, keys = patched, path.split("[")[0].split(".")
        while len(keys) > 1 and isinstance(node.get(keys[0]), dict):
            node = node[keys.pop(0)]
        node.pop(keys[0], None)
    try:
        cfg = ArealiteConfig.model_validate(patched)
    except ValidationError:
        return []
    names = {p.split("[")[0] for p in invalid}
    return [
        p for check in (*CROSS_FIELD_CHECKS, *extra_checks) for p in check(cfg)
        if not any(n == p.path or n in p.message for n in names)
    ]


# --------------------------------------------------------------------------- dumping, scripts


def dump_config(cfg: ArealiteConfig, *, mask_secrets: bool = True) -> str:
    """The config as YAML that `load_config` reads back (secrets shown as `***`)."""
    data = cfg.model_dump(mode="json")
    if mask_secrets:
        for dotted in SECRET_FIELDS:
            *parents, leaf = dotted.split(".")
            node = data
            for p in parents:
                node = node[p]
            if node.get(leaf) is not None:
                node[leaf] = "***"
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)


def split_config_args(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """`[CFG] key=value ...`: the first item is the file unless it is an override."""
    items = list(items)
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def parse_args(
    argv: Sequence[str] | None = None,
    *,
    check_paths: bool = True,
    exit_on_error: bool = True,
    prog: str | None = None,
    extra_checks: Sequence[ConfigCheck] = (),
) -> ArealiteConfig:
    """Config of a training script from its command line: `--config CFG key=value ...`.

    On a bad config, prints every problem and exits with status 2 (like
    argparse); with `exit_on_error=False` raises `ConfigError` instead.
    `extra_checks` as in `load_config`.
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Options are config overrides `dotted.key=value` (e.g. actor.optimizer.lr=1e-5); "
        "see docs/config_reference.md or `python -m arealite.config docs`.",
    )
    parser.add_argument("--config", "-c", default=None, help="YAML config file (default: all defaults)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return load_config(args.config, args.overrides, check_paths=check_paths, extra_checks=extra_checks)
    except ConfigError as e:
        if not exit_on_error:
            raise
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
