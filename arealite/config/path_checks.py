"""Checks that a config's model and data paths exist and hold what they should: a Hugging
Face model directory (`actor.model_path`, `server.model_path`), a prompt file or a saved
dataset (`data.train_path`, `data.eval_path`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from arealite.config.problems import ConfigProblem

__all__ = ["PATH_FIELDS", "path_problems"]

_TINY_HINT = "build a tiny one with `python -m arealite.models.tiny DIR --size small`"


def _model_dir_problems(name: str, value: str | None) -> list[ConfigProblem]:
    if not value:
        return [ConfigProblem(name, f"is empty: set it to a Hugging Face model directory ({_TINY_HINT})", value)]
    p = Path(value)
    hint = _TINY_HINT.replace("DIR", value if " " not in value else repr(value))
    if not p.is_dir():
        return [ConfigProblem(name, f"is not an existing directory ({hint})", value)]
    if not (p / "config.json").is_file():
        return [ConfigProblem(
            name, f"has no config.json, so it is not a Hugging Face model directory ({hint})", value,
        )]
    return []


#: The dotted fields `path_problems` judges.
PATH_FIELDS = ("actor.model_path", "server.model_path", "data.train_path", "data.eval_path")


def path_problems(values: Mapping[str, str | None]) -> list[ConfigProblem]:
    """Problems of the model and data paths in `values` (dotted path -> value)."""
    out = _model_dir_problems("actor.model_path", values["actor.model_path"])
    if values["server.model_path"] is not None:
        out += _model_dir_problems("server.model_path", values["server.model_path"])
    for name in ("data.train_path", "data.eval_path"):
        value = values[name]
        if not value or Path(value).is_file():
            continue
        if not Path(value).is_dir():
            out.append(ConfigProblem(name, "does not exist (give a JSONL or Parquet file of prompts, "
                                     "or a directory saved by `datasets.Dataset.save_to_disk`)", value))
        elif not any((Path(value) / f).is_file() for f in ("state.json", "dataset_dict.json")):
            out.append(ConfigProblem(name, "is a directory but not one saved by `datasets.Dataset."
                                     "save_to_disk` (no state.json): give a JSONL or Parquet file", value))
    return out
