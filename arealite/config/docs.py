"""Generate docs/config_reference.md from the schema, so the reference cannot drift.

    python -m arealite.config docs > docs/config_reference.md
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Literal

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from arealite.config.cross_field_checks import CROSS_FIELD_CHECKS
from arealite.config.loader import _section_model
from arealite.config.schema import ArealiteConfig
from arealite.config.yaml12 import Dumper

REGENERATE = "python -m arealite.config docs > docs/config_reference.md"

_INTRO = f"""\
# Config reference

<!-- Generated from arealite/config/schema.py by `{REGENERATE}`.
     Do not edit by hand: tests/test_config.py fails when this file is stale. -->

An arealite run is configured by one YAML file whose top-level keys are the
sections below; every key is optional (the default is the recommended value)
and every key can be overridden on the command line with its dotted path:

```bash
python -m arealite.train --config examples/configs/default.yaml \\
    actor.optimizer.lr=1e-5 generation.stop_token_ids=[1,2]
python -m arealite.config show examples/configs/default.yaml server.api_key=null   # effective config
python -m arealite.check examples/configs/default.yaml                             # validate, paths too
```

Values (in files and in overrides) follow the YAML 1.2 core rules: only
`true`/`false` are booleans, `null` (or nothing) is null, `1e-5` is a number,
`[1, 2]` is a list, and everything else, `no`, `on` and `01:30` included, is a
string. Unknown keys, duplicate keys, wrong types and values out of range are
errors that name the dotted path, the value and what is allowed; all problems
are reported together, before anything starts. Relative paths are relative to
the directory the command runs in.
"""


def _scalar(value: object) -> str:
    """A default value as it would be written in YAML."""
    text = yaml.dump(value, Dumper=Dumper, default_flow_style=True, width=10**6)
    return text.removesuffix("\n...\n").strip()


def _type_name(annotation: object) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(f"`{_scalar(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"mapping {_type_name(args[0])} → {_type_name(args[1])}"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(field: FieldInfo) -> str:
    words = []
    for m in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if isinstance(m, getattr(annotated_types, attr.capitalize())):
                words.append(f"{sign} {getattr(m, attr)}")
        if isinstance(m, annotated_types.MinLen) and m.min_length:
            words.append("not empty")
    return ", ".join(words)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _section_tables(model: type[BaseModel], prefix: str, description: str, depth: int) -> list[str]:
    out = [f"{'#' * depth} `{prefix}`", "", _cell(description), ""]
    rows, nested = [], []
    for name, field in model.model_fields.items():
        sub = _section_model(field.annotation)
        if sub is not None:
            nested.append((sub, f"{prefix}.{name}", field.description or ""))
            rows.append(f"| `{prefix}.{name}` | section | | {_cell(field.description or '')} Table below. |")
            continue
        kind = _type_name(field.annotation)
        rule = _constraints(field)
        if rule:
            kind += f" ({rule})"
        default = _scalar(field.get_default(call_default_factory=True))
        rows.append(f"| `{prefix}.{name}` | {_cell(kind)} | `{_cell(default)}` | {_cell(field.description or '')} |")
    out += ["| key | type | default | description |", "|---|---|---|---|", *rows, ""]
    for sub, sub_prefix, sub_desc in nested:
        out += _section_tables(sub, sub_prefix, sub_desc, depth + 1)
    return out


def render_reference() -> str:
    """The Markdown config reference: one table per section, then the cross-field rules."""
    lines = [_INTRO]
    lines.append("Sections: " + ", ".join(f"[`{n}`](#{n})" for n in ArealiteConfig.model_fields) + ".\n")
    for name, field in ArealiteConfig.model_fields.items():
        section = _section_model(field.annotation)
        assert section is not None, name
        lines += _section_tables(section, name, field.description or "", 2)
    lines += [
        "## Rules across fields",
        "",
        "Checked together with the field rules, all reported in one round (a rule that involves a field "
        "whose own value is invalid waits until that value is fixed):",
        "",
        *[f"- {_cell(inspect.getdoc(check) or check.__name__)}" for check in CROSS_FIELD_CHECKS],
        "- Names, checked by the packages that resolve them, in the same round wherever a run's config "
        "is loaded (`python -m arealite.check`, the launchers, `python -m arealite.train`) and when "
        "`RLTrainer` is made: `algorithm.adv_estimator` and `algorithm.policy_loss` name a built-in or "
        "an importable function that takes the estimator's or the loss's arguments; `data.reward_fn` "
        "names an importable callable; `rollout.workflow` names a built-in or importable workflow "
        "class, and `rollout.workflow_kwargs` fits its constructor.",
        "- Path checks (`python -m arealite.check`, `load_config(..., check_paths=True)`, "
        "the default): `actor.model_path`, and `server.model_path` when set, are Hugging Face model "
        "directories with a `config.json` (build a tiny one with `python -m arealite.models.tiny DIR`); "
        "`data.train_path` and `data.eval_path`, when set, are existing files.",
        "- The local launcher also checks: `launch.n_servers: 0` needs `launch.server_addrs` or the "
        "environment variable `AREALITE_SERVER_ADDRS=host:port,...`; `launch.server_addrs` with "
        "`launch.n_servers` > 0 is a contradiction; `weight_sync.method: shm` needs every server "
        "address on this host.",
        "",
    ]
    return "\n".join(lines)
