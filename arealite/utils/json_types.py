"""Types of JSON values: what crosses an HTTP boundary, a JSONL file or a config's free-form
mapping (workflow kwargs, a dataset item's fields). Precise where ``Any`` would say nothing."""

from __future__ import annotations

from typing import Union

#: Any value JSON can hold.
JsonValue = Union[str, int, float, bool, None, list["JsonValue"], dict[str, "JsonValue"]]
#: A JSON object: a request or response body, a dataset item, a stats record.
JsonObject = dict[str, JsonValue]

__all__ = ["JsonObject", "JsonValue"]
