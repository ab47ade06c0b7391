"""The experiment's identity and files: its name, output directory and seed (`experiment`),
periodic checkpoints (`saver`) and resuming a killed run (`recover`).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from arealite.config.section import Section


# Experiment and trial names become directory names under `output_root`.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _check_dir_name(value: str) -> str:
    if not _NAME_RE.match(value):
        raise ValueError(
            "must be a non-empty directory name of letters, digits, '.', '_' or '-' "
            "(no '/' or spaces), starting with a letter or digit"
        )
    return value


class ExperimentConfig(Section):
    name: str = "arealite"
    """Experiment name; runs are written under `<output_root>/<name>/<trial>`."""
    trial: str = "trial0"
    """Trial name within the experiment; re-running the same name resumes it."""
    output_root: str = "runs"
    """Root directory of all run outputs (logs, checkpoints, stats, plots)."""
    seed: int = 1
    """Global random seed (torch, python, numpy, data shuffling, server sampling)."""

    @field_validator("name", "trial")
    @classmethod
    def _dir_name(cls, v: str) -> str:
        return _check_dir_name(v)


class SaverConfig(Section):
    freq_steps: int | None = Field(None, ge=1)
    """Checkpoint every this many steps (None = not by steps)."""
    freq_secs: float | None = Field(None, gt=0)
    """Checkpoint every this many seconds (None = not by time)."""
    keep_last: int = Field(2, ge=1)
    """Complete checkpoints kept; older ones are deleted."""
    export_hf_at_end: bool = True
    """Export the final model as a Hugging Face directory (`final_model`; with `actor.lora`, the
    PEFT adapter directory)."""
    export_merged_at_end: bool = False
    """With `actor.lora`: also export the base with the adapter merged in, a full Hugging Face
    directory any server loads without LoRA support (`final_model_merged`)."""


class RecoverConfig(Section):
    mode: Literal["auto", "disabled", "required"] = "auto"
    """`auto`: resume if a checkpoint exists; `disabled`: always start fresh; `required`: fail without one."""
    allow_pickle: bool = False
    """Resume from a checkpoint whose rollout state holds Python objects other than tensors and
    plain data (e.g. dataset items of your own classes). Off: such a file is refused, since
    unpickling it could run code; turn on only for a run directory no one else can write."""
