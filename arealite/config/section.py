"""The base of every config section (its own module so that section modules can share it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings are descriptions."""

    # coerce_numbers_to_str: YAML reads `trial: 2` or `api_key: 1234` as numbers;
    # for a string field the user meant the digits, so accept them as text.
    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        coerce_numbers_to_str=True,
    )
